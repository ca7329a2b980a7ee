"""Probe: what limits the K+V plan copy of the block (MHA) swap-in on P at batch 64 (0.51 of the link in
kvplan bench swap_in --calls mha). Times the same plans copied K+V (as shipped), K only (one host cache), with and
without the work counter, and over a few copy grids. Run on the GPU from the repository root."""

import sys

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import copy as copy_module

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 10)
hosts = b.pinned_hosts(shape.host_rows["B"], 1 + b.REPLAY_LAYERS, device)
ceiling = b.ceiling_gbps(hosts[0], device, 10)
print(f"ceiling {ceiling:.1f} GB/s", flush=True)
batches = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64").split(",")]
for batch in batches:
    w = b.make_mha_workload("P", batch=batch, calls=4, shape=shape, device=device, seed=batch)
    bench = b.Bench(w, hosts, clock)
    print(f"batch {batch}: call {bench.call_us():.1f} us; {bench.decision()}", flush=True)
    rows = bench.plan_rows()

    def report(label, us, kv=2):
        gbps = rows * kv * b.ITEM / (us * 1e3)
        print(f"  {label:<44} {us:8.1f} us {gbps:6.1f} GB/s {gbps / ceiling:5.2f} of link", flush=True)

    report("K+V, default", bench.copy_us())
    report("K+V, work counter", bench.copy_us(dispatch=True))
    mha = bench.mha
    bench.mha = False  # the same plans, K rows only
    report("K only, default", bench.copy_us(), kv=1)
    report("K only, work counter", bench.copy_us(dispatch=True), kv=1)
    bench.mha = mha
    for rows_per, per_sm, warps in ((2, 1, 1), (8, 1, 1), (4, 2, 1), (4, 4, 1), (4, 1, 2), (4, 8, 1), (4, 16, 1)):
        launch = copy_module.CopyLaunch(rows_per_program=rows_per, programs_per_sm=per_sm, num_warps=warps)
        report(f"K+V {launch}", bench.copy_us(launch=launch))
    nonzero = int((bench.miss_plans[0].count[:batch] > 0).sum())
    print(f"  plan rows per call {rows}, requests with misses {nonzero}", flush=True)
