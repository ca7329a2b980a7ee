"""Swap-in benchmark (H200): µs per call under CUDA-graph replay, beside SGLang's CUDA kernels and the host link.

The workload is the one SGLang's HiSparse figures below were measured on: K = 2048, HOT = 4096, tail 64, 576-byte
rows, 1M-token contexts; speculative S = 4 with 782 unique misses per request (196 fresh per step); single-step at
20 % misses. Every token of every request sits on a random row of a pinned host cache (``--host-gb``, 0.6 and 4.6 GB
by default: large caches cost random reads more). Each measurement:

- captures ``calls`` consecutive calls in one CUDA graph, each on its own top-k (hits from the request's hot set,
  misses never seen before), restores the hot-buffer state and flushes the L2 before every replay (outside the
  timed region), and reports the median replay over ``--reps`` divided by the calls;
- times the call, its resolve alone (no copy) and its copy alone (``copy_planned`` of the plans it wrote), and one
  speculative call followed by 3 shared-index layers replaying its plan into their own host caches;
- reports "x ideal" = time / (unique miss bytes / pinned copy ceiling); the ceiling is the pinned host->device
  ``copy_`` of 1 GiB measured in the same run; the plain-PyTorch reference is timed eagerly, one call.

``--sweep`` then measures launch shapes: the plan copy's rows per program x programs per SM x warps on >= 50k random
rows of the largest cache, and the resolve's chunk sizes, warps and fused copy. ``--smoke`` runs tiny shapes on the
CPU under the Triton interpreter to check the script. Prints tables; writes everything to ``--out`` as JSON.

Goals (docs/benchmarks.md "Goals and gaps"; in the JSON under ``"goals"``, ``--strict`` exits 1 when one is missed):
every line <= 0.8x SGLang's figure, ``copy_planned`` >= 0.85 of the pinned copy ceiling on random rows of the
4.6 GB cache, speculative batch 64 from 4.6 GB <= 650 µs. None is evaluated under ``--smoke``.

    python -m kvplan.benchmarks.swap_in --sweep-resolve --out bench_swap_in.json [--strict]
    python scripts/bench_swap_in.py ...   # the same
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch

from kvplan import reference
from kvplan.benchmarks import goal, not_evaluated, print_goals, strict_exit
from kvplan.calls import swap_in_call
from kvplan.counters import new_counters
from kvplan.kernels.layout import swap_in_workspace_columns
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState


class _Kernels:
    """``kvplan.kernels.hisparse`` and ``kvplan.kernels.copy``, imported on first use: :func:`main` sets
    TRITON_INTERPRET for ``--smoke`` before that (Triton reads it when a kernel is decorated)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


swap_in_module = _Kernels("kvplan.kernels.hisparse")
copy_module = _Kernels("kvplan.kernels.copy")

ITEM = 576
I16, I32, I64 = torch.int16, torch.int32, torch.int64

# SGLang's CUDA HiSparse kernels on the same H200 and workload (CUDA graphs of 100 calls), measured 2026-12-02;
# at 0.6 GB its benchmark's misses were consecutive host rows, at 4.6 GB random ones. µs per call by batch.
SGLANG_US = {
    (0.6, "spec"): {1: 29.7, 8: 94.4, 64: 468},
    (0.6, "single"): {1: 51.3, 8: 80.1, 64: 410},
    (0.6, "spec+3 replays"): {1: 84.2, 8: 357, 64: 2015},
    (4.6, "spec"): {1: 43.5, 8: 167, 64: 1501},
    (4.6, "single"): {1: 56.7, 8: 99.3, 64: 727},
    (4.6, "spec+3 replays"): {1: 102, 8: 557, 64: 5360},
}
REPLAY_LAYERS = 3


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
        del graph
        return statistics.median(times)


