"""The per-row copy's ready word zeroed and fenced after the block's token loads are issued (the change of
``results/2026-12-06e-h100/next_ready_after_loads.diff``, made here by two replacements into a copy) against
``resolve.cu`` as it is (zeroed and fenced before them), same process, same card: the on-chip resolve is recompiled
from either source in turn (``compiler.SOURCE``, its caches cleared). Only the READY build changes, so the cells are
the flat plans (batches 1, 2, 4). Per cell three alternating pairs of the benchmark's graph-replay medians, for the
resolve alone (``copy=False``) and the whole call; compared by median."""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile

import torch

from kvplan.benchmarks import swap_in as bench_module
from kvplan.kernels.onchip import compiler, launch

EARLY = """    if constexpr (READY) {
        if (tid == 0) {
            wsr[W_READY] = 0;
            __threadfence();
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        }
    } else {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#else
    if constexpr (READY) {
        if (tid == 0) wsr[W_READY] = 0;  // (no early launch: the copy starts after this grid)
    }
#endif
"""
LOADS = """        tq[q] = i < N_OCC ? token_at(tok_row, tok_s1, tok_s2, i) : -1;
    }
"""
AFTER = """    if constexpr (READY) {
        if (tid == 0) {
            wsr[W_READY] = 0;
#if __CUDA_ARCH__ >= 900
            __threadfence();
            asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
        }
    }
"""


def after_loads() -> pathlib.Path:
    text = compiler.SOURCE.read_text()
    assert text.count(EARLY) == 1 and text.count(LOADS) == 1, "resolve.cu changed: the probe's replacements miss"
    text = text.replace(
        EARLY, '    if constexpr (!READY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n#endif\n'
    )
    path = pathlib.Path(tempfile.gettempdir()) / "resolve_after_loads.cu"
    path.write_text(text.replace(LOADS, LOADS + AFTER))
    return path


SOURCES = {"as is": compiler.SOURCE, "after loads": after_loads()}


def use(name: str) -> None:
    compiler.SOURCE = SOURCES[name]
    compiler.compile_resolve.cache_clear()
    launch._LOADED.clear()


device = torch.device("cuda")
shape = bench_module.Shape(False)
clock = bench_module.Clock(device, 10)
workloads = sys.argv[1].split(",") if len(sys.argv) > 1 else ["P", "A"]
batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 4]
print(torch.cuda.get_device_name(), "| µs: as is / after loads (3 pairs, median), ratio")
for wl in workloads:
    hosts = bench_module.pinned_hosts(shape.host_rows["A" if wl == "A" else "B"], 1, device)
    for kind in ("spec", "single"):
        for batch in batches:
            w = bench_module.make_workload(
                wl, batch=batch, speculative=kind == "spec", calls=max(4, 64 // batch), shape=shape, device=device,
                seed=batch,
            )  # fmt: skip
            b = bench_module.Bench(w, hosts, clock)
            for what, options in (("resolve alone", dict(copy=False)), ("call", {})):
                runs = {name: [] for name in SOURCES}
                for _ in range(3):
                    for name in SOURCES:
                        use(name)
                        runs[name].append(b.call_us(**options))
                x, y = (statistics.median(runs[name]) for name in SOURCES)
                print(f"  {wl} {kind:<6} batch {batch} {what:<13}: {x:7.2f} / {y:7.2f}  {y / x:.3f}", flush=True)
            use("as is")
