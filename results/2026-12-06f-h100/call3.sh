#!/usr/bin/env bash
# The second call of the sixteenth session (run as one command line on the warm H100 right after call2.sh):
# kvplan bench eager again in a fresh process, the ready word after the token loads against as is
# (probe_ready_after_loads.py, flat plans of P and A), and kvplan bench swap_in --strict on B and C.
# Usage from the repository root: OUT=... bash results/2026-12-06f-h100/call3.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$SECONDS
(cd /tmp && timeout 70 python3 -m kvplan.benchmarks.eager --calls 300 --out $OUT/eager2.json > $OUT/eager2.log 2>&1
 grep -vi warning $OUT/eager2.log | grep -E "floor|pool.swap|kernels.swap_in \(S=3, pool|MISSED|met\]")
echo "eager in $((SECONDS-t0)) s"
timeout 150 python3 results/2026-12-06f-h100/probe_ready_after_loads.py P,A 1,4 2>&1 | grep -v Warning \
  | tee $OUT/probe_ready_after_loads.log
echo "probe in $((SECONDS-t0)) s"
left=$((540-SECONDS+t0))
cd /tmp && timeout $left python3 -m kvplan.benchmarks.swap_in --workloads B,C --calls spec,single --batches 1,8,64 \
  --reps 5 --no-reference --strict --out $OUT/swap_in_bc.json > $OUT/swap_in_bc.log 2>&1
echo "bench rc $? in $((SECONDS-t0)) s"
grep -E "^  [BC] [a-z+0-9 ]+batch|plan copy|met, |\[(met|MISSED)" $OUT/swap_in_bc.log | sed 's/; resolve=/ | /' \
  | cut -c1-180
