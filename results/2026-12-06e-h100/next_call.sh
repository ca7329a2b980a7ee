#!/usr/bin/env bash
# What this session could not run on the GPU (its device time ran out), ready for the next one: memcheck_epochs again
# (its flat-path tests now take the Triton resolve, whose workspace tables they check: the on-chip resolve keeps a plan
# in miss order's tables in shared memory), the table-epoch tests without the sanitizer, kvplan bench swap_in --strict
# on A, B, C and P, and kvplan bench eager.
# Usage from the repository root: OUT=... bash results/2026-12-06e-h100/next_call.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT/sanitize"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
OUT="$OUT" bash scripts/sanitize.sh memcheck_epochs > "$OUT/sanitize/memcheck_epochs.out" 2>&1
cat "$OUT/sanitize/summary.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_table_epochs.py 2>&1 | tail -2
cd /tmp
timeout 420 python3 -m kvplan.benchmarks.swap_in --workloads A,B,C,P --batches 1,8,64 --reps 5 --no-reference \
  --strict --out "$OUT/swap_in_strict.json" > "$OUT/swap_in_strict.log" 2>&1
echo "strict bench rc $? in $((SECONDS - t0)) s"
grep -E "met, |\[(met|MISSED|not evaluated)" "$OUT/swap_in_strict.log" | head -80
timeout 60 python3 -m kvplan.benchmarks.eager --out "$OUT/eager.json" > "$OUT/eager.log" 2>&1
echo "eager rc $?"; grep -E "met\]|MISSED|^  (pool|kernels)" "$OUT/eager.log" | head -12
echo "all in $((SECONDS - t0)) s"
