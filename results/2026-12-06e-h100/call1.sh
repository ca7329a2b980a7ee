#!/usr/bin/env bash
# First device call of the session: the on-chip resolve's GPU tests and the swap-in's graph test (the flat copy now
# takes each row as its block publishes it), then the flat copy per row against the copy after the whole resolve
# (probe_row_ready.py), same card, same run.
# Usage from the repository root: OUT=... bash results/2026-12-06e-h100/call1.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_onchip_resolve.py \
  tests/kernels/test_swap_in_gpu.py tests/kernels/test_swap_in_blocks.py 2>&1 | tail -15 | tee "$OUT/tests.log"
echo "tests in $((SECONDS - t0)) s"
timeout 240 python3 results/2026-12-06e-h100/probe_row_ready.py P,A 2>&1 | tee "$OUT/probe_row_ready.log"
echo "all in $((SECONDS - t0)) s"
