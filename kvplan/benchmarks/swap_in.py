"""Swap-in benchmark: µs per call under CUDA-graph replay, beside SGLang's CUDA kernels and the host link.

Four workloads, built exactly as SGLang's HiSparse kernels were measured beside kvplan (identical state, tokens,
host rows and device rows in one process), so the figures compare with SGLang's below:

- common: K = 2048, HOT = 4096, tail 64, 4096 scratch rows per request, S = 4, 576-byte rows, seq_len 1,048,576;
  hot slots hold tokens 0..4095; each draft step has 1852 hits, ``roll(arange(4096), 137*s)[:1852]``, and 196
  misses; steps 2 and 3 each repeat one miss of steps 0 and 1 (782 unique misses per request); every call adds 800
  to the miss tokens, so misses are always fresh. Single-step: hits are tokens 0..1637, plus 410 fresh misses.
- **A**: host row of token ``t`` is ``t`` for every request (1,048,576 rows, 0.56 GiB): every request's misses are
  the same consecutive host rows, so a batch is served partly from L2.
- **B**: 8,000,000 host rows (4.3 GiB); every request gets its own random host row per token; each of the 3 replays
  reads its own 4.3 GiB host cache.
- **C**: B's rows confined to one 512 MiB window of each host cache (as a per-request host arena would give).
- **P**: B's host caches laid out as a paged host pool lays contexts out (the layout real engines have): request
  ``b``'s token ``t`` at host row ``page[b, t // 64] * 64 + t % 64``, ``page[b, :]`` drawn uniformly (with
  replacement) from the cache's 125,000 pages of 64 rows; each replay layer reads its own cache of the same layout.

**MHA** lines (call ``mha``): the block-selection swap-in of K and V caches (``kvplan.kernels.swap_in_blocks``,
docs/kernels.md §2a; MiniMax M3's selection in SGLang 0.5.23): 16 blocks of 128 tokens (4 in ``--smoke``), of which
the first 13 hold hot tokens and the last 3 are fresh blocks (384 misses per request), on the workload's host layout;
K rows from the first host cache and V rows from the second, both 576 bytes. Their GB/s and "of link" count the bytes
of K and V (two rows per miss), beside the same pinned ``copy_`` ceiling; with the largest batch the copy of their
plans (K and V together) goes to the plan-copy table too.

Each measurement captures ``calls`` consecutive calls in one CUDA graph, restores the hot-buffer state and flushes
the L2 before every replay (outside the timed region), and reports the median replay over ``--reps`` divided by the
calls. Per line: the call, its resolve alone (no copy), its copy alone (the ordered copy of the plans it wrote, as a
replay runs it), one speculative call followed by 3 shared-index layers replaying its plan into their own host
caches, "x ideal" = time / (unique miss bytes / pinned copy ceiling), the plain-PyTorch reference (eager, one call),
and SGLang's figure. The pinned host->device ``copy_`` of 1 GiB is the ceiling, measured in the same run.
On B and C above the flat batches, sharing's cost: the call with and without shared host rows, three pairs timed
back to back, compared by median (``sharing_cost``). ``--sweep`` then times resolve and copy launch shapes.
``--smoke`` runs tiny shapes on the CPU under the Triton interpreter to check the script.

SGLang's figures and the goals are per GPU, in ``peers.json`` beside this file (the H100's: every cell at most 0.9x
SGLang's, P at batch 64 0.95x, the resolve alone <= 15 µs speculative and <= 12 µs single-step, the plan copy of P
>= 0.88 of the link; the H200's: the earlier per-cell µs, 0.95x SGLang, the plan copy from B and C, sharing's cost).
A GPU not in that file is reported as not judged, never as met. ``--strict`` exits 1 when a goal is missed or could
not be judged. Each line also gives the launch planner's decision (``kvplan.kernels.planner``) and the call's
launches one by one (``split``: device µs per launch, from ``torch.profiler`` over the same calls run eagerly);
``--triton-resolve`` adds the Triton resolve alone beside the one the planner chose.

    python -m kvplan.benchmarks.swap_in --out bench_swap_in.json [--strict]   # or kvplan bench swap_in
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvplan import reference
from kvplan.benchmarks import goal, not_evaluated, print_goals, strict_exit
from kvplan.calls import swap_in_blocks_call, swap_in_call
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import check_swap_in
from kvplan.workspace import swap_in_workspace_columns


class _Kernels:
    """``kvplan.kernels.hisparse``, ``kvplan.kernels.copy`` and the rest, imported on first use: :func:`main` sets
    TRITON_INTERPRET for ``--smoke`` before that (Triton reads it when a kernel is decorated)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


swap_in_module = _Kernels("kvplan.kernels.hisparse")
copy_module = _Kernels("kvplan.kernels.copy")
copy_launch_module = _Kernels("kvplan.kernels.plan_copy.launch")
planner = _Kernels("kvplan.kernels.planner")

ITEM = 576
I16, I32, I64 = torch.int16, torch.int32, torch.int64
REPLAY_LAYERS = 3
WORKLOADS = ("A", "B", "C", "P")
PAGE_ROWS = 64  # P: consecutive host rows per page
PEERS = json.loads((Path(__file__).with_name("peers.json")).read_text())  # per GPU: SGLang's figures and the goals


def peer_table(device_name: str) -> tuple[str | None, dict]:
    """The ``peers.json`` entry of the GPU ``device_name`` names (``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``), or
    ``(None, {})`` for a GPU without figures."""
    for gpu, table in PEERS.items():
        if not gpu.startswith("_") and gpu in device_name:
            return gpu, table
    return None, {}


