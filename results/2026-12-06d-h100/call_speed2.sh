#!/usr/bin/env bash
# The speed check of this tree against 411937b's package (build/baseline_411937b, carried), same card, same run:
# kvplan bench swap_in on P (speculative, single-step, block MHA) and kvplan bench eager. Each package's benchmark
# runs from inside its own folder: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH, so
# run from the repository root both runs would import this tree's package.
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root="$PWD"
run() {  # $1 label, $2 package folder
  (cd "$2" && python3 -c 'import kvplan, os; print("package", os.path.dirname(kvplan.__file__))'
   timeout 80 python3 -m kvplan.benchmarks.swap_in --calls spec,single,mha --workloads P --batches 1,8,64 --reps 5 \
     --no-reference --out "$OUT/swap_in_$1.json" > "$OUT/swap_in_$1.log" 2>&1; echo "swap_in $1 rc $?"
   timeout 40 python3 -m kvplan.benchmarks.eager --out "$OUT/eager_$1.json" > "$OUT/eager_$1.log" 2>&1
   echo "eager $1 rc $?")
  grep -E "^  P [a-z+0-9 ]+batch|ceiling|plan copy" "$OUT/swap_in_$1.log" | sed 's/; resolve=.*launches: / | /' | head -20
  grep -E "met\]|^  (pool|kernels)" "$OUT/eager_$1.log" | head -12
}
run new "$root"; run base "$root/build/baseline_411937b"
