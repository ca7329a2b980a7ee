#!/usr/bin/env bash
# The session's one validation call on the GPU (device time was short): first the swap-in benchmark on P (token
# speculative and single-step, the block MHA call) for this tree and for 8c323fa's package (build/baseline_8c323fa,
# carried: the speed check of the refactor, same card, same run), then the GPU suite beside the sanitizer runs the
# change touches (the copy's kernels, the relaunched graphs, the block swap-in's graph run), under deadlines.
# Usage from the repository root: OUT=... bash results/2026-12-06c-h100/final_check.sh
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null
bench() {  # $1 label, $2 PYTHONPATH
  PYTHONPATH="$2" timeout 130 python -m kvplan.benchmarks.swap_in --calls spec,single,mha --workloads P \
    --batches 1,8,64 --reps 5 --no-reference --out "$OUT/bench_$1.json" 2>&1 | grep -E "^  P |met, |ceiling" \
    | tee "$OUT/bench_$1.log"
}
bench new "$PWD"
bench base "$PWD/build/baseline_8c323fa"
DEADLINE="${DEADLINE:-300}" WORKERS=10 TEST_TIMEOUT=150 SANITIZE_DEADLINE="${SANITIZE_DEADLINE:-330}" \
  bash scripts/check_resolves.sh memcheck_mha_graph memcheck_kernels memcheck_graphs memcheck_mha racecheck_mha 2>&1 \
  | tail -25
