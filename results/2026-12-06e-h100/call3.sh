#!/usr/bin/env bash
# Third device call: the GPU tests of the final kernels (the on-chip resolve's; the shared host rows' on the GPU),
# then kvplan bench swap_in --strict on A, B, C and P at batch 1, 8 and 64 (the goals judged against SGLang's H100
# figures; the exit status is 1 while a goal is missed).
# Usage from the repository root: OUT=... bash results/2026-12-06e-h100/call3.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_onchip_resolve.py 2>&1 | tail -3 \
  | tee "$OUT/tests.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_shared_host_rows.py -k "not property" 2>&1 \
  | tail -3 | tee -a "$OUT/tests.log"
echo "tests in $((SECONDS - t0)) s"
cd /tmp && timeout 400 python3 -m kvplan.benchmarks.swap_in --workloads A,B,C,P --batches 1,8,64 --reps 5 \
  --no-reference --strict --out "$OUT/swap_in_strict.json" > "$OUT/swap_in_strict.log" 2>&1
echo "strict bench rc $? in $((SECONDS - t0)) s"
grep -E "^  [ABCP] [a-z+0-9 ]+batch|ceiling|plan copy|\[(met|MISSED|missed|not judged)" "$OUT/swap_in_strict.log" \
  | sed 's/; resolve=/ | /' | head -90
