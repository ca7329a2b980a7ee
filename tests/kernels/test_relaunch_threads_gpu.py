"""Relaunch under threads and streams (issue 27 item 6): calls laid out like earlier ones are launched again from their
record, a call of several launches as one CUDA graph. Threads each relaunching their own layouts (whose tensors may
come back at one another's addresses, so they share entries), and threads relaunching one recorded call at once,
must give exactly what the reference gives: a graph is captured and launched by one thread at a time, and a call's
launches are queued together (``kvplan.runtime.launch_replay._Entry``)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.swap_in_scenarios import build

from kvplan import MissPlan, PlanBufferPool, kernels, reference
from kvplan.counters import HITS, new_counters
from kvplan.runtime.launch_replay import LaunchCache

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
B, S, K, HOT, TAIL, SCRATCH, MAX_LEN = 4, 2, 32, 64, 4, 8, 2048  # batch 4: resolve, sort and ordered copy (5 launches)
TABLES = ("device_buffer_tokens", "lru_slots")


def _scenario(seed: int):
    return build(seed=seed, speculative=True, batch=B, steps=S, top_k=K, hot=HOT, tail=TAIL, lens=[1500, 900, 40, 1900],
                 max_len=MAX_LEN, requests=6, scratch=SCRATCH, miss_rate=0.4, index_dtype=torch.int32, num_real=B,
                 device=DEV, pin=True)  # fmt: skip


def _run_threads(target, count: int) -> list[str]:
    failures: list[str] = []

    def guarded(i: int) -> None:
        try:
            target(i, failures)
        except Exception as error:  # noqa: BLE001 (reported as a failure of that thread)
            failures.append(f"thread {i}: {error!r}"[:400])

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


class _OwnSwapIn:
    """One thread's swap-in: its own state, caches and pool; every run starts from the same tables (restored in place,
    so the call keeps its layout and is relaunched), and is compared with the reference's one run."""

    def __init__(self, seed: int) -> None:
        self.scn = _scenario(seed)
        self.pool = PlanBufferPool(DEV)
        self.pool.ensure_capacity(batch=B, num_steps=S, top_k=K)
        self.out = torch.full(self.scn.top_k_tokens.shape, -7, dtype=torch.int32, device=DEV)
        self.start = {name: getattr(self.scn.state, name).clone() for name in TABLES}
        self.start_dev = self.scn.device_buffer.clone()
        ref_state, self.want_dev = self.scn.state.clone(), self.scn.device_buffer.clone()
        self.want_out = torch.full_like(self.out, -7)
        self.want_plan = MissPlan.allocate(B, S * K, DEV)
        reference.swap_in(ref_state, self.scn.top_k_tokens, self.want_out, self.scn.req_pool_indices,
                          self.scn.seq_lens, self.scn.host_cache, self.want_dev,
                          num_real_reqs=self.scn.num_real_reqs, plan=self.want_plan)  # fmt: skip
        self.want = {name: getattr(ref_state, name) for name in TABLES}

    def run_and_compare(self) -> str | None:
        for name in TABLES:
            getattr(self.scn.state, name).copy_(self.start[name])
        self.scn.device_buffer.copy_(self.start_dev)
        self.out.fill_(-7)
        plan = self.pool.swap_in(self.scn.state, self.scn.top_k_tokens, self.out, self.scn.req_pool_indices,
                                 self.scn.seq_lens, self.scn.host_cache, self.scn.device_buffer,
                                 num_real_reqs=self.scn.num_real_reqs)  # fmt: skip
        torch.cuda.current_stream().synchronize()
        if not torch.equal(self.out, self.want_out):
            return "top_k_device_locs"
        if not torch.equal(self.scn.device_buffer, self.want_dev):
            return "device_buffer"
        if not torch.equal(plan.count, self.want_plan.count):
            return "miss_count"
        for name in TABLES:
            if not torch.equal(getattr(self.scn.state, name), self.want[name]):
                return name
        return None


