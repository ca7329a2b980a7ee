"""Hostile inputs, fifth pass, on the GPU: a single-step padding row copies nothing on each copy path (batch 2: the
flat copy; 6: sorted plan and ordered copy; 96: one program per row), nor does a replay of its plan; and the SGLang
adapter called from two threads, each on its own CUDA stream with its own tables, gives each the reference."""

from __future__ import annotations

import threading

import pytest
import torch

from kvplan import HotBufferState, PlanBufferPool, reference
from kvplan.compat import sglang as sg
from kvplan.counters import NUM_COUNTERS

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
I16, I32, I64 = torch.int16, torch.int32, torch.int64
HOT, TAIL, LEN, TOP_K, ITEM = 8, 2, 60, 8, 16


def _state(requests: int) -> HotBufferState:
    state = HotBufferState.allocate(requests, HOT, TAIL, 64, DEV)
    for rid in range(requests):
        state.admit(rid, torch.arange(LEN) + rid * 64)
        state.write_tail(rid, [LEN - 1])
    return state


@pytest.mark.parametrize("batch", [2, 6, 96])
def test_a_padding_rid_copies_nothing_on_each_copy_path(batch):
    gen = torch.Generator().manual_seed(batch)
    requests = batch
    host = torch.randint(0, 1 << 30, (requests * 64, ITEM), dtype=I32, generator=gen).pin_memory()
    k_state, r_state = _state(requests), _state(requests)
    k_dev = torch.zeros(k_state.device_rows, ITEM, dtype=I32, device=DEV)
    r_dev = k_dev.clone()
    r_counters = torch.zeros(NUM_COUNTERS, dtype=I64, device=DEV)
    pool = PlanBufferPool(DEV)
    lens = torch.full((batch,), LEN, dtype=I64, device=DEV)
    rids = torch.arange(batch, device=DEV)
    padded = rids.clone()
    padded[1] = requests  # row 1: outside the pool, a padding row whose plan row holds step 1's entries
    steps = [
        (torch.randint(0, LEN - 1, (batch, TOP_K), dtype=I32, generator=gen), rids, lens),
        (torch.randint(0, LEN - 1, (1, TOP_K), dtype=I32, generator=gen), rids[1:2], lens[:1]),
        (torch.randint(0, LEN - 1, (batch, TOP_K), dtype=I32, generator=gen), padded, lens),
    ]
    for tokens, step_rids, step_lens in steps:
        tokens = tokens.to(DEV)
        pool.ensure_capacity(batch=tokens.shape[0], top_k=TOP_K)
        k_out = torch.full(tokens.shape, -9, dtype=I32, device=DEV)
        r_out = k_out.clone()
        plan = pool.swap_in(k_state, tokens, k_out, step_rids, step_lens, host, k_dev)
        reference.swap_in(r_state, tokens, r_out, step_rids, step_lens, host, r_dev, counters=r_counters)
        torch.cuda.synchronize()
        assert torch.equal(k_out, r_out)
        assert torch.equal(k_state.device_buffer_tokens, r_state.device_buffer_tokens)
        assert torch.equal(k_dev, r_dev)
    counters = pool.stats().counters
    assert counters.misses_copied == int(r_counters[0])
    layer = torch.zeros_like(k_dev)
    pool.replay(plan, host_cache=host, device_buffer=layer)
    want = torch.zeros_like(layer)
    for b in range(batch):
        if b != 1:
            n = int(plan.count[b])
            want[plan.dst[b, :n].long()] = host[plan.src[b, :n].cpu()].to(DEV)
    torch.cuda.synchronize()
    assert torch.equal(layer, want)


def _adapter_tables(seed: int, requests: int = 4, hot: int = 8, page: int = 2, max_len: int = 64):
    gen = torch.Generator().manual_seed(seed)
    width = hot + page
    dbt = torch.full((requests, width), -1, dtype=I32)
    lru = torch.stack([torch.randperm(hot, generator=gen) for _ in range(requests)]).to(I16)
    hcl = torch.full((requests, max_len), -1, dtype=I64)
    lens = [40 + r for r in range(requests)]
    for rid, length in enumerate(lens):
        hcl[rid, :length] = rid * max_len + torch.arange(length)
        dbt[rid, : hot - 2] = torch.randperm(length - 1, generator=gen)[: hot - 2].to(I32)
        dbt[rid, hot] = length - 1
    return dict(
        dbt=dbt.to(DEV), dbl=torch.arange(requests * width, dtype=I32).view(requests, width).to(DEV), lru=lru.to(DEV),
        hcl=hcl.to(DEV), host=torch.randn(requests * max_len, 1, ITEM, generator=gen).to(torch.bfloat16).pin_memory(),
        dev=torch.zeros(requests * width, 1, ITEM, dtype=torch.bfloat16, device=DEV),
        rids=torch.arange(requests, device=DEV), lens=torch.tensor(lens, dtype=I64, device=DEV), hot=hot, gen=gen,
    )  # fmt: skip


def test_adapter_threads_on_their_own_streams_each_get_the_reference():
    failures: list[str] = []
    barrier = threading.Barrier(2)

    def run(seed: int) -> None:
        try:
            t = _adapter_tables(seed)
            stream = torch.cuda.Stream()
            for step in range(6):
                top_k = torch.stack([torch.randint(0, int(n), (TOP_K,), generator=t["gen"]) for n in t["lens"]])
                top_k = top_k.to(I32).to(DEV)
                twin = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
                state = HotBufferState(twin["dbt"], twin["dbl"], twin["lru"], twin["hcl"])
                want = torch.empty(top_k.shape, dtype=I32, device=DEV)
                reference.swap_in(state, top_k, want, twin["rids"], twin["lens"], twin["host"].view(-1, ITEM),
                                  twin["dev"].view(-1, ITEM))  # fmt: skip
                out = torch.empty_like(want)
                barrier.wait()
                with torch.cuda.stream(stream):
                    sg.load_cache_to_device_buffer_mla(
                        top_k, t["dbt"], t["hcl"], t["dbl"], t["host"], t["dev"], out, t["rids"], t["lens"], t["lru"],
                        ITEM * 2, TOP_K, t["hot"],
                    )  # fmt: skip
                stream.synchronize()
                if not (torch.equal(out, want) and torch.equal(t["dev"], twin["dev"])):
                    failures.append(f"thread {seed} step {step}")
        except Exception as error:  # noqa: BLE001 (reported as that thread's failure)
            failures.append(f"thread {seed}: {error!r}"[:400])
            barrier.abort()  # the other thread must not wait at the barrier for this one: it ends too, and says so

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), f"a thread did not finish; failures so far: {failures}"
    assert failures == []
