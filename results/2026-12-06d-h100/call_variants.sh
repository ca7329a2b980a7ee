#!/usr/bin/env bash
# The on-chip GPU tests, then probe_variants.py for this tree (staged, global), 411937b's package, this tree again.
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=results/2026-12-06d-h100
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH="$PWD" timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_onchip_resolve.py \
  > "$OUT/onchip_tests.log" 2>&1; echo "tests rc $?: $(tail -1 "$OUT/onchip_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/onchip_tests.log" | head -5
PYTHONPATH="$PWD" timeout 100 python3 "$here/probe_variants.py" new 2>&1 | tee "$OUT/variants.log"
PYTHONPATH="$PWD/build/baseline_411937b" timeout 100 python3 "$here/probe_variants.py" base 2>&1 | tee -a "$OUT/variants.log"
PYTHONPATH="$PWD" timeout 100 python3 "$here/probe_variants.py" new 2>&1 | tee -a "$OUT/variants.log"