def test_threads_relaunching_their_own_layouts_40_times_equal_the_reference():
    """Two threads, one on the default stream and one on a side stream, each relaunching its own swap-in (a CUDA
    graph from the second relaunch) and its own plan copy 40 times (the copies from one ``LaunchCache`` both threads
    share)."""
    copy_records = LaunchCache()
    calls = [_OwnSwapIn(seed) for seed in (3, 4)]
    copies = []
    for seed in (3, 4):
        gen = torch.Generator().manual_seed(seed)
        host = torch.randint(0, 255, (4096, 576), dtype=torch.uint8, generator=gen).pin_memory()
        src = torch.randperm(4096, generator=gen)[: 8 * 64].view(8, 64).sort(dim=1).values.to(DEV)
        dst = torch.randperm(8192, generator=gen)[: 8 * 64].view(8, 64).to(DEV, torch.int32)
        plan = MissPlan(src, dst, torch.full((8,), 64, dtype=torch.int32, device=DEV))
        dev = torch.zeros(8192, 576, dtype=torch.uint8, device=DEV)
        want = torch.zeros_like(dev)
        reference.copy_planned(plan, host, want)
        copies.append((plan, host, dev, want))
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    before = sum(c.pool.stats().relaunches for c in calls)  # each thread's swap-in records into its own pool

    def work(i: int, failures: list[str]) -> None:
        plan, host, dev, want = copies[i]
        with torch.cuda.stream(streams[i]):
            for n in range(40):
                wrong = calls[i].run_and_compare()
                if wrong:
                    failures.append(f"thread {i}, run {n}: swap-in {wrong} differs from the reference")
                dev.zero_()
                kernels.copy_planned(plan, host, dev, launch_records=copy_records)
                torch.cuda.current_stream().synchronize()
                if not torch.equal(dev, want):
                    failures.append(f"thread {i}, run {n}: plan copy differs from the reference")

    assert _run_threads(work, 2) == []
    # all but each thread's first run were relaunched, from its pool's records, as one CUDA graph
    assert sum(c.pool.stats().relaunches for c in calls) - before >= 2 * 39
    assert all(c.pool.stats().launch_graphs >= 1 for c in calls)
    assert copy_records.relaunches == 2 * 39 and len(copy_records) == 2  # each thread's copy: checked once


def test_threads_relaunching_one_recorded_call_at_once_equal_the_reference():
    """One swap-in recorded and captured once, relaunched by three threads at once on three streams: each relaunch is
    whole (the graph is launched by one thread at a time, and CUDA orders launches of one graph), so the state,
    outputs and hit counters are those of as many calls one after the other."""
    scn = _scenario(5)
    pool = PlanBufferPool(DEV)
    pool.ensure_capacity(batch=B, num_steps=S, top_k=K)
    out = torch.full(scn.top_k_tokens.shape, -7, dtype=torch.int32, device=DEV)
    ref_state, ref_dev, ref_out = scn.state.clone(), scn.device_buffer.clone(), out.clone()
    counters = new_counters(DEV)

    def call(state, out, dev, counters=None):
        args = (state, scn.top_k_tokens, out, scn.req_pool_indices, scn.seq_lens, scn.host_cache, dev)
        if counters is not None:  # the reference
            reference.swap_in(*args, num_real_reqs=scn.num_real_reqs, counters=counters)
            return None
        return pool.swap_in(*args, num_real_reqs=scn.num_real_reqs)

    hits = []
    for _ in range(3):  # the reference: the first call copies, the next ones hit; the state is then a fixed point
        before = int(counters[HITS])
        call(ref_state, ref_out, ref_dev, counters)
        hits.append(int(counters[HITS]) - before)
    assert hits[1] == hits[2] and hits[1] > 0
    for _ in range(2):  # checked and recorded, then relaunched once: the next relaunch captures the graph
        call(scn.state, out, scn.device_buffer)
    torch.cuda.synchronize()
    seen = int(pool.counters[HITS])
    runs, streams = 20, [torch.cuda.Stream() for _ in range(3)]

    def work(i: int, failures: list[str]) -> None:
        with torch.cuda.stream(streams[i]):
            for _ in range(runs):
                call(scn.state, out, scn.device_buffer)

    assert _run_threads(work, 3) == []
    torch.cuda.synchronize()
    (entry,) = pool._launch_records._entries.values()  # the pool's record of the call
    assert entry.graph, "the call was relaunched as one CUDA graph"
    assert pool.stats().launch_graphs == 1
    assert torch.equal(out, ref_out)
    for name in TABLES:
        assert torch.equal(getattr(scn.state, name), getattr(ref_state, name)), name
    assert torch.equal(scn.device_buffer, ref_dev)
    assert int(pool.counters[HITS]) - seen == 3 * runs * hits[1]  # every relaunch ran whole
