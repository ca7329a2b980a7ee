#!/usr/bin/env bash
# One device call that validates a change of the swap-in side by side: the GPU suite (scripts/gpu_suite.sh: every
# test marked gpu over xdist workers under a deadline, so the call comes back with the tests that did not finish) and
# the compute-sanitizer runs a change of the resolve or the copy needs (the on-chip resolve's memcheck, racecheck and
# synccheck, the fifth hostile pass, the block swap-in of K and V). scripts/h200_check.sh runs every sanitizer run.
#
# Usage, on the GPU machine from the repository root:
#   [DEADLINE=420] [WORKERS=8] [SANITIZE_DEADLINE=480] bash scripts/check_resolves.sh [sanitizer run names...]
# $OUT (default ./out) gets checks.log, the suite's summary and lists, and the logs as logs.tgz. Exit status 0 when
# every test finished and passed and every sanitizer run reported 0 errors / 0 hazards.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"
mkdir -p "$OUT/logs"
started=$SECONDS
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(memcheck_onchip racecheck_onchip synccheck_onchip memcheck_fifth memcheck_mha racecheck_mha)
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
OUT="$OUT/suite" DEADLINE="${DEADLINE:-420}" WORKERS="${WORKERS:-8}" bash scripts/gpu_suite.sh -k "not two_gpus" \
  >"$OUT/logs/suite.out" 2>&1 &
suite=$!
pids=()
for name in "${runs[@]}"; do
  OUT="$OUT/logs" timeout "${SANITIZE_DEADLINE:-480}" bash scripts/sanitize.sh "$name" >"$OUT/logs/$name.out" 2>&1 &
  pids+=($!)
done
status=0
wait "$suite" || status=1
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
{
  echo "gpu suite:"
  cat "$OUT/suite/summary.txt" 2>/dev/null || echo "no suite summary"
  cat "$OUT/logs/sanitize/summary.txt" 2>/dev/null || echo "sanitize: no summary"
  for name in "${runs[@]}"; do grep -q "^$name " "$OUT/logs/sanitize/summary.txt" 2>/dev/null || echo "$name: no result (deadline?)"; done
  echo "checks: $([ "$status" = 0 ] && echo "all clean" || echo FAILED) in $((SECONDS - started)) s"
} | tee "$OUT/checks.log"
cp "$OUT/suite/gpu_tests.log" "$OUT/logs/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit "$status"