def sglang_us(table: dict, workload: str, call: str, batch: int) -> float:
    return table.get("sglang_us", {}).get(f"{workload} {call}", {}).get(str(batch), float("nan"))


# The platform, measured with plain CUDA (fresh rows, L2 flushed): 50,048 random 576-byte rows, pinned copy ceiling
# 55.3 GB/s. What limits random reads of a large host cache is the GPU's address translation of host memory.
PLATFORM = [
    ("random rows from a window of <= 512 MiB", 48.9, 0.88),
    ("random rows from a window of 1 GiB", 43.5, 0.79),
    ("random rows from a window of 2 GiB", 25.0, 0.45),
    ("random rows from a window of 4 GiB", 19.4, 0.35),
    ("random rows from a window of 8 GiB", 17.2, 0.31),
    ("4 GiB, sorted by address, dynamic dispatch", 34.0, 0.61),
    ("8 GiB, sorted by address, dynamic dispatch", 28.2, 0.51),
    ("7150 random 4 KiB pages over 8 GiB, 7 rows each", 48.7, 0.88),
]


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


_LAUNCH_NAMES = {
    "_prep_kernel": "prep",
    "_insert_kernel": "insert",
    "_place_kernel": "place",
    "_sort_plan_kernel": "sort+share",
    "_resolve_row_kernel": "row resolve",
    "_copy_entries_kernel": "copy",
    "_copy_host_reads_kernel": "copy",
    "_copy_shared_entries_kernel": "copy shared",
    "_copy_reads_then_shared_kernel": "copy",
    "kvplan_resolve": "on-chip resolve",
}


def split_text(split: list[tuple[str, float]]) -> str:
    """``prep 3.1 + insert 5.0 + ...`` (µs per launch)."""
    return " + ".join(f"{name} {us:.3g}" for name, us in split)


def pinned_hosts(rows: int, layers: int, device: torch.device) -> list[torch.Tensor]:
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
# Workloads


class Shape:
    """The workload's sizes: production (docs/kernels.md §7) or, for ``--smoke``, tiny ones with the same structure."""

    def __init__(self, smoke: bool):
        self.top_k, self.hot, self.tail, self.steps = (8, 16, 4, 4) if smoke else (2048, 4096, 64, 4)
        self.scratch = 8 if smoke else 4096
        self.spec_misses = 2 if smoke else 196  # per draft step (steps 2 and 3 repeat one of steps 0 and 1)
        self.single_misses = 2 if smoke else 410
        self.single_hits = self.top_k - self.single_misses  # tokens 0 .. single_hits - 1
        self.call_shift = 8 if smoke else 800  # added to the miss tokens by every call
        # the MHA lines: blocks of block_tokens tokens, the last mha_miss_blocks of them fresh (misses)
        self.block_tokens = 4 if smoke else 128
        self.mha_blocks = self.top_k // self.block_tokens
        self.mha_miss_blocks = 1 if smoke else 3
        self.seq_len = 1000 if smoke else 1 << 20
        self.host_rows = {"A": self.seq_len, "B": 4000 if smoke else 8_000_000}
        self.window_rows = 500 if smoke else (512 << 20) // ITEM  # C: one 512 MiB window
        self.page_rows = 4 if smoke else PAGE_ROWS  # P: rows per page

    @property
    def unique_spec(self) -> int:
        return 4 * self.spec_misses - 2


def step_tokens(shape: Shape, speculative: bool, call: int, device: torch.device) -> torch.Tensor:
    """One request's top-k of call ``call``: ``[S, K]`` (speculative) or ``[K]``, as SGLang's HiSparse benchmark
    builds them."""
    base = shape.hot + call * shape.call_shift  # fresh tokens, never in the hot set
    if not speculative:
        hits = torch.arange(shape.single_hits)
        return torch.cat([hits, base + torch.arange(shape.single_misses)]).to(I32).to(device)
    m, k = shape.spec_misses, shape.top_k
    fresh = base + torch.arange(shape.unique_spec)
    misses = [
        fresh[:m],
        fresh[m : 2 * m],
        torch.cat([fresh[2 * m : 3 * m - 1], fresh[:1]]),  # step 2 repeats one miss of step 0
        torch.cat([fresh[3 * m - 1 : 4 * m - 2], fresh[m : m + 1]]),  # step 3 repeats one of step 1
    ]
    rows = []
    for s in range(shape.steps):
        hits = torch.roll(torch.arange(shape.hot), 137 * s)[: k - m]
        rows.append(torch.cat([hits, misses[s]]))
    return torch.stack(rows).to(I32).to(device)


