"""Probe: with the on-chip resolve, the plan in miss order and the flat copy (no sort, no share launch) against the
default sorted plan, ordered copy and share launch, per workload and batch: whether FLAT_COPY_MAX_BATCH (set when the
Triton resolve ran) still sits where it should. Run on the GPU from the repository root."""

import sys

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import hisparse

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 10)
hosts = b.pinned_hosts(shape.host_rows["B"], 1 + b.REPLAY_LAYERS, device)
flat = hisparse.ResolveLaunch(sorted_plan=False)
sort = hisparse.ResolveLaunch(sorted_plan=True)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["P", "A", "B"]
batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4,8,16,32").split(",")]
for wl in workloads:
    for kind in ("spec", "single", "mha"):
        for batch in batches:
            calls = max(4, min(16, 128 // batch))
            if kind == "mha":
                w = b.make_mha_workload(wl, batch=batch, calls=calls, shape=shape, device=device, seed=batch)
            else:
                w = b.make_workload(wl, batch=batch, speculative=kind == "spec", calls=calls, shape=shape,
                                    device=device, seed=batch)
            bench = b.Bench(w, hosts, clock)
            t_sort = bench.call_us(launch=sort)
            t_flat = bench.call_us(launch=flat)
            r_sort = bench.call_us(copy=False, launch=sort)
            r_flat = bench.call_us(copy=False, launch=flat)
            print(f"{wl} {kind:<6} batch {batch:3d}: sorted {t_sort:7.1f} (resolve {r_sort:5.1f}) | flat {t_flat:7.1f} "
                  f"(resolve {r_flat:5.1f}) | flat/sorted {t_flat / t_sort:5.2f}", flush=True)
