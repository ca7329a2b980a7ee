"""The replay copy (``pool.replay``'s route, ``Bench.copy_us``) of small-batch plans under the launch shape replays
take today (``COPY_LAUNCH``: one program per SM, 4 rows an item) against the swap-in's flat shape
(``FLAT_COPY_LAUNCH``: 16 one-warp programs per SM) and one row a program (32 per SM). Workloads B, P, A, C,
speculative and single-step, batches 1, 2, 4 (plans in miss order) and 8 (sorted, shared); three alternating rounds,
median, µs per call."""

from __future__ import annotations

import statistics
import sys

import torch

from kvplan.benchmarks import swap_in as bench_module
from kvplan.kernels.plan_copy.launch import COPY_LAUNCH, FLAT_COPY_LAUNCH, CopyLaunch

SHAPES = {"ordered": COPY_LAUNCH, "flat": FLAT_COPY_LAUNCH, "row/program": CopyLaunch(1, 32, 1)}
device = torch.device("cuda")
shape = bench_module.Shape(False)
clock = bench_module.Clock(device, 10)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["B", "P", "A", "C"]
print(torch.cuda.get_device_name(), "| replay copy alone, µs:", " / ".join(SHAPES), "(median of 3 rounds)")
for wl in workloads:
    hosts = bench_module.pinned_hosts(shape.host_rows["A" if wl == "A" else "B"], 1, device)
    for kind in ("spec", "single"):
        for batch in (1, 2, 4, 8):
            w = bench_module.make_workload(
                wl, batch=batch, speculative=kind == "spec", calls=16, shape=shape, device=device, seed=batch
            )
            b = bench_module.Bench(w, hosts, clock)
            b.call_us()  # (writes the plans)
            runs = {name: [] for name in SHAPES}
            for _ in range(3):
                for name, launch in SHAPES.items():
                    runs[name].append(b.copy_us(launch=launch))
            us = [statistics.median(runs[name]) for name in SHAPES]
            ratios = " ".join(f"{u / us[0]:.2f}" for u in us[1:])
            cells = " / ".join(f"{u:6.1f}" for u in us)
            print(f"  {wl} {kind:<6} batch {batch}: {cells}  ({ratios} of ordered)", flush=True)
