"""Swap-in benchmark (H200): µs per call under CUDA-graph replay, against the pinned host->device copy ceiling.

What is measured, and why it is honest:
- The host cache is production-sized (``--host-gb``, default 4.6 GB, pinned): small host caches flatter gathers.
  Each request's tokens occupy a contiguous range of host rows (as a paged host pool hands them out), spread over
  the whole cache; misses are random tokens of the request's context.
- Every call sees fresh misses: a graph captures ``--calls`` consecutive calls, each on its own top-k (hits from
  the request's hot set, misses never seen before), so each call admits the same number of new rows. Before every
  replay the hot-buffer state is restored and the L2 cache is flushed (both outside the timed region); the time is
  the median replay over ``--reps`` replays, divided by the calls per graph.
- The ceiling is the pinned host->device ``copy_`` of 1 GiB measured in the same run; "x ideal" is the time per call
  over (unique-miss bytes / ceiling).
- The reference's time is one eager call (it synchronises by design).

Writes the table to stdout (rich if installed) and everything to ``--out`` as JSON. ``--smoke`` runs tiny shapes on
the CPU under the Triton interpreter (no graphs, wall-clock times) to check the script itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from kvplan import kernels, reference
from kvplan.counters import new_counters
from kvplan.kernels.layout import swap_in_workspace_columns

# the modules (kvplan.kernels.swap_in the attribute is the function of the same name)
swap_in_module = importlib.import_module("kvplan.kernels.swap_in")
copy_module = importlib.import_module("kvplan.kernels.copy")

ITEM = 576
I16, I32, I64 = torch.int16, torch.int32, torch.int64


# ---------------------------------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Median time of a function: CUDA graph replays timed with events on a GPU, wall clock on the CPU."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def time_ms(self, body, prepare=lambda: None) -> float:
        """Median ms of ``body`` (captured once as a graph on CUDA), ``prepare()`` + L2 flush before each run."""
        prepare()
        body()  # warm-up: compiles
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                prepare()
                t0 = time.perf_counter()
                body()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        prepare()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        times = []
        for _ in range(self.reps):
            prepare()
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def ceiling_gbps(host_flat: torch.Tensor, device: torch.device, reps: int) -> float:
    """Pinned host -> device ``copy_`` bandwidth of (up to) 1 GiB."""
    n = min(host_flat.numel(), 1 << 30)
    src, dst = host_flat[:n], torch.empty(n, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        return float("nan")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return n / statistics.median(times) / 1e6


# ---------------------------------------------------------------------------------------------------------------------
# Workload: state, per-call top-k with fresh misses


def make_workload(
    *, batch, speculative, steps, top_k, hot, tail, n_host, calls, misses_per_step, max_context, device, seed
):
    """Engine-like state for ``batch`` requests and ``calls`` consecutive calls' inputs, each with fresh misses.

    ``misses_per_step[s]`` new misses enter at step ``s`` (later steps repeat the earlier ones, as drafts do); the
    rest of each step's top-k are hits from a fixed list of hot tokens, so every call admits the same rows.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    steps = steps if speculative else 1
    width = hot + tail
    region = n_host // batch
    context = min(max_context, region - steps - 8)
    max_len = context + steps + 8
    cumulative = torch.tensor(misses_per_step[:steps]).cumsum(0).tolist()
    unique = cumulative[-1]
    assert top_k - unique >= 0 and hot >= top_k and context > hot + calls * unique

    tokens = torch.empty(calls, batch, steps, top_k, dtype=I32, device=device)  # by request, then by batch row
    hot_tokens = torch.empty(batch, hot, dtype=I32, device=device)
    lru = torch.empty(batch, hot, dtype=I16, device=device)
    for r in range(batch):
        order = torch.randperm(context - 1, generator=gen, device=device)
        held = order[:hot]
        fresh = order[hot : hot + calls * unique].reshape(calls, unique)
        hot_tokens[r] = held.to(I32)
        lru[r] = torch.randperm(hot, generator=gen, device=device).to(I16)
        hits = held[torch.randperm(hot, generator=gen, device=device)[:top_k]]
        for c in range(calls):
            for s in range(steps):
                row = torch.cat([fresh[c, : cumulative[s]], hits[: top_k - cumulative[s]]])
                tokens[c, r, s] = row[torch.randperm(top_k, generator=gen, device=device)].to(I32)
    buffer_tokens = torch.full((batch, width), -1, dtype=I32, device=device)
    buffer_tokens[:, :hot] = hot_tokens
    buffer_tokens[:, hot : hot + steps] = torch.arange(context - 1, context + steps - 1, dtype=I32, device=device)
    host_locs = torch.arange(max_len, device=device)[None, :] + region * torch.arange(batch, device=device)[:, None]
    seq = torch.arange(context, context + steps, dtype=I32, device=device).repeat(batch)
    rids = torch.randperm(batch, generator=gen, device=device).to(I32)  # batch row b serves request rids[b]
    tokens = tokens[:, rids.long()]
    return dict(
        speculative=speculative,
        tokens=tokens if speculative else tokens[:, :, 0],
        unique=unique,
        context=context,
        state=dict(
            device_buffer_tokens=buffer_tokens,
            device_buffer_locs=torch.arange(batch * width, dtype=I32, device=device).reshape(batch, width),
            lru_slots=lru,
            host_cache_locs=host_locs,
        ),
        seq_lens=seq if speculative else seq[::steps].contiguous(),
        req_pool_indices=rids,
        device_buffer=torch.zeros(batch * width, ITEM // 2, dtype=torch.bfloat16, device=device),
    )


def bench_swap_in(w, host, clock, *, num_warps=None, reference_time=True):
    """µs per call of swap_in(_spec) over the workload's calls, its copy share, and the reference's time."""
    calls, batch, top_k = w["tokens"].shape[0], w["tokens"].shape[1], w["tokens"].shape[-1]
    n = w["tokens"][0, 0].numel()
    device = clock.device
    state = w["state"]
    saved = w.setdefault("initial", {k: v.clone() for k, v in state.items()})  # every bench starts from here
    ms = torch.zeros(calls, batch, n, dtype=I64, device=device)
    md = torch.zeros(calls, batch, n, dtype=I32, device=device)
    mc = torch.zeros(calls, batch, dtype=I32, device=device)
    ws = torch.zeros(batch, swap_in_workspace_columns(n // top_k, top_k), dtype=I64, device=device)
    out = torch.zeros_like(w["tokens"][0])
    counters = new_counters(device)
    num_real = torch.tensor([batch], dtype=I32, device=device)

    def restore():
        for k, v in saved.items():
            state[k].copy_(v)

    def calls_body():
        for c in range(calls):
            swap_in_module._swap_in(
                speculative=w["speculative"],
                top_k_tokens=w["tokens"][c],
                host_cache=host,
                device_buffer=w["device_buffer"],
                top_k_device_locs=out,
                req_pool_indices=w["req_pool_indices"],
                seq_lens=w["seq_lens"],
                num_real_reqs=num_real,
                scratch_locs=None,
                miss_src=ms[c],
                miss_dst=md[c],
                miss_count=mc[c],
                workspace=ws,
                counters=counters,
                num_warps=num_warps,
                **state,
            )

    def copies_body():
        for c in range(calls):
            kernels.copy_planned(
                miss_src=ms[c],
                miss_dst=md[c],
                miss_count=mc[c],
                num_real_reqs=num_real,
                host_cache=host,
                device_buffer=w["device_buffer"],
            )

    total = clock.time_ms(calls_body, restore) / calls
    admitted = mc.float().mean().item()
    copy = clock.time_ms(copies_body) / calls
    ref_ms = float("nan")
    if reference_time:
        restore()
        fn = reference.swap_in_spec if w["speculative"] else reference.swap_in
        if clock.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(
            top_k_tokens=w["tokens"][0],
            host_cache=host,
            device_buffer=w["device_buffer"],
            top_k_device_locs=out,
            req_pool_indices=w["req_pool_indices"],
            seq_lens=w["seq_lens"],
            num_real_reqs=num_real,
            **state,
        )
        if clock.cuda:
            torch.cuda.synchronize()
        ref_ms = (time.perf_counter() - t0) * 1e3
    restore()
    return dict(us=total * 1e3, copy_us=copy * 1e3, misses_per_row=admitted, reference_ms=ref_ms, plans=(ms, md, mc))


def bench_copy(plans, host, device_buffer, clock, **params):
    """GB/s of the plan copy over all the plans (each a fresh set of rows)."""
    ms, md, mc = plans
    num_real = torch.tensor([ms.shape[1]], dtype=I32, device=ms.device)

    def body():
        for c in range(ms.shape[0]):
            copy_module.launch_copy(
                miss_src=ms[c],
                miss_dst=md[c],
                miss_count=mc[c],
                num_real_reqs=num_real,
                host_cache=host,
                device_buffer=device_buffer,
                counters=None,
                counter_base=0,
                **params,
            )

    ms_time = clock.time_ms(body)
    rows = int(mc.sum())
    return dict(rows_per_call=rows / ms.shape[0], gbps=rows * ITEM / ms_time / 1e6, ms=ms_time / ms.shape[0])


def thp_registered_host(nbytes: int) -> tuple[torch.Tensor | None, str]:
    """Host memory with transparent huge pages requested, registered with CUDA (a diagnostic: fewer IOMMU pages)."""
    import mmap

    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(buf, dtype=torch.uint8)
        t.fill_(1)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(rc) != 0:
            return None, f"cudaHostRegister failed: {rc}"
        t._kvplan_mmap = buf  # keep the mapping alive with the tensor
        huge = [line for line in open("/proc/meminfo") if line.startswith("AnonHugePages")]
        return t, (huge[0].strip() if huge else "AnonHugePages unknown")
    except Exception as exc:  # diagnostic only
        return None, f"{type(exc).__name__}: {exc}"


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of the compiled resolve/copy kernels (best effort across Triton versions)."""
    found = []
    for fn in (swap_in_module._resolve_kernel, copy_module._copy_rows_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            entries = cache[0] if isinstance(cache, tuple) else cache
            for compiled in getattr(entries, "values", lambda: [])():
                found.append(
                    {
                        "kernel": fn.__name__,
                        "num_warps": getattr(getattr(compiled, "metadata", None), "num_warps", None),
                        "n_regs": getattr(compiled, "n_regs", None),
                        "n_spills": getattr(compiled, "n_spills", None),
                        "shared": getattr(getattr(compiled, "metadata", None), "shared", None),
                    }
                )
    return found


# ---------------------------------------------------------------------------------------------------------------------


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c, justify="right")
        for r in rows:
            table.add_row(*[_fmt(v) for v in r])
        Console(width=200).print(table)
    except ImportError:
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(_fmt(v) for v in r))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_swap_in.json", help="JSON results file")
    parser.add_argument("--host-gb", type=float, default=4.6, help="pinned host cache size (GB)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--reps", type=int, default=10, help="graph replays per measurement (median)")
    parser.add_argument("--sweep", action="store_true", help="then sweep copy and resolve launch parameters (slow)")
    parser.add_argument("--thp", action="store_true", help="also copy from a huge-page, cudaHostRegister'ed host cache")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    args = parser.parse_args(argv)

    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        print("bench_swap_in: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    K, HOT, TAIL, S = (8, 16, 4, 4) if smoke else (2048, 4096, 64, 4)
    spec_misses = [1, 1, 1, 1] if smoke else [196, 196, 195, 195]  # 782 unique per request
    single_misses = [2] if smoke else [410]  # 20% of K
    n_host = 4000 if smoke else int(args.host_gb * 1e9) // ITEM
    max_context = 1000 if smoke else 1 << 20
    batches = [int(b) for b in args.batches.split(",")]
    clock = Clock(device, 2 if smoke else args.reps)
    results: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu (interpreter)", "item_bytes": ITEM}

    t0 = time.perf_counter()
    host_bytes = torch.empty(n_host * ITEM, dtype=torch.uint8, pin_memory=not smoke)
    step = 1 << 28
    for start in range(0, host_bytes.numel(), step):
        chunk = host_bytes[start : start + step]
        chunk.copy_(torch.randint(0, 256, (chunk.numel(),), dtype=torch.uint8, device=device))
    host = host_bytes.view(torch.bfloat16).view(n_host, ITEM // 2)
    ceiling = ceiling_gbps(host_bytes, device, 10)
    setup_s = time.perf_counter() - t0
    results.update(host_rows=n_host, host_gb=n_host * ITEM / 1e9, ceiling_gbps=ceiling, setup_s=setup_s)
    print(f"host cache {n_host * ITEM / 1e9:.2f} GB pinned; pinned copy_ ceiling {ceiling:.1f} GB/s", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    workloads: dict = {}

    def workload(speculative: bool, batch: int):
        key = (speculative, batch)
        if key not in workloads:
            workloads[key] = make_workload(
                batch=batch,
                speculative=speculative,
                steps=S,
                top_k=K,
                hot=HOT,
                tail=TAIL,
                n_host=n_host,
                calls=max(4, min(32, 256 // batch)) if not smoke else 2,
                misses_per_step=spec_misses if speculative else single_misses,
                max_context=max_context,
                device=device,
                seed=batch,
            )
        return workloads[key]

    results["launch"] = dict(
        copy_rows_per_program=copy_module.ROWS_PER_PROGRAM,
        copy_num_warps=copy_module.NUM_WARPS,
        copy_programs_per_sm=copy_module.PROGRAMS_PER_SM,
        resolve_num_warps="default (kvplan.kernels.swap_in._resolve_warps)",
    )

    # 1. the table: swap_in_spec and swap_in per batch, with the reference's time
    rows, runs = [], []
    for speculative in (True, False):
        for batch in batches:
            w = workload(speculative, batch)
            r = bench_swap_in(w, host, clock, reference_time=True)
            unique_bytes = batch * w["unique"] * ITEM
            ideal_us = unique_bytes / (ceiling * 1e3) if ceiling == ceiling else float("nan")
            name = f"swap_in_spec S={S}" if speculative else "swap_in (20% miss)"
            entry = dict(
                kernel=name,
                batch=batch,
                calls_per_graph=w["tokens"].shape[0],
                context=w["context"],
                unique_misses_per_row=w["unique"],
                admitted_per_row=r["misses_per_row"],
                us_per_call=r["us"],
                copy_us_per_call=r["copy_us"],
                unique_miss_bytes=unique_bytes,
                gbps=unique_bytes / (r["us"] * 1e3),
                ceiling_gbps=ceiling,
                x_ideal=r["us"] / ideal_us,
                reference_ms=r["reference_ms"],
            )
            runs.append(entry)
            rows.append(
                [
                    name,
                    batch,
                    entry["us_per_call"],
                    entry["copy_us_per_call"],
                    unique_bytes,
                    entry["gbps"],
                    ceiling,
                    entry["gbps"] / ceiling,
                    entry["x_ideal"],
                    entry["reference_ms"] * 1e3,
                ]
            )
            print(entry, flush=True)
            if speculative and batch == max(batches):
                plans = r["plans"]
            results["swap_in"] = runs
            save()
    print_table(
        f"kvplan swap-in, item {ITEM} B, K={K}, HOT={HOT}, tail={TAIL}, host cache {n_host * ITEM / 1e9:.1f} GB",
        ["kernel", "batch", "µs/call", "copy µs", "miss bytes", "GB/s", "ceiling", "ratio", "x ideal", "ref µs"],
        rows,
    )

    # 2. copy_planned of >= 50k rows (the speculative plans of the largest batch), and access-pattern diagnostics
    ms, md, mc = plans
    dev_buffer = workload(True, max(batches))["device_buffer"]
    copy_rows = []
    default = bench_copy((ms, md, mc), host, dev_buffer, clock)
    copy_rows.append(["engine-like plan", default["rows_per_call"], default["gbps"], default["gbps"] / ceiling])
    results["copy_planned"] = dict(default, ceiling_gbps=ceiling, ratio=default["gbps"] / ceiling)
    planned = torch.arange(ms.shape[-1], device=ms.device) < mc[..., None]
    variants = {
        "host rows sorted per row": (torch.where(planned, ms, torch.iinfo(I64).max).sort(dim=-1).values, md, mc),
        "random rows over the cache": (torch.randint_like(ms, 0, n_host), md, mc),
        "consecutive host rows": (torch.arange(ms.numel(), device=ms.device).reshape(ms.shape) % n_host, md, mc),
    }
    for label, plan in variants.items():
        r = bench_copy(plan, host, dev_buffer, clock)
        copy_rows.append([label, r["rows_per_call"], r["gbps"], r["gbps"] / ceiling])
        results.setdefault("copy_access_patterns", {})[label] = r
    save()
    if args.thp and not smoke:
        thp, note = thp_registered_host(n_host * ITEM)
        results["thp_host"] = note
        print("THP host:", note, flush=True)
        if thp is not None:
            thp_host = thp.view(torch.bfloat16).view(n_host, ITEM // 2)
            thp_plans = {
                "THP host, engine-like plan": (ms, md, mc),
                "THP host, random rows": variants["random rows over the cache"],
            }
            for label, plan in thp_plans.items():
                r = bench_copy(plan, thp_host, dev_buffer, clock)
                copy_rows.append([label, r["rows_per_call"], r["gbps"], r["gbps"] / ceiling])
                results.setdefault("thp_copy", {})[label] = r
            torch.cuda.cudart().cudaHostUnregister(thp.data_ptr())
        save()
    print_table(
        f"copy_planned, {ITEM} B rows, pinned copy_ ceiling {ceiling:.1f} GB/s, launch {results['launch']}",
        ["plan", "rows/call", "GB/s", "ratio"],
        copy_rows,
    )
    # 3. diagnostics (--sweep): copy launch parameters on the same plans, resolve warps at the smallest batch
    if args.sweep:
        for rows_per_program in (4, 8, 16, 32):
            for num_warps in (4, 8):
                for programs_per_sm in (8, 32):
                    params = dict(
                        rows_per_program=rows_per_program, num_warps=num_warps, programs_per_sm=programs_per_sm
                    )
                    r = bench_copy((ms, md, mc), host, dev_buffer, clock, **params)
                    results.setdefault("copy_sweep", []).append(dict(params, **r))
                    print("copy sweep", params, f"{r['gbps']:.1f} GB/s", flush=True)
                    save()
        for nw in (4, 8, 16):
            rs = bench_swap_in(workload(True, min(batches)), host, clock, num_warps=nw, reference_time=False)
            results.setdefault("resolve_warps_sweep", []).append(dict(num_warps=nw, us_per_call=rs["us"]))
            print("resolve sweep: batch", min(batches), "num_warps", nw, f"{rs['us']:.1f} µs/call", flush=True)
            save()
    results["kernel_resources"] = kernel_resources()
    print("compiled kernels:", results["kernel_resources"], flush=True)
    save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
