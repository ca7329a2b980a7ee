"""Compile every kvplan kernel for the H200 (sm_90) on a machine without a GPU, and report each one's resources.

Triton compiles to a cubin without a device when its driver reports a target: this script installs a stand-in driver
that reports ``cuda:90``, runs the launch paths on CPU tensors with Triton's launches turned into compile-only
warm-ups, and reads registers, spills (local memory) and shared memory from each cubin with the ``cuobjdump`` that
Triton ships. It catches compile errors that the interpreter never sees (layout passes, register pressure) before a
GPU session, at production shapes (K=2048, HOT=4096, S=4, tail 64, 576-byte rows; DFlash materialize shapes).

The on-chip resolve (CUDA C++, ``kvplan/kernels/onchip``) is built by NVRTC for sm_90 and sm_100 at the same shapes
(``cuda-bindings`` and ``nvidia-cuda-nvrtc``, in the ``dev`` extra; no driver needed): registers, spills, shared memory.

    python scripts/compile_check.py            # every variant the swap-in, the copy and materialize launch; on-chip
    python scripts/compile_check.py --only swap_in
    python scripts/compile_check.py --only onchip
    python scripts/compile_check.py --only copy     # the plan copy's variants: the swap-in's own and the replays'
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be compiled, not interpreted
# the kernels of the checkout this script sits in, whichever kvplan is installed (a script's own folder, not the
# checkout, heads sys.path)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.runtime.jit as jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
COMPILED: list[tuple[str, object, float, str]] = []
CALL = [""]  # what the launches compiled now come from (``--only copy`` names each variant by it)


class CompileOnlyDriver:
    """What Triton asks a driver for when it compiles: the target, a device and a stream."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _compile_only(original):
    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel, time.perf_counter() - t0, CALL[0]))
        return None  # nothing launched: the launch paths treat the call as not replayable

    return run