def make_workload(workload: str, *, batch: int, speculative: bool, calls: int, shape: Shape, device, seed: int):
    """State, per-call top-k and buffers of ``batch`` identical requests (request rows permuted over batch rows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    steps = shape.steps if speculative else 1
    width = shape.hot + shape.tail
    max_len = shape.seq_len + shape.steps
    buffer_tokens = torch.full((batch, width), -1, dtype=I32, device=device)
    buffer_tokens[:, : shape.hot] = torch.arange(shape.hot, dtype=I32, device=device)
    buffer_tokens[:, shape.hot] = shape.seq_len - 1  # the newest token in the tail
    rows_per_request = width + shape.scratch  # each request's hot and tail rows, then its scratch rows
    first = torch.arange(batch, dtype=I32, device=device)[:, None] * rows_per_request
    if workload == "A":
        host_locs = torch.arange(max_len, dtype=I64, device=device).expand(batch, max_len).contiguous()
    elif workload == "P":
        rows = shape.page_rows
        pages = torch.randint(0, shape.host_rows["B"] // rows, (batch, -(-max_len // rows)), generator=gen,
                              device=device)  # fmt: skip
        host_locs = (pages[:, :, None] * rows + torch.arange(rows, device=device)).reshape(batch, -1)[:, :max_len]
        host_locs = host_locs.contiguous()
    else:
        span = shape.host_rows["B"] if workload == "B" else shape.window_rows
        start = 0 if workload == "B" else int(torch.randint(0, shape.host_rows["B"] - span, (1,), generator=gen,
                                                             device=device))  # fmt: skip
        host_locs = start + torch.randint(0, span, (batch, max_len), generator=gen, device=device)
    state = HotBufferState(
        device_buffer_tokens=buffer_tokens,
        device_buffer_locs=first + torch.arange(width, dtype=I32, device=device),
        lru_slots=torch.arange(shape.hot, dtype=I16, device=device).expand(batch, shape.hot).contiguous(),
        host_cache_locs=host_locs,
        scratch_locs=first + width + torch.arange(shape.scratch, dtype=I32, device=device) if speculative else None,
    )
    per_call = [step_tokens(shape, speculative, c, device) for c in range(calls)]  # every request the same
    tokens = torch.stack([t.expand(batch, *t.shape) for t in per_call])
    return dict(
        workload=workload,
        speculative=speculative,
        tokens=tokens.contiguous(),
        unique=shape.unique_spec if speculative else shape.single_misses,
        state=state,
        seq_lens=torch.full((batch * steps,), shape.seq_len, dtype=I32, device=device),
        req_pool_indices=torch.randperm(batch, generator=gen, device=device).to(I32),
        device_buffers=[
            torch.zeros(batch * rows_per_request, ITEM // 2, dtype=torch.bfloat16, device=device)
            for _ in range(1 + REPLAY_LAYERS)
        ],
    )


def make_mha_workload(workload: str, *, batch: int, calls: int, shape: Shape, device, seed: int) -> dict:
    """The single-step workload's state and host layout with a block selection per call: ``mha_blocks`` blocks of
    ``block_tokens``, the first ones hot (tokens below HOT), the last ``mha_miss_blocks`` fresh each call."""
    w = make_workload(workload, batch=batch, speculative=False, calls=calls, shape=shape, device=device, seed=seed)
    size, hits = shape.block_tokens, shape.mha_blocks - shape.mha_miss_blocks
    per_call = []
    for c in range(calls):
        first_fresh = -(-(shape.hot + c * shape.call_shift) // size)  # a block past the hot tokens, fresh each call
        row = torch.cat([torch.arange(hits), first_fresh + torch.arange(shape.mha_miss_blocks)])
        per_call.append(row.to(I32).to(device).expand(batch, -1))
    w.update(tokens=torch.stack(per_call).contiguous(), unique=shape.mha_miss_blocks * size, mha=True,
             block=size, kv=2)  # fmt: skip
    return w


class Bench:
    """One workload's calls, captured and timed in the variants the table reports."""

    def __init__(self, w: dict, hosts: list[torch.Tensor], clock: Clock):
        self.w, self.hosts, self.clock = w, hosts, clock
        calls, batch, top_k = w["tokens"].shape[0], w["tokens"].shape[1], w["tokens"].shape[-1]
        n = w["tokens"][0, 0].numel()
        device = clock.device
        state = w["state"]
        self.state = state
        self.saved = {"device_buffer_tokens": state.device_buffer_tokens.clone(), "lru_slots": state.lru_slots.clone()}
        self.plans = (
            torch.zeros(calls, batch, n, dtype=I64, device=device),
            torch.zeros(calls, batch, n, dtype=I32, device=device),
            torch.zeros(calls, batch, dtype=I32, device=device),
        )
        self.miss_plans = [MissPlan(*(p[c] for p in self.plans)) for c in range(calls)]
        # one workspace per call: it holds that call's record of shared host rows, which the replays of its plan read
        columns = swap_in_workspace_columns(n // top_k, top_k)
        self.workspaces = [torch.zeros(batch, columns, dtype=I64, device=device) for _ in range(calls)]
        self.work_counter = torch.zeros(2, dtype=I32, device=device)  # the copy's optional counter (left zero)
        self.out = torch.zeros_like(w["tokens"][0])
        self.mha = bool(w.get("mha"))
        if self.mha:  # the block selection: N = blocks * block tokens, one single-step plan row of N entries
            n = w["tokens"].shape[-1] * w["block"]
            self.plans = tuple(p.new_zeros((calls, batch, n) if p.dim() == 3 else (calls, batch)) for p in self.plans)
            self.miss_plans = [MissPlan(*(p[c] for p in self.plans)) for c in range(calls)]
            columns = swap_in_workspace_columns(1, n)
            self.workspaces = [torch.zeros(batch, columns, dtype=I64, device=device) for _ in range(calls)]
            self.out = torch.zeros(batch, n, dtype=I32, device=device)
        self.counters = new_counters(device)
        self.num_real = torch.tensor([batch], dtype=I32, device=device)
        self.calls = calls

    def decision(self):
        """The launch planner's decision for this workload's calls (what ``_call`` runs)."""
        call = self._swap_in_call(0)
        return planner.plan_swap_in(call, check_swap_in(call), swap_in_module.RESOLVE_LAUNCH, call.plan.src.stride(0))

    def restore(self) -> None:
        self.state.device_buffer_tokens.copy_(self.saved["device_buffer_tokens"])
        self.state.lru_slots.copy_(self.saved["lru_slots"])

    def _swap_in_call(self, c: int):
        """Call ``c``'s arguments as one ``SwapInCall`` (its top-k, plan and workspace)."""
        w = self.w
        if self.mha:  # K rows from the first host cache, V rows from the second
            return swap_in_blocks_call(
                self.state, w["tokens"][c], self.out, w["req_pool_indices"], w["seq_lens"], self.hosts[0],
                self.hosts[1], w["device_buffers"][0], w["device_buffers"][1], w["block"], self.num_real,
                self.miss_plans[c], self.workspaces[c], self.counters,
            )  # fmt: skip
        return swap_in_call(
            w["speculative"], self.state, w["tokens"][c], self.out, w["req_pool_indices"], w["seq_lens"],
            self.hosts[0], w["device_buffers"][0], self.num_real, self.miss_plans[c], self.workspaces[c], self.counters,
        )  # fmt: skip

    def _call(self, c: int, **options) -> None:
        swap_in_module.run_swap_in(self._swap_in_call(c), **options)

    def _replay(self, c: int, layer: int, launch=None, dispatch=False) -> None:
        # (the MHA lines: K rows of this layer, V rows of the next one, as the swap-in reads them)
        values = (
            dict(host_cache_v=self.hosts[layer + 1], device_buffer_v=self.w["device_buffers"][layer + 1])
            if self.mha
            else {}
        )
        copy_module.run_copy(
            self.miss_plans[c],
            self.hosts[layer],
            self.w["device_buffers"][layer],
            num_real_reqs=self.num_real,
            counters=self.counters,
            dispatch=self.work_counter if dispatch else None,
            launch=launch,
            workspace=self.workspaces[c],  # as pool.replay passes the swap-in's
            **values,
        )

    def call_us(self, **options) -> float:
        return self.clock.time_ms(lambda: [self._call(c, **options) for c in range(self.calls)], self.restore) * (
            1e3 / self.calls
        )

    def copy_us(self, launch=None, dispatch=False) -> float:
        """The plans' copy alone (run ``call_us`` first: it writes them)."""
        body = lambda: [self._replay(c, 0, launch, dispatch) for c in range(self.calls)]  # noqa: E731
        return self.clock.time_ms(body) * 1e3 / self.calls

    def with_replays_us(self) -> float:
        def body():
            for c in range(self.calls):
                self._call(c)
                for layer in range(1, 1 + REPLAY_LAYERS):
                    self._replay(c, layer)

        return self.clock.time_ms(body, self.restore) * 1e3 / self.calls

    def reference_ms(self) -> float:
        self.restore()
        w = self.w
        if self.clock.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.mha:
            reference.swap_in_blocks(self.state, w["tokens"][0], self.out, w["req_pool_indices"], w["seq_lens"],
                                     self.hosts[0], self.hosts[1], w["device_buffers"][0], w["device_buffers"][1],
                                     sparse_block_size=w["block"], num_real_reqs=self.num_real)  # fmt: skip
        else:
            reference.swap_in(self.state, w["tokens"][0], self.out, w["req_pool_indices"], w["seq_lens"],
                              self.hosts[0], w["device_buffers"][0], num_real_reqs=self.num_real)  # fmt: skip
        if self.clock.cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) * 1e3
        self.restore()
        return elapsed

    def launch_split(self, **options) -> list[tuple[str, float]]:
        """Device µs of each launch of one call, in launch order: the calls run eagerly under ``torch.profiler``
        (CUPTI kernel records), averaged over the calls. Empty on the CPU."""
        if not self.clock.cuda:
            return []
        from torch.profiler import ProfilerActivity, profile

        self.restore()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in range(self.calls):
                self.clock.flush.zero_()  # as the timed replays: host rows and tables from memory, not L2
                self._call(c, **options)
            torch.cuda.synchronize()
        kernels = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name in _LAUNCH_NAMES),
            key=lambda e: e.time_range.start,
        )
        per_call = len(kernels) // self.calls
        if per_call == 0:
            return []
        split = []
        for i in range(per_call):
            times = [kernels[c * per_call + i].time_range.elapsed_us() for c in range(self.calls)]
            split.append((_LAUNCH_NAMES[kernels[i].name], statistics.median(times)))
        return split

    def plan_rows(self) -> float:
        """Plan entries per call (what the copy moves)."""
        return self.plans[2].sum().item() / self.calls


