"""The share launch (after the on-chip resolve, above batch 4) with SHARE_SLICE plan entries a program: 32 (the sort
launch's slice, the old value), 256 and 1024, alternating (two rounds, median); the resolve alone and the whole
call, P and A (whose requests share their host rows), speculative and single-step, batch 8 and 64."""

import statistics

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels.resolve import share

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 7)
hosts = {"P": b.pinned_hosts(shape.host_rows["B"], 1, device), "A": b.pinned_hosts(shape.host_rows["A"], 1, device)}
slices = (32, 256, 1024)
print(torch.cuda.get_device_name(), "SHARE_SLICE", slices)
for workload in ("P", "A"):
    for kind in ("spec", "single"):
        for batch in (8, 64):
            w = b.make_workload(workload, batch=batch, speculative=kind == "spec", calls=4, shape=shape,
                                device=device, seed=3)  # fmt: skip
            bench = b.Bench(w, hosts[workload], clock)
            for what, options in (("resolve alone", dict(copy=False)), ("call", {})):
                times = {s: [] for s in slices}
                for _ in range(2):
                    for s in slices:
                        share.SHARE_SLICE = s
                        times[s].append(bench.call_us(**options))
                share.SHARE_SLICE = 256
                cells = "  ".join(f"{s:>4} {statistics.median(t):7.1f}" for s, t in times.items())
                print(f"{workload} {kind:<6} {batch:>3} {what:<14} {cells}", flush=True)