def pinned_host(rows: int, layers: int, device: torch.device) -> list[torch.Tensor]:
    """``layers`` host caches of ``rows`` x 576-byte rows (bf16 view), pinned, filled with random bytes."""
    flat = torch.empty(layers * rows * ITEM, dtype=torch.uint8, pin_memory=device.type == "cuda")
    step = 1 << 28
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        chunk.copy_(torch.randint(0, 256, (chunk.numel(),), dtype=torch.uint8, device=device))
    per = rows * ITEM
    return [flat[i * per : (i + 1) * per].view(torch.bfloat16).view(rows, ITEM // 2) for i in range(layers)]


def ceiling_gbps(host: torch.Tensor, device: torch.device, reps: int) -> float:
    """Pinned host -> device ``copy_`` bandwidth of (up to) 1 GiB."""
    if device.type != "cuda":
        return float("nan")
    flat = host.view(-1).view(torch.uint8)
    n = min(flat.numel(), 1 << 30)
    src, dst = flat[:n], torch.empty(n, dtype=torch.uint8, device=device)
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
    *, batch, speculative, steps, top_k, hot, tail, n_host, calls, misses_per_step, context, device, seed
):
    """Engine-like state for ``batch`` requests and ``calls`` consecutive calls' inputs, each with fresh misses.

    ``misses_per_step[s]`` new misses enter at step ``s`` (later steps repeat the earlier ones, as drafts do); the
    rest of each step's top-k are hits from a fixed list of hot tokens, so every call admits the same rows. Every
    token of every request is backed by a random host row.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    steps = steps if speculative else 1
    width = hot + tail
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
    host_locs = torch.randint(0, n_host, (batch, max_len), generator=gen, device=device)
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
        device_buffers=[
            torch.zeros(batch * width, ITEM // 2, dtype=torch.bfloat16, device=device) for _ in range(1 + REPLAY_LAYERS)
        ],
    )


class Bench:
    """One workload's calls, captured and timed in the variants the table reports."""

    def __init__(self, w: dict, hosts: list[torch.Tensor], clock: Clock):
        self.w, self.hosts, self.clock = w, hosts, clock
        calls, batch, top_k = w["tokens"].shape[0], w["tokens"].shape[1], w["tokens"].shape[-1]
        n = w["tokens"][0, 0].numel()
        device = clock.device
        self.saved = {k: v.clone() for k, v in w["state"].items()}
        self.state = HotBufferState(**w["state"])  # no scratch rows: the workload never overflows
        self.plans = (
            torch.zeros(calls, batch, n, dtype=I64, device=device),
            torch.zeros(calls, batch, n, dtype=I32, device=device),
            torch.zeros(calls, batch, dtype=I32, device=device),
        )
        self.miss_plans = [MissPlan(*(p[c] for p in self.plans)) for c in range(calls)]
        self.workspace = torch.zeros(batch, swap_in_workspace_columns(n // top_k, top_k), dtype=I64, device=device)
        self.out = torch.zeros_like(w["tokens"][0])
        self.counters = new_counters(device)
        self.num_real = torch.tensor([batch], dtype=I32, device=device)
        self.calls = calls

    def restore(self) -> None:
        for k, v in self.saved.items():
            self.w["state"][k].copy_(v)

    def _call(self, c: int, **options) -> None:
        w = self.w
        call = swap_in_call(
            w["speculative"], self.state, w["tokens"][c], self.out, w["req_pool_indices"], w["seq_lens"],
            self.hosts[0], w["device_buffers"][0], self.num_real, self.miss_plans[c], self.workspace, self.counters,
        )  # fmt: skip
        swap_in_module._swap_in(call, **options)

    def _replay(self, c: int, layer: int, launch=None) -> None:
        copy_module._copy_planned(
            self.miss_plans[c],
            self.hosts[layer],
            self.w["device_buffers"][layer],
            num_real_reqs=self.num_real,
            counters=self.counters,
            launch=launch,
        )

    def call_us(self, **options) -> float:
        return self.clock.time_ms(lambda: [self._call(c, **options) for c in range(self.calls)], self.restore) * (
            1e3 / self.calls
        )

    def copy_us(self, launch=None) -> float:
        """The plans' copy alone (run ``call_us`` first: it writes them)."""
        return self.clock.time_ms(lambda: [self._replay(c, 0, launch) for c in range(self.calls)]) * 1e3 / self.calls

    def with_replays_us(self) -> float:
        def body():
            for c in range(self.calls):
                self._call(c)
                for layer in range(1, 1 + REPLAY_LAYERS):
                    self._replay(c, layer)

        return self.clock.time_ms(body, self.restore) * 1e3 / self.calls

    def reference_ms(self) -> float:
        self.restore()
        fn = reference.swap_in_spec if self.w["speculative"] else reference.swap_in
        if self.clock.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(
            self.state,
            self.w["tokens"][0],
            self.out,
            self.w["req_pool_indices"],
            self.w["seq_lens"],
            self.hosts[0],
            self.w["device_buffers"][0],
            num_real_reqs=self.num_real,
        )
        if self.clock.cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1e3
        self.restore()
        return elapsed

    def admitted_per_row(self) -> float:
        return self.plans[2].float().mean().item()


# ---------------------------------------------------------------------------------------------------------------------
# Compiling ahead: every launch variant the run times, compiled by parallel processes into the shared Triton cache


def _warm(speculative: bool, launch, copy: bool) -> str:
    """Compile one launch variant (the workload's geometry, one tiny call): the timed runs then hit the cache."""
    device = torch.device("cuda")
    w = make_workload(batch=1, speculative=speculative, steps=4, top_k=2048, hot=4096, tail=64, n_host=1 << 16,
                      calls=1, misses_per_step=[196, 196, 195, 195] if speculative else [410], context=1 << 14,
                      device=device, seed=0)
    host = torch.zeros(1 << 16, ITEM // 2, dtype=torch.bfloat16).pin_memory()
    Bench(w, [host] * (1 + REPLAY_LAYERS), Clock(device, 1))._call(0, launch=launch, copy=copy)
    torch.cuda.synchronize()
    return repr(launch)


def warm_compile(variants: list[tuple], workers: int = 8) -> None:
    """Compile ``(speculative, launch, copy)`` variants in ``workers`` processes (compiling is CPU-bound)."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for future in [pool.submit(_warm, *v) for v in variants]:
            future.result()
    print(f"compiled {len(variants)} launch variants in {time.perf_counter() - t0:.1f} s", flush=True)


RESOLVE_SWEEP = [(64, 8), (256, 8), (256, 4), (1024, 8)]  # (occurrences per program, warps)


# ---------------------------------------------------------------------------------------------------------------------
# Output


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for c in columns:
            table.add_column(c, justify="right")
        for r in rows:
            table.add_row(*[_fmt(v) for v in r])
        Console(width=220).print(table)
    except ImportError:
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(_fmt(v) for v in r))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


# ---------------------------------------------------------------------------------------------------------------------
# Goals (docs/benchmarks.md "Goals and gaps")

GOAL_VS_SGLANG = 0.8
GOAL_COPY_RATIO = 0.85
GOAL_COPY_HOST_GB = 4.6
GOAL_SPEC64_US = 650.0


def evaluate_goals(result: dict) -> list[dict]:
    """The goals over ``result`` (the JSON :func:`main` writes): one per line with an SGLang figure (<= 0.8x its µs),
    ``copy_planned`` of the default launch from the 4.6 GB cache (>= 0.85 of the pinned copy ceiling) and speculative
    batch 64 from 4.6 GB (<= 650 µs). Lines or caches the run did not measure are reported as not evaluated;
    ``--smoke`` (CPU, interpreter) evaluates none."""
    copy_goal = (f"copy_planned >= {GOAL_COPY_RATIO} of the pinned copy ceiling, random rows of the "
                 f"{GOAL_COPY_HOST_GB} GB cache")
    spec_goal = f"speculative batch 64 from {GOAL_COPY_HOST_GB} GB <= {GOAL_SPEC64_US:.0f} µs"
    lines = [(gb, call, batch) for (gb, call), by_batch in SGLANG_US.items() for batch in by_batch]
    line_goals = [f"{call} {gb} GB batch {batch}: <= {GOAL_VS_SGLANG}x SGLang" for gb, call, batch in lines]
    if result.get("smoke"):
        return not_evaluated([*line_goals, copy_goal, spec_goal], "--smoke: CPU timings under the interpreter")
    runs = {(r["host_gb"], r["call"], r["batch"]): r for r in result.get("runs", [])}
    goals = []
    for (gb, call, batch), text in zip(lines, line_goals):
        run = runs.get((gb, call, batch))
        if run is None:
            goals.append(goal(text, None, None, "line not measured (--host-gb / --batches)"))
            continue
        sglang = SGLANG_US[(gb, call)][batch]
        goals.append(goal(text, f"{run['us_per_call']:.1f} µs = {run['us_per_call'] / sglang:.2f}x SGLang's {sglang}",
                          run["us_per_call"] <= GOAL_VS_SGLANG * sglang))
    copies = [c for c in result.get("copy_planned", [])
              if c["label"] == "default launch" and c.get("host_gb") == GOAL_COPY_HOST_GB]
    if copies:
        c = copies[0]
        goals.append(goal(copy_goal, f"{c['ratio']:.2f} ({c['gbps']:.1f} GB/s, {c['rows_per_call']:.0f} rows per call)",
                          c["ratio"] >= GOAL_COPY_RATIO))
    else:
        goals.append(goal(copy_goal, None, None, f"no copy_planned from the {GOAL_COPY_HOST_GB} GB cache (--host-gb)"))
    run = runs.get((GOAL_COPY_HOST_GB, "spec", 64))
    if run is None:
        goals.append(goal(spec_goal, None, None, "line not measured (--host-gb / --batches)"))
    else:
        goals.append(goal(spec_goal, f"{run['us_per_call']:.0f} µs", run["us_per_call"] <= GOAL_SPEC64_US))
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_swap_in.json", help="JSON results file")
    parser.add_argument("--host-gb", default="0.6,4.6", help="pinned host cache sizes (GB), comma-separated")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--reps", type=int, default=10, help="graph replays per measurement (median)")
    parser.add_argument("--sweep", action="store_true", help="then sweep copy and resolve launch shapes")
    parser.add_argument("--sweep-resolve", action="store_true", help="then sweep resolve launch shapes only")
    parser.add_argument("--no-reference", action="store_true", help="skip the eager reference timings")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    parser.add_argument("--strict", action="store_true", help="exit status 1 when a goal is missed")
    args = parser.parse_args(argv)

    smoke = args.smoke
    if smoke:  # before the first kernel import (swap_in_module / copy_module import on first use)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        print("bench_swap_in: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    K, HOT, TAIL, S = (8, 16, 4, 4) if smoke else (2048, 4096, 64, 4)
    spec_misses = [1, 1, 1, 1] if smoke else [196, 196, 195, 195]  # 782 unique per request
    single_misses = [2] if smoke else [410]  # 20 % of K
    context = 1000 if smoke else 1 << 20
    batches = [int(b) for b in args.batches.split(",")]
    clock = Clock(device, 2 if smoke else args.reps)
    results: dict = {
        "device": torch.cuda.get_device_name() if not smoke else "cpu (interpreter)",
        "torch": torch.__version__,
        "item_bytes": ITEM,
        "workload": dict(top_k=K, hot=HOT, tail=TAIL, steps=S, context=context, spec_misses=spec_misses,
                         single_misses=single_misses),
        "launch": dict(resolve=repr(swap_in_module.RESOLVE_LAUNCH), copy=repr(copy_module.COPY_LAUNCH)),
        "sglang_us": {f"{gb} GB {kind}": v for (gb, kind), v in SGLANG_US.items()},
        "runs": [],
        "smoke": smoke,
    }

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    rows, resolve_rows = [], []
    largest_plans = None
    if not smoke:
        default = swap_in_module.RESOLVE_LAUNCH
        variants = [(spec, default, copy) for spec in (True, False) for copy in (True, False)]
        if args.sweep or args.sweep_resolve:
            variants += [
                (spec, swap_in_module.ResolveLaunch(occ_chunk=occ, num_warps=warps), True)
                for spec in (True, False)
                for occ, warps in RESOLVE_SWEEP
            ]
        warm_compile(variants)
    for host_gb in _floats(args.host_gb):
        n_host = 4000 if smoke else int(host_gb * 1e9) // ITEM
        t0 = time.perf_counter()
        hosts = pinned_host(n_host, 1 + REPLAY_LAYERS, device)
        ceiling = ceiling_gbps(hosts[0], device, 10)
        pinned_s = time.perf_counter() - t0
        print(f"host caches {1 + REPLAY_LAYERS} x {n_host * ITEM / 1e9:.2f} GB pinned ({pinned_s:.1f} s);"
              f" pinned copy_ ceiling {ceiling:.1f} GB/s", flush=True)
        results.setdefault("ceiling_gbps", {})[str(host_gb)] = ceiling
        for kind in ("spec", "single"):
            for batch in batches:
                w = make_workload(
                    batch=batch,
                    speculative=kind == "spec",
                    steps=S,
                    top_k=K,
                    hot=HOT,
                    tail=TAIL,
                    n_host=n_host,
                    calls=2 if smoke else max(4, min(32, 256 // batch)),
                    misses_per_step=spec_misses if kind == "spec" else single_misses,
                    context=context,
                    device=device,
                    seed=batch,
                )
                bench = Bench(w, hosts, clock)
                call = bench.call_us()
                resolve = bench.call_us(copy=False)
                bench.call_us()  # rewrite the plans (the resolve-only run left them as its own)
                copy = bench.copy_us()
                lines = [(kind, call)]
                if kind == "spec":
                    lines.append(("spec+3 replays", bench.with_replays_us()))
                ref_ms = float("nan") if args.no_reference else bench.reference_ms()
                unique_bytes = batch * w["unique"] * ITEM
                for label, us in lines:
                    moved = unique_bytes * (1 + REPLAY_LAYERS if label.endswith("replays") else 1)
                    ideal_us = moved / (ceiling * 1e3)
                    sglang = SGLANG_US.get((host_gb, label), {}).get(batch, float("nan"))
                    entry = dict(
                        call=label,
                        host_gb=host_gb,
                        batch=batch,
                        calls_per_graph=bench.calls,
                        unique_misses_per_row=w["unique"],
                        admitted_per_row=bench.admitted_per_row(),
                        us_per_call=us,
                        resolve_us=resolve,
                        copy_us=copy,
                        miss_bytes=moved,
                        gbps=moved / (us * 1e3),
                        ceiling_gbps=ceiling,
                        x_ideal=us / ideal_us,
                        sglang_us=sglang,
                        vs_sglang=us / sglang,
                        reference_ms=ref_ms if label == kind else float("nan"),
                    )
                    results["runs"].append(entry)
                    print(entry, flush=True)
                    rows.append(
                        [label, host_gb, batch, us, resolve, copy, moved / 1e6, entry["gbps"],
                         entry["gbps"] / ceiling, entry["x_ideal"], sglang, entry["vs_sglang"], entry["reference_ms"]]
                    )
                if kind == "spec" and batch == max(batches):
                    largest_plans = (bench, hosts, ceiling, host_gb)
                if (args.sweep or args.sweep_resolve) and host_gb == min(_floats(args.host_gb)):
                    for occ_chunk, warps in RESOLVE_SWEEP:
                        launch = swap_in_module.ResolveLaunch(occ_chunk=occ_chunk, num_warps=warps)
                        us = bench.call_us(launch=launch)
                        entry = dict(call=kind, batch=batch, launch=repr(launch), us_per_call=us)
                        results.setdefault("resolve_sweep", []).append(entry)
                        resolve_rows.append([kind, batch, occ_chunk, warps, us])
                        print(entry, flush=True)
                save()
        if host_gb != max(_floats(args.host_gb)):
            del hosts
    print_table(
        f"kvplan swap-in vs SGLang CUDA, K={K}, HOT={HOT}, tail={TAIL}, {ITEM} B rows, µs per call (CUDA graphs)",
        ["call", "host GB", "batch", "kvplan µs", "resolve µs", "copy µs", "miss MB", "GB/s", "of ceiling", "x ideal",
         "SGLang µs", "kvplan/SGLang", "reference ms"],
        rows,
    )

    # copy_planned of >= 50k random rows (the largest speculative batch's plans) from the largest host cache
    bench, hosts, ceiling, plans_host_gb = largest_plans
    rows_per_call = bench.plans[2].sum().item() / bench.calls
    copy_rows = []

    def copy_row(label, launch=None):
        us = bench.copy_us(launch)
        gbps = rows_per_call * ITEM / (us * 1e3)
        entry = dict(label=label, launch=repr(launch or copy_module.COPY_LAUNCH), rows_per_call=rows_per_call,
                     us=us, gbps=gbps, ratio=gbps / ceiling, host_gb=plans_host_gb)
        results.setdefault("copy_planned", []).append(entry)
        copy_rows.append([label, entry["launch"], rows_per_call, us, gbps, gbps / ceiling])
        print(entry, flush=True)
        save()

    copy_row("default launch")
    if args.sweep:
        for warps in (1, 2, 4, 8):
            for rows_per_program in (1, 2, 4, 8, 16):
                for per_sm in (1, 2, 4, 8, 16):
                    launch = copy_module.CopyLaunch(rows_per_program=rows_per_program, programs_per_sm=per_sm,
                                                    num_warps=warps)
                    copy_row("sweep", launch)
    print_table(f"copy_planned, {ITEM} B random rows, {bench.hosts[0].numel() * 2 / 1e9:.1f} GB host cache, pinned "
                f"copy_ ceiling {ceiling:.1f} GB/s", ["plan", "launch", "rows/call", "µs", "GB/s", "of ceiling"],
                sorted(copy_rows, key=lambda r: -r[4])[:12])

    if resolve_rows:
        print_table(f"resolve launch sweep, {min(_floats(args.host_gb))} GB host (µs per call, copy fused)",
                    ["call", "batch", "occ_chunk", "warps", "µs"], resolve_rows)
    results["goals"] = evaluate_goals(results)
    print_goals("swap_in", results["goals"])
    save()
    print(f"wrote {args.out}")
    return strict_exit(results["goals"], args.strict)


if __name__ == "__main__":
    raise SystemExit(main())
