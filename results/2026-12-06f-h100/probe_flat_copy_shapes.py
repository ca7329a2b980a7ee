"""The replay copy of small-batch plans (in miss order) under other launch shapes: what limits the batch-1 cells of B
(host rows scattered over 4.6 GB) against C and A (the same number of rows, close together). For each workload the
plans of one speculative and one single-step call at batches 1 and 4, then the copy alone (``Bench.copy_us``) under
each ``CopyLaunch`` shape, three alternating rounds, median; GB/s of the rows moved."""

from __future__ import annotations

import statistics
import sys

import torch

from kvplan.benchmarks import swap_in as bench_module
from kvplan.kernels.plan_copy.launch import FLAT_COPY_LAUNCH, CopyLaunch

SHAPES = [FLAT_COPY_LAUNCH] + [
    CopyLaunch(rows_per_program=r, programs_per_sm=p, num_warps=w)
    for r, p, w in ((1, 16, 1), (2, 16, 1), (8, 16, 1), (4, 16, 2), (1, 32, 1), (16, 8, 4))
]
device = torch.device("cuda")
shape = bench_module.Shape(False)
clock = bench_module.Clock(device, 10)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["B", "C", "A"]
print(torch.cuda.get_device_name(), "| copy alone, µs (GB/s), median of 3 rounds; shapes:", *SHAPES, sep="\n  ")
for wl in workloads:
    hosts = bench_module.pinned_hosts(shape.host_rows["A" if wl == "A" else "B"], 1, device)
    for kind in ("spec", "single"):
        for batch in (1, 4):
            w = bench_module.make_workload(
                wl, batch=batch, speculative=kind == "spec", calls=16, shape=shape, device=device, seed=batch
            )
            b = bench_module.Bench(w, hosts, clock)
            b.call_us()  # (writes the plans)
            rows = b.plan_rows()
            runs = [[] for _ in SHAPES]
            for _ in range(3):
                for i, launch in enumerate(SHAPES):
                    runs[i].append(b.copy_us(launch=launch))
            cells = []
            for times in runs:
                us = statistics.median(times)
                cells.append(f"{us:6.1f} ({rows * bench_module.ITEM / us / 1e3:4.1f})")
            print(f"  {wl} {kind:<6} batch {batch} ({rows:.0f} rows):", " ".join(cells), flush=True)
