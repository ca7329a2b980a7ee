#!/usr/bin/env bash
# One device call that validates both swap-in resolves on a GPU, side by side: the GPU suite with the planner's choice
# (the on-chip resolve where it runs), the swap-in GPU tests with the Triton resolve forced (KVPLAN_RESOLVE=triton),
# and the compute-sanitizer runs of the on-chip resolve (memcheck, racecheck, synccheck) and of the fifth hostile pass.
# scripts/h200_check.sh runs every sanitizer run; this is the subset a change of the resolve needs. On the H100 the
# sanitizer runs took about a minute each; the two suites beside them did not finish within 10 minutes (the Triton
# resolve compiles at production shapes): give the suites a device call of their own when time is short.
#
# Usage, on the GPU machine from the repository root:  bash scripts/check_resolves.sh
# $OUT (default ./out) gets checks.log and the logs as logs.tgz. Exit status 0 when every part passed and every
# sanitizer run reported 0 errors / 0 hazards.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"
mkdir -p "$OUT/logs"
started=$SECONDS
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -m gpu -p no:cacheprovider tests -k "not two_gpus" >"$OUT/logs/suite_auto.log" 2>&1 &
auto=$!
KVPLAN_RESOLVE=triton python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_swap_in_gpu.py \
  tests/kernels/test_hostile_fifth_gpu.py >"$OUT/logs/suite_triton.log" 2>&1 &
triton=$!
pids=()
for name in memcheck_onchip racecheck_onchip synccheck_onchip memcheck_fifth; do
  OUT="$OUT/logs" bash scripts/sanitize.sh "$name" >"$OUT/logs/$name.out" 2>&1 &
  pids+=($!)
done
status=0
wait "$auto" || status=1
wait "$triton" || status=1
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
{
  echo "gpu suite, planner's resolve: $(tail -1 "$OUT/logs/suite_auto.log")"
  echo "swap-in gpu tests, Triton resolve forced: $(tail -1 "$OUT/logs/suite_triton.log")"
  cat "$OUT/logs/sanitize/summary.txt" 2>/dev/null || echo "sanitize: no summary"
  echo "checks: $([ "$status" = 0 ] && echo "all clean" || echo FAILED) in $((SECONDS - started)) s"
} | tee "$OUT/checks.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit "$status"
