#!/usr/bin/env bash
# The validation of this tree's kernels: scripts/h200_check.sh (the GPU suite beside every scripts/sanitize.sh run,
# memcheck_epochs with the table-epoch tests' Triton flat path among them), then with the call's time left
# kvplan bench swap_in --strict on A (WORKLOADS=A,B,C for more; P was measured on these kernels: results/2026-12-06e-h100/call4.sh),
# then kvplan bench eager.
# Usage from the repository root: OUT=... bash results/2026-12-06f-h100/call2.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
OUT="$OUT" timeout "${CHECK_LIMIT:-420}" bash scripts/h200_check.sh 2>&1 | tail -20
echo "h200_check in $((SECONDS - t0)) s"
export PYTHONPATH="$PWD"
cd /tmp
left=$((545 - SECONDS + t0))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 -m kvplan.benchmarks.swap_in --workloads "${WORKLOADS:-A}" --batches 1,8,64 --reps 5 \
    --no-reference --strict --out "$OUT/swap_in_strict.json" > "$OUT/swap_in_strict.log" 2>&1
  echo "strict bench rc $? in $((SECONDS - t0)) s"
  grep -E "^  [ABCP] [a-z+0-9 ]+batch|plan copy|met, " "$OUT/swap_in_strict.log" | sed 's/; resolve=/ | /' | cut -c1-200
  grep -E "\[(MISSED|not evaluated)" "$OUT/swap_in_strict.log" | head -30
fi
left=$((590 - SECONDS + t0))
if [ "$left" -gt 25 ]; then
  timeout "$left" python3 -m kvplan.benchmarks.eager --calls 300 --out "$OUT/eager.json" > "$OUT/eager.log" 2>&1
  echo "eager rc $?"; grep -vi warning "$OUT/eager.log" | head -24
fi
echo "all in $((SECONDS - t0)) s"
