"""The on-chip resolve of the tree on PYTHONPATH, P's speculative and single-step calls at batch 1 / 8 / 64: the
resolve alone (no copy) and the whole call, µs (median of 7 graph replays of 4 calls, L2 flushed). Where the tree
stages rows on chip (kvplan.kernels.onchip.launch.fitted), staged and global alternate, three pairs, median each."""

import statistics
import sys

import attrs
import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels.onchip import launch as onchip_launch

label = sys.argv[1]
device = torch.device("cuda")
fitted = getattr(onchip_launch, "fitted", None)
variants = {"staged": fitted, "global": lambda dev, config: attrs.evolve(config, staged=False)} if fitted else {label: None}
shape = b.Shape(False)
clock = b.Clock(device, 7)
hosts = b.pinned_hosts(shape.host_rows["B"], 1, device)
for kind in ("spec", "single"):
    for batch in (1, 8, 64):
        w = b.make_workload("P", batch=batch, speculative=kind == "spec", calls=4, shape=shape, device=device, seed=3)
        bench = b.Bench(w, hosts, clock)
        for what, options in (("resolve alone", dict(copy=False)), ("call", {})):
            times = {name: [] for name in variants}
            for _ in range(3 if fitted else 2):
                for name, fit in variants.items():
                    if fit is not None:
                        onchip_launch.fitted = fit
                    times[name].append(bench.call_us(**options))
            cells = "  ".join(f"{name} {statistics.median(t):7.1f}" for name, t in times.items())
            print(f"{label:<5} {kind:<6} {batch:>3} {what:<14} {cells}", flush=True)
