#!/usr/bin/env bash
# The validation of the final kernels: scripts/h200_check.sh (the GPU suite beside every scripts/sanitize.sh run),
# then, with the call's time left, kvplan bench swap_in --strict on P.
# Usage from the repository root: OUT=... bash results/2026-12-06e-h100/call4.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
OUT="$OUT" timeout "${CHECK_LIMIT:-500}" bash scripts/h200_check.sh 2>&1 | tail -20
echo "h200_check in $((SECONDS - t0)) s"
left=$((530 - SECONDS + t0))
if [ "$left" -gt 90 ]; then
  (cd /tmp && PYTHONPATH="$OLDPWD" timeout "$left" python3 -m kvplan.benchmarks.swap_in --workloads P --calls spec,single \
    --batches 1,8,64 --reps 5 --no-reference --strict --out "$OUT/swap_in_p.json" > "$OUT/swap_in_p.log" 2>&1
   echo "bench P rc $?")
  grep -E "^  P [a-z+0-9 ]+batch|plan copy|\[(met|MISSED|not evaluated)|met, " "$OUT/swap_in_p.log" | sed 's/; resolve=/ | /' | head -40
fi
echo "all in $((SECONDS - t0)) s"