SHARING_PAIRS = 3  # timings with and without shared host rows, alternated, that sharing's cost compares


def sharing_cost(bench: Bench, pairs: int = SHARING_PAIRS) -> dict:
    """What sharing host rows costs ``bench``'s calls: the call with it and without it (``shared_rows=False``),
    alternated ``pairs`` times and compared by median. Two single timings minutes apart drift by more than the 2 %
    this judges (the same call without sharing: 79.4 µs in one H200 run, 72-74 in another), so each pair is taken
    back to back. Ends with a default call, so that the plans and records are the default call's again."""
    without = swap_in_module.ResolveLaunch(shared_rows=False)
    shared, unshared = [], []
    for _ in range(pairs):
        shared.append(bench.call_us())
        unshared.append(bench.call_us(launch=without))
    bench.call_us()
    us, unshared_us = statistics.median(shared), statistics.median(unshared)
    return dict(us=us, unshared_us=unshared_us, cost=us / unshared_us - 1, shared_runs=shared, unshared_runs=unshared)


# ---------------------------------------------------------------------------------------------------------------------
# Compiling ahead: every launch variant the run times, compiled by parallel processes into the shared Triton cache


def _warm(speculative: bool, batch: int, launch, copy: bool) -> str:
    """Compile one launch variant (the production geometry, one small call): the timed runs then hit the cache."""
    device = torch.device("cuda")
    shape = Shape(smoke=False)
    shape.host_rows = {"A": shape.seq_len, "B": 1 << 16}
    shape.window_rows = 1 << 12
    w = make_workload("B", batch=batch, speculative=speculative, calls=1, shape=shape, device=device, seed=0)
    host = torch.zeros(1 << 16, ITEM // 2, dtype=torch.bfloat16).pin_memory()
    Bench(w, [host] * (1 + REPLAY_LAYERS), Clock(device, 1))._call(0, launch=launch, copy=copy)
    torch.cuda.synchronize()
    return repr(launch)


def warm_compile(variants: list[tuple], workers: int = 8) -> None:
    """Compile ``(speculative, batch, launch, copy)`` variants in ``workers`` processes (compiling is CPU-bound)."""
    import concurrent.futures
    import multiprocessing

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for future in [pool.submit(_warm, *v) for v in variants]:
            future.result()
    print(f"compiled {len(variants)} launch variants in {time.perf_counter() - t0:.1f} s", flush=True)


# (row_occ_chunk, row_hot_chunk, warps) of one program per row
ROW_SWEEP = [(512, 512, 16), (1024, 512, 16), (512, 1024, 16), (1024, 1024, 32)]
CROSSOVER_BATCHES = (2, 4, 8, 16, 32, 64, 128, 256)


def crossover(wl: str, hosts: list[torch.Tensor], clock: Clock, shape: Shape) -> list[list]:
    """Whole calls by path at each of ``CROSSOVER_BATCHES``: the flat copy (plan in miss order) and the sorted plan
    with the split resolve, and the sorted plan with one program per row; what ``FLAT_COPY_MAX_BATCH`` and
    ``PER_ROW_MIN_BATCH`` are chosen from."""
    paths = {
        "flat": swap_in_module.ResolveLaunch(sorted_plan=False, per_row=False),
        "split, sorted": swap_in_module.ResolveLaunch(sorted_plan=True, per_row=False),
        "per row, sorted": swap_in_module.ResolveLaunch(sorted_plan=True, per_row=True),
    }
    rows = []
    for kind in ("spec", "single"):
        for batch in CROSSOVER_BATCHES:
            w = make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(16, 128 // batch)),
                              shape=shape, device=clock.device, seed=batch)  # fmt: skip
            bench = Bench(w, hosts, clock)
            times = {name: bench.call_us(launch=launch) for name, launch in paths.items()
                     if name != "flat" or batch <= 8}  # fmt: skip
            best = min(times, key=times.get)
            print(f"  crossover {wl} {kind} batch {batch}: " + ", ".join(f"{n} {_fmt(t)}" for n, t in times.items()),
                  flush=True)  # fmt: skip
            rows += [[wl, kind, batch, f"{name}{' (fastest)' if name == best else ''}", t] for name, t in times.items()]
    return rows


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


def _drop(rows: list[list], columns: list[str], *names: str) -> tuple[list[list], list[str]]:
    """``rows`` and ``columns`` without the columns ``names``."""
    keep = [i for i, c in enumerate(columns) if c not in names]
    return [[r[i] for i in keep] for r in rows], [columns[i] for i in keep]


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


# ---------------------------------------------------------------------------------------------------------------------
# Goals: per GPU, from peers.json

COPY_JUDGED = "ordered (default)"  # the copy the goals judge: as swap-ins and pool replays run it


def evaluate_goals(result: dict) -> list[dict]:
    """The goals of the GPU the run measured (``peers.json``), over ``result`` (the JSON :func:`main` writes): each
    cell's µs and its ratio to SGLang's there, the resolve alone, the plan copy's share of the link, and (H200)
    sharing's cost. A GPU without figures, ``--smoke`` (CPU, interpreter) and lines the run did not measure are
    reported as not evaluated, never as met."""
    gpu, table = peer_table(result.get("device", ""))
    note = None
    if result.get("smoke"):
        note = "--smoke: CPU timings under the interpreter"
    elif gpu is None:
        note = f"no SGLang figures for {result.get('device')!r} in peers.json"
    if note is not None:  # every GPU's goals, none judged
        texts = [g["goal"] for name, t in PEERS.items() if not name.startswith("_") for g in _judge(name, t, {})]
        return not_evaluated(texts, note)
    return _judge(gpu, table, result)


def _judge(gpu: str, table: dict, result: dict) -> list[dict]:
    """``gpu``'s goals (its ``peers.json`` entry ``table``) over ``result``."""
    goals_cfg = table["goals"]
    runs = {(r["workload"], r["call"], r["batch"]): r for r in result.get("runs", [])}
    goals = []
    for cell, by_batch in table["sglang_us"].items():
        wl, call = cell.split(" ", 1)
        for batch_text, sglang in by_batch.items():
            batch = int(batch_text)
            ratio = goals_cfg.get("vs_sglang_cells", {}).get(f"{cell} {batch}", goals_cfg["vs_sglang"])
            limit = goals_cfg.get("cell_us", {}).get(cell, {}).get(batch_text)
            text = f"{gpu}: {cell} batch {batch} <= {ratio}x SGLang's {sglang:g} µs" + (
                f" and <= {limit:g} µs" if limit is not None else ""
            )
            run = runs.get((wl, call, batch))
            if run is None:
                goals.append(goal(text, None, None, "line not measured (--workloads / --batches)"))
                continue
            us = run["us_per_call"]
            met = us <= ratio * sglang and (limit is None or us <= limit)
            goals.append(goal(text, f"{us:.1f} µs ({us / sglang:.2f}x SGLang)", met))
    for kind, limit in goals_cfg.get("resolve_us", {}).items():
        for batch in (1, 8, 64):
            text = f"{gpu}: {kind} resolve alone at batch {batch} <= {limit:g} µs"
            measured = [r["resolve_us"] for (wl, call, b), r in runs.items() if call == kind and b == batch]
            if not measured:
                goals.append(goal(text, None, None, "line not measured"))
                continue
            worst = max(measured)
            goals.append(goal(text, f"{worst:.1f} µs (the slowest of {len(measured)} workloads)", worst <= limit))
    # the plan copies judged: the speculative plans' (MLA rows) and the block swap-in's (K and V rows)
    judged_copies = (
        ("copy_ratio", COPY_JUDGED, "plan copy of the batch-64 speculative plans", "", "copy measured", ""),
        ("kv_copy_ratio", f"K+V, {COPY_JUDGED}", "K+V plan copy of the batch-64 MHA (block) plans", " of K and V",
         "MHA copy measured", " (--calls mha)"),
    )  # fmt: skip
    for key, label, what, of, missing, hint in judged_copies:
        copies = {c["workload"]: c for c in result.get("copy_planned", []) if c["label"] == label}
        for wl, ratio in goals_cfg.get(key, {}).items():
            text = f"{gpu}: {what} from {wl} >= {ratio} of the link"
            c = copies.get(wl)
            if c is None:
                goals.append(goal(text, None, None, f"no batch-64 {missing} on {wl}{hint}"))
                continue
            measured = f"{c['ratio']:.2f} ({c['gbps']:.1f} GB/s{of}, {c['rows_per_call']:.0f} rows per call)"
            goals.append(goal(text, measured, c["ratio"] >= ratio))
    if "sharing_cost" in goals_cfg:
        limit = goals_cfg["sharing_cost"]
        text = f"{gpu}: calls on rows without duplicates (B, C) pay < {limit:.0%} for sharing host rows"
        costs = result.get("sharing_cost") or []
        if not costs:
            goals.append(goal(text, None, None, "not measured (--sharing)"))
        else:
            worst = max(costs, key=lambda c: c["cost"])
            measured = f"at most {worst['cost']:+.1%} ({worst['workload']} {worst['call']} batch {worst['batch']})"
            goals.append(goal(text, measured, worst["cost"] < limit))
    return goals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_swap_in.json", help="JSON results file")
    parser.add_argument("--workloads", default="A,B,P", help="of A, B, C, P (comma-separated)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--reps", type=int, default=10, help="graph replays per measurement (median)")
    parser.add_argument("--sweep", action="store_true", help="then time resolve and copy launch shapes")
    parser.add_argument("--no-reference", action="store_true", help="skip the eager reference timings")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    parser.add_argument("--strict", action="store_true", help="exit status 1 unless every goal was judged and met")
    parser.add_argument("--resolve", choices=("auto", "onchip", "triton"), default=None,
                        help="force a resolve (sets KVPLAN_RESOLVE; default: the planner's choice)")  # fmt: skip
    parser.add_argument("--triton-resolve", action="store_true",
                        help="also time the Triton resolve alone beside the one the planner chose")  # fmt: skip
    parser.add_argument("--sharing", action="store_true", help="time what sharing host rows costs (B, C)")
    parser.add_argument("--calls", default="spec,single,mha",
                        help="of spec, single, mha (the block swap-in of K and V), comma-separated")  # fmt: skip
    args = parser.parse_args(argv)
    if args.resolve:
        os.environ["KVPLAN_RESOLVE"] = args.resolve

    smoke = args.smoke
    if smoke:  # before the first kernel import (swap_in_module / copy_module import on first use)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        print("bench_swap_in: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        print(f"bench_swap_in: --workloads takes A, B, C, P; got {bad[0]!r}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    kinds = [k for k in args.calls.split(",") if k]
    if any(k not in ("spec", "single", "mha") for k in kinds):
        print(f"bench_swap_in: --calls takes spec, single, mha; got {args.calls!r}", file=sys.stderr)
        return 2
    triton_launch = swap_in_module.ResolveLaunch(resolve="triton")  # --triton-resolve: the portable resolve alone
    shape = Shape(smoke)
    clock = Clock(device, 2 if smoke else args.reps)
    device_name = torch.cuda.get_device_name() if not smoke else "cpu (interpreter)"
    gpu, peers = peer_table(device_name)
    results: dict = {
        "device": device_name,
        "peer_gpu": gpu,
        "torch": torch.__version__,
        "item_bytes": ITEM,
        "workload": dict(top_k=shape.top_k, hot=shape.hot, tail=shape.tail, steps=shape.steps, scratch=shape.scratch,
                         seq_len=shape.seq_len, spec_misses_per_step=shape.spec_misses,
                         single_misses=shape.single_misses, host_rows=shape.host_rows, window_rows=shape.window_rows),
        "launch": dict(resolve=repr(swap_in_module.RESOLVE_LAUNCH), copy=repr(copy_launch_module.COPY_LAUNCH),
                       flat_copy_max_batch=planner.FLAT_COPY_MAX_BATCH,
                       per_row_min_batch=planner.PER_ROW_MIN_BATCH, resolve_env=os.environ.get("KVPLAN_RESOLVE")),
        "sglang_us": peers.get("sglang_us", {}),
        "runs": [],
        "smoke": smoke,
    }  # fmt: skip

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    if not smoke:
        # one batch per path (flat, split and sorted, one program per row): they compile every kernel variant
        per_row, flat = planner.PER_ROW_MIN_BATCH, planner.FLAT_COPY_MAX_BATCH
        sizes = {1 if b <= flat else per_row if b >= per_row else 4 for b in batches}
        variants = [(spec, b, swap_in_module.RESOLVE_LAUNCH, copy) for spec in (True, False)
                    for b in sorted(sizes) for copy in (True, False)]  # fmt: skip
        if args.triton_resolve:
            variants += [(spec, b, triton_launch, False) for spec in (True, False) for b in sorted(sizes)]
        if args.sweep:
            variants += [(spec, per_row, swap_in_module.ResolveLaunch(row_occ_chunk=o, row_hot_chunk=h, row_warps=w),
                          True) for spec in (True, False) for o, h, w in ROW_SWEEP]  # fmt: skip
            variants += [(spec, b, swap_in_module.RESOLVE_LAUNCH, True) for spec in (True, False)
                         for b in (1, 4, per_row)]  # fmt: skip
        warm_compile(variants)
    rows, copy_rows, sweep_rows = [], [], []
    hosts: dict[str, list[torch.Tensor]] = {}
    ceilings: dict[str, float] = {}
    for wl in workloads:
        cache = "A" if wl == "A" else "B"  # C reads B's caches (through a window)
        if cache not in hosts:
            hosts.pop("A", None)  # A's caches are not needed past A
            t0 = time.perf_counter()
            hosts[cache] = pinned_hosts(shape.host_rows[cache], 1 + REPLAY_LAYERS, device)
            ceilings[cache] = ceiling_gbps(hosts[cache][0], device, 10)
            if not smoke:  # (a CPU run has no pinned memory and no link to measure)
                print(f"host caches {1 + REPLAY_LAYERS} x {hosts[cache][0].numel() * 2 / 1e9:.2f} GB pinned "
                      f"({time.perf_counter() - t0:.1f} s); pinned copy_ ceiling {ceilings[cache]:.1f} GB/s",
                      flush=True)  # fmt: skip
        ceiling = ceilings[cache]
        results.setdefault("ceiling_gbps", {})[wl] = ceiling
        for kind in kinds:
            for batch in batches:
                calls = 2 if smoke else max(4, min(32, 256 // batch))
                if kind == "mha":
                    w = make_mha_workload(wl, batch=batch, calls=calls, shape=shape, device=device, seed=batch)
                else:
                    w = make_workload(wl, batch=batch, speculative=kind == "spec", calls=calls, shape=shape,
                                      device=device, seed=batch)  # fmt: skip
                bench = Bench(w, hosts[cache], clock)
                call = bench.call_us()
                resolve = bench.call_us(copy=False)
                triton_resolve = float("nan")
                if args.triton_resolve:
                    triton_resolve = bench.call_us(copy=False, launch=triton_launch)
                bench.call_us()  # rewrite the plans (the resolve-only run left them as its own)
                decision = bench.decision()
                copy = bench.copy_us()
                split = bench.launch_split()
                lines = [(kind, call)]
                if kind == "spec":
                    lines.append(("spec+3 replays", bench.with_replays_us()))
                ref_ms = float("nan") if args.no_reference else bench.reference_ms()
                unique_bytes = batch * w["unique"] * ITEM * w.get("kv", 1)  # (the MHA lines: K and V rows)
                for label, us in lines:
                    moved = unique_bytes * (1 + REPLAY_LAYERS if label.endswith("replays") else 1)
                    sglang = sglang_us(peers, wl, label, batch)
                    entry = dict(
                        workload=wl, call=label, batch=batch, calls_per_graph=bench.calls, unique_misses=w["unique"],
                        plan_rows_per_call=bench.plan_rows(), us_per_call=us, resolve_us=resolve, copy_us=copy,
                        miss_bytes=moved, gbps=moved / (us * 1e3), ceiling_gbps=ceiling,
                        x_ideal=us / (moved / (ceiling * 1e3)), sglang_us=sglang, vs_sglang=us / sglang,
                        reference_ms=ref_ms if label == kind else float("nan"), split=split,
                        triton_resolve_us=triton_resolve, planner=str(decision),
                    )  # fmt: skip
                    results["runs"].append(entry)
                    if not smoke:  # progress over a run of minutes; the table follows at the end
                        print(f"  {wl} {label} batch {batch}: {_fmt(us)} µs per call (resolve {_fmt(resolve)}, "
                              f"Triton's {_fmt(triton_resolve)}, copy {_fmt(copy)}; SGLang {_fmt(sglang)}); "
                              f"{decision}; launches: {split_text(split)}", flush=True)  # fmt: skip
                    rows.append([wl, label, batch, us, resolve, triton_resolve, copy, entry["gbps"],
                                 entry["gbps"] / ceiling, entry["x_ideal"], sglang, entry["vs_sglang"],
                                 entry["reference_ms"]])  # fmt: skip
                if wl in ("B", "C") and batch > planner.FLAT_COPY_MAX_BATCH and not smoke and args.sharing:
                    # rows without duplicates (B, C) pay for the share step and the record: the call without it
                    entry = dict(workload=wl, call=kind, batch=batch, **sharing_cost(bench))
                    results.setdefault("sharing_cost", []).append(entry)
                    print(f"  {wl} {kind} batch {batch}: {_fmt(entry['us'])} µs, {_fmt(entry['unshared_us'])} "
                          f"without shared host rows ({entry['cost']:+.1%}; medians of {SHARING_PAIRS} alternating "
                          f"pairs)", flush=True)  # fmt: skip
                if kind == "mha" and batch == max(batches):
                    # the copy of the MHA plans: K and V rows together, as the swap-in and pool.replay run it
                    n_rows = bench.plan_rows()
                    us = bench.copy_us()
                    gbps = n_rows * 2 * ITEM / (us * 1e3)
                    label = f"K+V, {COPY_JUDGED}"
                    entry = dict(workload=wl, label=label, batch=batch, rows_per_call=n_rows, us=us, gbps=gbps,
                                 ratio=gbps / ceiling, launch=repr(copy_launch_module.COPY_LAUNCH))  # fmt: skip
                    results.setdefault("copy_planned", []).append(entry)
                    copy_rows.append([wl, label, n_rows, us, gbps, gbps / ceiling])
                    if not smoke:
                        print(f"  {wl} MHA plan copy (K+V): {_fmt(us)} µs, {_fmt(gbps / ceiling)} of the link",
                              flush=True)  # fmt: skip
                if kind == "spec" and batch == max(batches):
                    # the plan copy of the largest batch's plans (50,048 rows at batch 64): the ordered copy as swap-ins
                    # and replays run it, and with a work counter, beside the link
                    n_rows = bench.plan_rows()
                    for label, dispatch in ((COPY_JUDGED, False), ("ordered, work counter", True)):
                        us = bench.copy_us(dispatch=dispatch)
                        gbps = n_rows * ITEM / (us * 1e3)
                        entry = dict(workload=wl, label=label, batch=batch, rows_per_call=n_rows, us=us, gbps=gbps,
                                     ratio=gbps / ceiling, launch=repr(copy_launch_module.COPY_LAUNCH))  # fmt: skip
                        results.setdefault("copy_planned", []).append(entry)
                        copy_rows.append([wl, label, n_rows, us, gbps, gbps / ceiling])
                        if not smoke:
                            print(f"  {wl} plan copy, {label}: {_fmt(us)} µs, {_fmt(gbps / ceiling)} of the link",
                                  flush=True)  # fmt: skip
                    if args.sweep and not smoke:
                        for rows_per, per_sm, warps in ((2, 1, 1), (8, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2)):
                            launch = copy_launch_module.CopyLaunch(rows_per_program=rows_per, programs_per_sm=per_sm,
                                                                   num_warps=warps)  # fmt: skip
                            us = bench.copy_us(launch=launch)
                            gbps = n_rows * ITEM / (us * 1e3)
                            copy_rows.append([wl, f"sweep {launch}", n_rows, us, gbps, gbps / ceiling])
                if args.sweep and not smoke and wl == workloads[-1] and batch == max(batches):
                    for o, h, warps in ROW_SWEEP:
                        launch = swap_in_module.ResolveLaunch(row_occ_chunk=o, row_hot_chunk=h, row_warps=warps,
                                                              per_row=True)  # fmt: skip
                        sweep_rows.append([wl, kind, batch, f"one program per row: occ {o} hot {h} warps {warps}",
                                           bench.call_us(launch=launch)])  # fmt: skip
                save()
        if args.sweep and not smoke and wl == workloads[-1]:
            sweep_rows += crossover(wl, hosts[cache], clock, shape)
            save()
    columns = ["workload", "call", "batch", "kvplan µs", "resolve µs", "Triton resolve µs", "copy µs", "GB/s",
               "of link", "x ideal", "SGLang µs", "kvplan/SGLang", "reference ms"]  # fmt: skip
    if not args.triton_resolve:
        rows, columns = _drop(rows, columns, "Triton resolve µs")
    if gpu is None and not smoke:  # no SGLang figures for this GPU: no ratio against them
        rows, columns = _drop(rows, columns, "SGLang µs", "kvplan/SGLang")
    copy_columns = ["workload", "copy", "rows/call", "µs", "GB/s", "of link"]
    if smoke:  # no link measured on the CPU, and SGLang's figures are the H200's: no ratio against either
        rows, columns = _drop(rows, columns, "of link", "x ideal", "SGLang µs", "kvplan/SGLang")
        copy_rows, copy_columns = _drop(copy_rows, copy_columns, "of link")
        print_table(f"kvplan swap-in, --smoke: tiny shapes (K={shape.top_k}, HOT={shape.hot}, S={shape.steps}) under "
                    "the Triton interpreter on the CPU; µs are wall time, not GPU timings", columns, rows)  # fmt: skip
    else:
        peer = f"SGLang's CUDA kernels on the {gpu}" if gpu else f"no SGLang figures for {device_name}"
        print_table(f"kvplan swap-in vs {peer}, K={shape.top_k}, HOT={shape.hot}, S={shape.steps}, "
                    f"{ITEM} B rows, µs per call (CUDA graphs)", columns, rows)  # fmt: skip
        decisions = sorted({(r["workload"], r["call"].split("+")[0], r["batch"], r["planner"])
                            for r in results["runs"]})  # fmt: skip
        print_table("the launch planner's decision per call", ["workload", "call", "batch", "launches"],
                    [list(d) for d in decisions])  # fmt: skip
    splits = [[r["workload"], r["call"], r["batch"], split_text(r["split"])] for r in results["runs"] if r["split"]]
    if splits:
        print_table("each call's launches (device µs per launch, the calls run eagerly under torch.profiler)",
                    ["workload", "call", "batch", "launches"], splits)  # fmt: skip
    copy_title = "the plan copy" if smoke else "the plan copy beside the link"
    print_table(f"{copy_title} (the largest batch's speculative plans; K+V: its MHA plans, bytes of both rows)",
                copy_columns, copy_rows)  # fmt: skip
    if not smoke:
        print_table("the platform (plain CUDA, measured on the H200: 50,048 random 576 B rows, fresh rows, L2 flushed; "
                    "link 55.3 GB/s)", ["rows", "GB/s", "of link"], [list(p) for p in PLATFORM])  # fmt: skip
    if sweep_rows:
        print_table("launch shapes (µs per call)", ["workload", "call", "batch", "launch", "µs"], sweep_rows)
        results["sweep"] = sweep_rows
    results["goals"] = evaluate_goals(results)
    print_goals("swap_in", results["goals"])
    save()
    print(f"wrote {args.out}")
    return strict_exit(results["goals"], args.strict)


if __name__ == "__main__":
    raise SystemExit(main())
