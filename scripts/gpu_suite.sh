#!/usr/bin/env bash
# One device call: environment facts, the GPU test suite, then every benchmark (tables to stdout, JSON to $OUT).
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_suite.sh [pytest args...]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"
mkdir -p "$OUT"
python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
python3 -m pytest -q -m gpu -p no:cacheprovider "$@" tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
for bench in bench_pool bench_swap_in bench_materialize; do
  [ -f "scripts/$bench.py" ] && python3 "scripts/$bench.py" --out "$OUT/$bench.json"
done
exit "$status"
