#!/usr/bin/env bash
# Where the on-chip resolve spends its time: ncu's per-instruction stall samples (SourceCounters, WarpStateStats) of
# the kvplan_resolve launches of probe_onchip_ncu.py (P, batch 8: speculative flat x2, sorted x2; single-step the
# same), and each build's SASS with its source lines (nvdisasm -g) to place them. On the GPU machine from the
# repository root: OUT=... bash results/2026-12-06d-h100/profile_onchip.sh
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-out}"; mkdir -p "$OUT"
here=results/2026-12-06d-h100
ncu --clock-control none --kernel-name kvplan_resolve --section WarpStateStats --section SourceCounters \
  --section SchedulerStats --section LaunchStats --import-source no -f -o "$OUT/onchip" \
  python3 results/2026-12-06c-h100/probe_onchip_ncu.py > "$OUT/ncu_run.log" 2>&1
echo "ncu rc $?"
ncu -i "$OUT/onchip.ncu-rep" --page details --csv > "$OUT/details.csv" 2>&1
ncu -i "$OUT/onchip.ncu-rep" --page source --csv --print-source sass > "$OUT/source_sass.csv" 2>"$OUT/source_err.log"
echo "source rc $? $(wc -c < "$OUT/source_sass.csv") bytes"
python3 "$here/dump_builds.py" "$OUT" > "$OUT/dump_builds.log" 2>&1; echo "dump rc $?"
for f in "$OUT"/*.cubin; do nvdisasm -g -c "$f" > "${f%.cubin}.sass" 2>&1; done
gzip -9 "$OUT"/*.csv "$OUT"/*.sass
rm -f "$OUT"/*.cubin
ls -la "$OUT"