def resources(kernel) -> dict[str, int]:
    """REG/STACK/SHARED/LOCAL of the kernel's cubin, as ``cuobjdump -res-usage`` reports them."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def swap_in_calls() -> None:
    """Production-shaped swap-ins on each path by default (flat, sorted split, one program per row) and on each path
    forced at batch 1 (an argument of 1 is specialised as a constant), both call kinds."""
    from kvplan.kernels import hisparse, planner

    default = hisparse.RESOLVE_LAUNCH
    try:
        _swap_in_calls((1, 8, planner.PER_ROW_MIN_BATCH), "default")
        for path in (dict(sorted_plan=True, per_row=False), dict(sorted_plan=True, per_row=True)):
            hisparse.RESOLVE_LAUNCH = hisparse.ResolveLaunch(**path)
            _swap_in_calls((1,), "split" if not path["per_row"] else "per-row")
    finally:
        hisparse.RESOLVE_LAUNCH = default


def _swap_in_calls(batches: tuple[int, ...], path: str) -> None:
    from kvplan.calls import swap_in_call
    from kvplan.kernels import hisparse
    from kvplan.plan import MissPlan
    from kvplan.state import HotBufferState
    from kvplan.workspace import swap_in_workspace_columns

    k, hot, tail, steps, item = 2048, 4096, 64, 4, 576
    for batch in batches:
        for speculative in (True, False):
            CALL[0] = f"swap-in {path} batch {batch} {'spec' if speculative else 'single'}"
            s = steps if speculative else 1
            state = HotBufferState.allocate(batch, hot, tail, 8192, device="cpu", scratch=4096 if speculative else 0)
            shape = (batch, s, k) if speculative else (batch, k)
            tokens = torch.randint(0, 8000, shape, dtype=torch.int32)
            i32, bf16 = torch.int32, torch.bfloat16
            call = swap_in_call(
                speculative, state, tokens, torch.empty_like(tokens), torch.arange(batch, dtype=i32),
                torch.full((batch * s,), 8000, dtype=i32), torch.zeros(1 << 16, item // 2, dtype=bf16),
                torch.zeros(state.device_rows, item // 2, dtype=bf16), torch.tensor([batch], dtype=i32),
                MissPlan.allocate(batch, s * k, "cpu"),
                torch.zeros(batch, swap_in_workspace_columns(s, k), dtype=torch.int64),
                torch.zeros(8, dtype=torch.int64),
            )  # fmt: skip
            hisparse.run_swap_in(call)
        CALL[0] = f"swap-in blocks {path} batch {batch}"
        _block_call(batch)
    CALL[0] = ""


def _block_call(batch: int) -> None:
    """The block front end (MiniMax M3's shapes: 16 blocks of 128 tokens, HOT 4096, K and V rows of 256 bytes)."""
    from kvplan.calls import swap_in_blocks_call
    from kvplan.kernels import hisparse
    from kvplan.plan import MissPlan
    from kvplan.state import HotBufferState
    from kvplan.workspace import swap_in_workspace_columns

    blocks, size, hot, item = 16, 128, 4096, 256
    i32, bf16 = torch.int32, torch.bfloat16
    state = HotBufferState.allocate(batch, hot, 1, 8192, device="cpu")
    top_k_blocks = torch.randint(0, 60, (batch, blocks), dtype=i32)
    host = [torch.zeros(1 << 16, item // 2, dtype=bf16) for _ in range(2)]
    device = [torch.zeros(state.device_rows, item // 2, dtype=bf16) for _ in range(2)]
    call = swap_in_blocks_call(
        state, top_k_blocks, torch.empty(batch, blocks * size, dtype=i32), torch.arange(batch, dtype=i32),
        torch.full((batch,), 8000, dtype=i32), host[0], host[1], device[0], device[1], size,
        torch.tensor([batch], dtype=i32), MissPlan.allocate(batch, blocks * size, "cpu"),
        torch.zeros(batch, swap_in_workspace_columns(1, blocks * size), dtype=torch.int64),
        torch.zeros(8, dtype=torch.int64),
    )  # fmt: skip
    hisparse.run_swap_in(call)


def copy_calls() -> None:
    """The plan copy's replays (``copy_planned``) at production shapes (K=2048, S=4, 576-byte rows; MiniMax M3's K and
    V rows of 256 bytes): alone, with the swap-in's workspace (its two launches), with padding rows and counters, and
    with a work counter (the benchmarks' ``dispatch``). The swap-in's own copies come from ``swap_in_calls``."""
    from kvplan.counters import SWAP_IN_COPY_BASE
    from kvplan.kernels.copy import run_copy
    from kvplan.kernels.plan_copy.launch import FLAT_COPY_LAUNCH, launch_copy
    from kvplan.plan import MissPlan
    from kvplan.runtime.launch_replay import UNRECORDED
    from kvplan.workspace import swap_in_workspace_columns, swap_in_workspace_regions

    batch, steps, k = 8, 4, 2048
    i32, bf16 = torch.int32, torch.bfloat16
    plan = MissPlan.allocate(batch, steps * k, "cpu")
    ws = torch.zeros(batch, swap_in_workspace_columns(steps, k), dtype=torch.int64)
    for item, values in ((576, False), (256, True)):
        host = torch.zeros(1 << 16, item // 2, dtype=bf16)
        dev = torch.zeros(8192, item // 2, dtype=bf16)
        kv = dict(host_cache_v=host.clone(), device_buffer_v=dev.clone()) if values else {}
        rows = "K+V" if values else "K"
        calls = (
            (f"replay {rows}", dict(num_real_reqs=None, counters=None)),
            (f"replay {rows} padding counters", dict(num_real_reqs=torch.tensor([batch], dtype=i32),
                                                     counters=torch.zeros(8, dtype=torch.int64))),
            (f"replay {rows} workspace", dict(num_real_reqs=None, counters=None, workspace=ws)),
            (f"replay {rows} dispatch", dict(num_real_reqs=None, counters=None, dispatch=torch.zeros(2, dtype=i32))),
        )  # fmt: skip
        for label, args in calls:
            CALL[0] = label
            run_copy(plan, host, dev, **args, **kv)
        # the swap-in's flat copy after the on-chip resolve (CUDA only, so no CPU call takes it): each row once its
        # ready word says the resolve published it
        CALL[0] = f"swap-in flat {rows} per row"
        launch_copy(
            plan, host, dev, num_real_reqs=torch.tensor([batch], dtype=i32), counters=torch.zeros(8, dtype=torch.int64),
            counter_base=SWAP_IN_COPY_BASE, recorder=UNRECORDED, launch=FLAT_COPY_LAUNCH, marked=ws.view(i32),
            ready_at=swap_in_workspace_regions(steps, k).sync, early=True, **kv,
        )  # fmt: skip
    CALL[0] = ""


def materialize_calls() -> None:
    """DFlash shapes (5 layers, 8 heads, head_dim 128, bf16) at decode and prefill token counts."""
    from kvplan.kernels.fused_kv import run_materialize

    layers, heads, dim = 5, 8, 128
    for tokens in (1, 8, 128, 8192):
        kv = torch.zeros(tokens, layers, 2 * heads * dim, dtype=torch.bfloat16)
        out = torch.zeros(layers, tokens, heads, dim, dtype=torch.bfloat16)
        run_materialize(kv, torch.ones(layers, dim, dtype=torch.bfloat16), torch.full((layers,), 1e-6),
                        torch.zeros(4096, dim), torch.arange(tokens), heads, dim, dim, out, out.clone(),
                        False)  # fmt: skip


def onchip_builds() -> int:
    """The on-chip resolve (CUDA C++ through NVRTC, no driver needed) for sm_90 and sm_100 at the shapes engines run:
    registers and spills per build; the largest spill in bytes (-1 when cuda-bindings / NVRTC are not installed)."""
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        print("on-chip resolve: not built (pip install cuda-bindings nvidia-cuda-nvrtc)")
        return -1
    from kvplan.kernels.onchip.compiler import OnChipConfig, compile_resolve, shared_bytes
    from kvplan.workspace import swap_in_workspace_regions

    worst = 0
    print(f"{'on-chip resolve':<52} {'arch':>6} {'REG':>4} {'SPILL':>5} {'SHARED':>7}")
    # (the single-step builds: the native API's, which checks the newest token's slot, and the SGLang adapter's; the
    # last two: the block front end, 16 blocks of 128 tokens, MiniMax M3's selection, native and the adapter's)
    builds = ((4, 4096, True, True, 0, False), (4, 8192, True, False, 0, False), (1, 4096, False, True, 0, True),
              (1, 4096, False, True, 0, False), (1, 4096, False, True, 128, True),
              (1, 4096, False, True, 128, False))  # fmt: skip
    for steps, hot, speculative, sort, block, check_newest in builds:
        config = OnChipConfig(
            steps=steps, top_k=2048, hot=hot, tail=64, speculative=speculative, sorted=sort,
            apart=sort and not speculative, epochs=sort, rpi64=False, seq64=False, has_num_real=True,
            has_counters=True, layout=swap_in_workspace_regions(steps, 2048), block=block, check_newest=check_newest,
            dense_tokens=True, dense_out=True, ready=not sort, share=sort,
        )  # fmt: skip
        for arch in ("sm_90", "sm_100"):
            build = compile_resolve(config, arch)
            worst = max(worst, build.spill_bytes)
            name = f"S={steps} K=2048 HOT={hot} {'spec' if speculative else 'single'}"
            name += " sorted" if sort else " ready"  # (a plan in miss order publishes each row to the copy)
            name += f" blocks {block}" if block else ""
            name += "" if speculative else (" native" if check_newest else " sglang")
            print(f"{name:<52} {arch:>6} {build.registers:>4} {build.spill_bytes:>5} {shared_bytes(config):>7}")
    spills = "no spills" if worst == 0 else f"spills: up to {worst} bytes"
    print(f"on-chip resolve built for sm_90 and sm_100; {spills}")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["swap_in", "materialize", "onchip", "copy"], default=None,
                        help="copy: the plan copy's variants alone, each named by the call it came from")  # fmt: skip
    args = parser.parse_args(argv)
    driver.set_active(CompileOnlyDriver())
    jit.JITFunction.run = _compile_only(jit.JITFunction.run)
    import kvplan.kernels.fused_kv  # noqa: F401  (decorated as compiled kernels: before TRITON_INTERPRET is set)
    import kvplan.kernels.hisparse  # noqa: F401

    if args.only == "onchip":
        return 1 if onchip_builds() > 0 else 0
    os.environ["TRITON_INTERPRET"] = "1"  # (after the kernels' import: lets kvplan's checks accept CPU tensors)
    # ... which they refuse when the kernels were built for a GPU (kvplan.kernels.INTERPRETED False): here they are on
    # purpose, and are compiled, never launched, on those tensors
    kvplan.kernels.INTERPRETED = None
    # the target is Hopper: compile the launches that start early (programmatic dependent launch) as the H200 runs them
    kvplan.kernels.hisparse.dependent_launch = lambda device, kernel: True
    if args.only in (None, "swap_in", "copy"):
        swap_in_calls()
    if args.only in (None, "copy"):
        copy_calls()
    if args.only in (None, "materialize"):
        materialize_calls()
    spilled = onchip_builds() > 0 if args.only is None else False
    seen = set()
    copy_only = args.only == "copy"
    print(f"{'kernel':<32} {'warps':>5} {'REG':>4} {'LOCAL':>5} {'SHARED':>6} {'compile s':>9}"
          + ("  call" if copy_only else ""))  # fmt: skip
    worst = 0
    for name, kernel, seconds, call in COMPILED:
        if kernel is None or id(kernel) in seen or (copy_only and "copy" not in name):
            continue
        seen.add(id(kernel))
        res = resources(kernel)
        worst = max(worst, res.get("LOCAL", 0))
        print(f"{name:<32} {kernel.metadata.num_warps:>5} {res.get('REG', 0):>4} {res.get('LOCAL', 0):>5} "
              f"{res.get('SHARED', 0):>6} {seconds:>9.1f}" + (f"  {call}" if copy_only else ""))  # fmt: skip
    print(f"{len(seen)} kernels compiled for sm_90; {'no spills' if worst == 0 else f'spills: up to {worst} bytes'}")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
