#!/usr/bin/env bash
# Device call 1: the on-chip GPU tests (row staged and not), the staged-vs-global probe, then ncu's profile.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
here=results/2026-12-06d-h100
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
t0=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/test_onchip_resolve.py > "$OUT/onchip_tests.log" 2>&1
echo "tests rc $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/onchip_tests.log")"
t0=$SECONDS
timeout 200 python3 "$here/probe_staged.py" > "$OUT/probe_staged.log" 2>&1
echo "probe rc $? in $((SECONDS - t0)) s"; cat "$OUT/probe_staged.log" | grep -v "^#"
t0=$SECONDS
OUT="$OUT/ncu" timeout 150 bash "$here/profile_onchip.sh" > "$OUT/profile.log" 2>&1
echo "profile rc $? in $((SECONDS - t0)) s"; tail -5 "$OUT/profile.log"
