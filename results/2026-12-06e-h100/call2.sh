#!/usr/bin/env bash
# Second device call: the GPU tests of the change (the on-chip resolve's, the shared host rows' on the GPU, the
# swap-in's graph test, the block swap-in's), then kvplan bench swap_in on P and A for this tree and for b39ebe0's
# package (the session's start; build/baseline_b39ebe0, carried), same card, same run. Each package's benchmark runs
# from inside its own folder (`python -m` puts the working directory ahead of PYTHONPATH).
# Usage from the repository root: OUT=... bash results/2026-12-06e-h100/call2.sh
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root="$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
PYTHONPATH="$root" timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_onchip_resolve.py \
  tests/kernels/test_swap_in_gpu.py tests/kernels/test_swap_in_blocks.py 2>&1 | tail -6 | tee "$OUT/tests.log"
PYTHONPATH="$root" timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_shared_host_rows.py \
  -k "not property" 2>&1 | tail -6 | tee -a "$OUT/tests.log"
echo "tests in $((SECONDS - t0)) s"
run() {  # $1 label, $2 package folder, $3 workloads
  (cd "$2" && python3 -c 'import kvplan, os; print("package", os.path.dirname(kvplan.__file__))'
   timeout 150 python3 -m kvplan.benchmarks.swap_in --calls spec,single,mha --workloads "$3" --batches 1,8,64 \
     --reps 5 --no-reference --out "$OUT/swap_in_$1.json" > "$OUT/swap_in_$1.log" 2>&1; echo "swap_in $1 rc $?")
  grep -E "^  [AP] [a-z+0-9 ]+batch|ceiling|plan copy" "$OUT/swap_in_$1.log" | sed 's/; resolve=/ | /' | head -40
}
run new "$root" P,A
run base "$root/build/baseline_b39ebe0" P
echo "all in $((SECONDS - t0)) s"
