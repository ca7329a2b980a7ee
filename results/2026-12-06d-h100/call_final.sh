#!/usr/bin/env bash
# The session's last device call (device time was short): first the validation of the final tree (the GPU suite
# beside the sanitizer runs the change needs: the on-chip resolve's memcheck, racecheck and synccheck, the share
# launch's memcheck_shared_rows, the pool's graphs with the block swap-in), then the share launch's slice
# (probe_share_slice.py) and the speed check against 411937b's package (build/baseline_411937b, carried): kvplan bench
# swap_in on P (speculative, single-step, block MHA) and eager, same card, same run.
# Usage from the repository root: OUT=... bash results/2026-12-06d-h100/call_final.sh
# (Its speed part is void: `python -m` from the repository root imports this tree's package whatever PYTHONPATH
# says, so its "base" runs measured this tree again. call_speed2.sh runs each package from its own folder.)
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=results/2026-12-06d-h100
base="$PWD/build/baseline_411937b"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$SECONDS
OUT="$OUT/check" DEADLINE="${DEADLINE:-210}" WORKERS=10 TEST_TIMEOUT=120 SANITIZE_DEADLINE="${SANITIZE_DEADLINE:-270}" \
  bash scripts/check_resolves.sh memcheck_onchip racecheck_onchip synccheck_onchip memcheck_shared_rows \
  memcheck_mha_graph 2>&1 | tail -16
echo "validation in $((SECONDS - t0)) s"
PYTHONPATH="$PWD" timeout 100 python3 "$here/probe_share_slice.py" 2>&1 | tee "$OUT/share_slice.log"
swap_in() {  # $1 label, $2 PYTHONPATH
  PYTHONPATH="$2" timeout 80 python3 -m kvplan.benchmarks.swap_in --calls spec,single,mha --workloads P \
    --batches 1,8,64 --reps 5 --no-reference --out "$OUT/swap_in_$1.json" > "$OUT/swap_in_$1.log" 2>&1
  echo "swap_in $1 rc $?"; grep -E "^  P |ceiling" "$OUT/swap_in_$1.log" | head -30
}
swap_in new "$PWD"; swap_in base "$base"
for t in new base; do
  p="$PWD"; [ "$t" = base ] && p="$base"
  PYTHONPATH="$p" timeout 40 python3 -m kvplan.benchmarks.eager --out "$OUT/eager_$t.json" > "$OUT/eager_$t.log" 2>&1
  echo "eager $t rc $?"; tail -12 "$OUT/eager_$t.log"
done
echo "all in $((SECONDS - t0)) s"
