"""Driver for ncu: the on-chip resolve of P's speculative and single-step calls at batch 8, twice in miss order (the
flat build) then twice sorted (the sorted build + share launch), L2 flushed before each. Under
ncu --kernel-name regex:"kvplan_resolve|_sort_plan_kernel" it shows what the sorted build adds."""

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import hisparse

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 3)
shape.host_rows["B"] = 1 << 20  # a smaller pinned cache (the resolve reads no host rows)
hosts = b.pinned_hosts(shape.host_rows["B"], 2, device)
flat = hisparse.ResolveLaunch(sorted_plan=False)
sort = hisparse.ResolveLaunch(sorted_plan=True)
for kind in ("spec", "single"):
    w = b.make_workload("P", batch=8, speculative=kind == "spec", calls=2, shape=shape, device=device, seed=8)
    bench = b.Bench(w, hosts, clock)
    for launch in (flat, flat, sort, sort):
        bench.restore()
        clock.flush.zero_()
        torch.cuda.synchronize()
        bench._call(0, launch=launch, copy=False)
        torch.cuda.synchronize()
    print(kind, "done", flush=True)
