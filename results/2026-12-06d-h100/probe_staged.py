"""The on-chip resolve with the row's slot tokens and device rows staged in shared memory (the planner's default
where the block has room) against the same kernel reading them from global memory: P's speculative and single-step
calls, the resolve alone (no copy) and the whole call, three alternating pairs per cell (median), one GPU."""

import statistics

import attrs
import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels.onchip import launch as onchip_launch

device = torch.device("cuda")
fitted = onchip_launch.fitted


def unstaged(dev, config):
    return attrs.evolve(config, staged=False)


shape = b.Shape(False)
clock = b.Clock(device, 7)
hosts = b.pinned_hosts(shape.host_rows["B"], 1, device)
print(f"{torch.cuda.get_device_name()}")
print(f"{'call':<8} {'batch':>5} {'what':<14} {'staged us':>10} {'global us':>10} {'ratio':>6}")
for kind in ("spec", "single"):
    for batch in (1, 8, 64):
        w = b.make_workload("P", batch=batch, speculative=kind == "spec", calls=4, shape=shape, device=device, seed=3)
        bench = b.Bench(w, hosts, clock)
        print("#", kind, batch, bench.decision(), flush=True)
        for what, options in (("resolve alone", dict(copy=False)), ("call", {})):
            staged, plain = [], []
            for _ in range(3):
                onchip_launch.fitted = fitted
                staged.append(bench.call_us(**options))
                onchip_launch.fitted = unstaged
                plain.append(bench.call_us(**options))
            onchip_launch.fitted = fitted
            s, p = statistics.median(staged), statistics.median(plain)
            print(f"{kind:<8} {batch:>5} {what:<14} {s:>10.1f} {p:>10.1f} {s / p:>6.2f}", flush=True)
