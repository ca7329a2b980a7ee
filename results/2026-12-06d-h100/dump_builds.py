"""The cubins of the builds probe_onchip_ncu.py launches (P, batch 8, speculative and single-step, flat and sorted),
written to OUT/<name>.cubin with the prelude's line count, for nvdisasm -g."""

import sys

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import hisparse
from kvplan.kernels.onchip import compiler

out = sys.argv[1]
device = torch.device("cuda")
seen = []
original = compiler.compile_resolve


def recording(config, arch):
    build = original(config, arch)
    if config not in seen:
        seen.append(config)
        name = f"{'spec' if config.speculative else 'single'}_{'sorted' if config.sorted else 'flat'}"
        open(f"{out}/{name}.cubin", "wb").write(build.cubin)
        print(name, "registers", build.registers, "prelude lines", compiler.prelude(config).count("\n"))
    return build


compiler.compile_resolve = recording
import kvplan.kernels.onchip.launch as launch_mod  # noqa: E402

launch_mod.compile_resolve = recording
shape = b.Shape(False)
clock = b.Clock(device, 3)
shape.host_rows["B"] = 1 << 20
hosts = b.pinned_hosts(shape.host_rows["B"], 2, device)
for kind in ("spec", "single"):
    w = b.make_workload("P", batch=8, speculative=kind == "spec", calls=2, shape=shape, device=device, seed=8)
    bench = b.Bench(w, hosts, clock)
    for launch in (hisparse.ResolveLaunch(sorted_plan=False), hisparse.ResolveLaunch(sorted_plan=True)):
        bench.restore()
        bench._call(0, launch=launch, copy=False)
        torch.cuda.synchronize()
