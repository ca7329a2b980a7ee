#!/usr/bin/env bash
# The GPU suite in one device call: every test marked `gpu`, spread over pytest-xdist workers where it is installed
# (Triton's compiles at production shapes are CPU-bound), under a deadline so that the call always comes back with a
# verdict: which tests passed or failed, which did not finish, and the slowest.
#
# Usage on the GPU machine, from the repository root:
#   [DEADLINE=500] [WORKERS=12] [TEST_TIMEOUT=180] bash scripts/gpu_suite.sh [pytest args, e.g. -k "not two_gpus"]
# $OUT (default ./out) gets gpu_tests.log, collected.txt and unfinished.txt. Exit status 0 when every collected test
# finished and none failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"
DEADLINE="${DEADLINE:-500}"
WORKERS="${WORKERS:-12}"
mkdir -p "$OUT"
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider "$@" tests 2>/dev/null | grep '::' | sort -u >"$OUT/collected.txt"
workers=()
python3 -c 'import xdist' 2>/dev/null && workers=(-n "$WORKERS")
# A test past TEST_TIMEOUT seconds fails with every thread's stack (where it waits) instead of holding its worker
# to the deadline (pytest-timeout); without that plugin, pytest's faulthandler_timeout prints the stacks, runs on.
if python3 -c 'import pytest_timeout' 2>/dev/null; then
  workers+=(--timeout "${TEST_TIMEOUT:-180}")
else
  workers+=(-o "faulthandler_timeout=${TEST_TIMEOUT:-180}")
fi
timeout "$DEADLINE" python3 -m pytest -v -rfE --durations=15 -m gpu -p no:cacheprovider "${workers[@]}" "$@" tests \
  >"$OUT/gpu_tests.log" 2>&1
status=$?
# A finished test's line names its node id beside its outcome (with or without xdist's worker prefix).
grep -E ' (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)( |$)' "$OUT/gpu_tests.log" | tr ' ' '\n' | grep '::' | sort -u \
  >"$OUT/finished.txt"
comm -23 "$OUT/collected.txt" "$OUT/finished.txt" >"$OUT/unfinished.txt"
{
  echo "collected $(wc -l <"$OUT/collected.txt"), finished $(wc -l <"$OUT/finished.txt"), not finished $(wc -l <"$OUT/unfinished.txt")"
  [ "$status" = 124 ] && echo "stopped at the deadline ($DEADLINE s); not finished:" && head -40 "$OUT/unfinished.txt"
  grep -E '^(FAILED|ERROR) ' "$OUT/gpu_tests.log" | head -40
  sed -n '/slowest/,/^=/p' "$OUT/gpu_tests.log" | head -20
  tail -1 "$OUT/gpu_tests.log"
} | tee "$OUT/summary.txt"
[ "$status" = 0 ] && [ ! -s "$OUT/unfinished.txt" ]
