"""The flat copy per row (each row once the on-chip resolve publishes it) against the copy after the whole resolve
(``ResolveLaunch(row_ready=False)``), same calls, same card: three alternating pairs per cell, each the median of the
benchmark's graph replays (``kvplan.benchmarks.swap_in.Bench``), compared by median. Workloads A and P, speculative
and single-step, batches 1, 2, 4 (the flat plans); at batch 8 the planner's sorted, shared plan against a plan in
miss order copied per row."""

from __future__ import annotations

import statistics
import sys

import torch

from kvplan.benchmarks import swap_in as bench_module
from kvplan.kernels import hisparse

device = torch.device("cuda")
shape = bench_module.Shape(False)
clock = bench_module.Clock(device, 10)
after = hisparse.ResolveLaunch(row_ready=False)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["P", "A"]
print(torch.cuda.get_device_name(), "| µs per call: per row / after the resolve (3 pairs, median), ratio")
for wl in workloads:
    cache = "A" if wl == "A" else "B"
    hosts = bench_module.pinned_hosts(shape.host_rows[cache], 2, device)  # (the MHA lines: K rows, V rows)
    for kind in ("spec", "single", "mha"):
        for batch in (1, 2, 4):
            calls = max(4, min(32, 256 // batch))
            if kind == "mha":
                w = bench_module.make_mha_workload(wl, batch=batch, calls=calls, shape=shape, device=device, seed=batch)
            else:
                w = bench_module.make_workload(
                    wl, batch=batch, speculative=kind == "spec", calls=calls, shape=shape, device=device, seed=batch
                )
            b = bench_module.Bench(w, hosts, clock)
            per_row, whole = [], []
            for _ in range(3):
                per_row.append(b.call_us())
                whole.append(b.call_us(launch=after))
            p, a = statistics.median(per_row), statistics.median(whole)
            print(f"  {wl} {kind:<6} batch {batch}: {p:7.2f} / {a:7.2f}  {p / a:.3f}  [{b.decision()}]", flush=True)
    # batch 8: the sorted, shared plan (the planner's) against a plan in miss order copied per row
    flat = hisparse.ResolveLaunch(sorted_plan=False)
    for kind in ("spec", "single"):
        w = bench_module.make_workload(wl, batch=8, speculative=kind == "spec", calls=32, shape=shape, device=device,
                                       seed=8)  # fmt: skip
        b = bench_module.Bench(w, hosts, clock)
        planned, per_row = [], []
        for _ in range(3):
            planned.append(b.call_us())
            per_row.append(b.call_us(launch=flat))
        p, f = statistics.median(planned), statistics.median(per_row)
        print(
            f"  {wl} {kind:<6} batch 8: sorted, shared {p:7.2f} / miss order per row {f:7.2f}  {f / p:.3f}", flush=True
        )
