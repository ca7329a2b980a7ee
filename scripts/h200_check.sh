#!/usr/bin/env bash
# One device call that validates a tree on the H200: the GPU suite and every scripts/sanitize.sh run side by side (one
# GPU holds them all, and each run fits the call's 10 minutes beside the others). The speed is the next call's:
#   python -m kvplan.benchmarks.swap_in --reps 6 --no-reference --strict --out "$OUT/swap_in.json"
#
# Usage, on the GPU machine from the repository root:  bash scripts/h200_check.sh
# Prints the suite's result and each sanitizer run's summary line; $OUT (default ./out) gets three files, within what
# the device tool brings back: checks.log (those lines), gpu_tests.log and logs.tgz (every sanitizer log).
# Exit status: 0 when the suite passed and every sanitizer run reported 0 errors / 0 hazards, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"
mkdir -p "$OUT/sanitize"
started=$SECONDS
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
git rev-parse --short HEAD 2>/dev/null || true

python3 -m pytest -q -m gpu -p no:cacheprovider tests -k "not two_gpus" >"$OUT/gpu_tests.log" 2>&1 &
suite=$!
RUNS=(memcheck_kernels memcheck_hostile memcheck_lifecycle memcheck_multiprogram memcheck_shared_rows memcheck_epochs
  memcheck_graphs memcheck_fifth racecheck_kernels racecheck_multiprogram memcheck_onchip racecheck_onchip synccheck_onchip)
pids=()
for name in "${RUNS[@]}"; do
  OUT="$OUT" bash scripts/sanitize.sh "$name" >"$OUT/sanitize/$name.out" 2>&1 &
  pids+=($!)
done
wait "$suite"
suite_rc=$?
grep -qE "[0-9]+ passed" <(tail -1 "$OUT/gpu_tests.log") || suite_rc=1  # every test skipped (no GPU) is no result
status=$suite_rc
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
{
  echo "gpu suite (exit $suite_rc): $(tail -1 "$OUT/gpu_tests.log")"
  cat "$OUT/sanitize/summary.txt" 2>/dev/null || echo "sanitize: no summary (is compute-sanitizer on PATH?)"
  echo "checks: $([ "$status" = 0 ] && echo "all clean" || echo FAILED) in $((SECONDS - started)) s"
} | tee "$OUT/checks.log"
tar czf "$OUT/logs.tgz" -C "$OUT" sanitize && rm -rf "$OUT/sanitize"
exit "$status"
