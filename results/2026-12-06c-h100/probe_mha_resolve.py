"""Probe: what the block (MHA) and MLA single-step resolve alone costs at batch 8 and 64 on P, and which part of the
default path (on-chip resolve with the plan sorted, then the share launch) is over the 12 µs goal: the resolve alone
with the plan sorted and shared (default), sorted but not shared (no share launch), and in miss order (no sort, no
share; the flat copy). Run on the GPU from the repository root."""

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import hisparse

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 20)
hosts = b.pinned_hosts(shape.host_rows["B"], 1 + b.REPLAY_LAYERS, device)
variants = {
    "sorted+shared (default)": hisparse.ResolveLaunch(),
    "sorted, not shared": hisparse.ResolveLaunch(shared_rows=False),
    "miss order (flat)": hisparse.ResolveLaunch(sorted_plan=False),
}
for kind in ("mha", "single"):
    for batch in (1, 8, 64):
        if kind == "mha":
            w = b.make_mha_workload("P", batch=batch, calls=4, shape=shape, device=device, seed=batch)
        else:
            w = b.make_workload("P", batch=batch, speculative=False, calls=4, shape=shape, device=device, seed=batch)
        bench = b.Bench(w, hosts, clock)
        for name, launch in variants.items():
            resolve = bench.call_us(copy=False, launch=launch)
            call = bench.call_us(launch=launch)
            split = b.split_text(bench.launch_split(launch=launch))
            print(f"{kind} batch {batch:2d} {name:<24} resolve alone {resolve:6.1f} us, call {call:7.1f} us; {split}",
                  flush=True)
