"""A CUDA graph capturing a speculative pool.swap_in + pool.replay replays correctly with new token inputs (issue 4)."""

import pytest
import torch
from helpers.plans import assert_same_plan_rows

from kvplan import HotBufferState, MissPlan, PlanBufferPool, PoolFrozenError, reference
from kvplan.counters import read_counters

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
R, HOT, TAIL, LMAX, SCRATCH = 6, 64, 8, 4096, 8
B, S, K, WORDS = 4, 4, 16, 144  # 576-byte rows


def _tokens(gen, lens):
    rows = [torch.randint(0, length - 1, (S, K), generator=gen, dtype=torch.int32) for length in lens]
    return torch.stack(rows).to(DEV)


def test_captured_pool_swap_in_and_replay_follow_new_inputs():
    gen = torch.Generator().manual_seed(5)
    rids = [4, 0, 2, 5]
    lens = [3000, 700, 2500, 90]
    state = HotBufferState.allocate(R, HOT, TAIL, LMAX, DEV, scratch=SCRATCH)
    for rid in range(R):
        state.set_host_rows(rid, torch.randperm(R * LMAX, generator=gen)[:LMAX])
    host = torch.randint(-(2**31), 2**31 - 1, (R * LMAX, WORDS), dtype=torch.int32, generator=gen).pin_memory()
    layer_host = torch.randint(-(2**31), 2**31 - 1, (R * LMAX, WORDS), dtype=torch.int32, generator=gen).pin_memory()
    dev = torch.zeros(state.device_rows, WORDS, dtype=torch.int32, device=DEV)
    layer_dev = torch.zeros_like(dev)

    pool = PlanBufferPool(DEV)
    pool.reserve(batch=B, num_steps=S, top_k=K)
    pool.freeze()
    static = dict(
        top_k_tokens=_tokens(gen, lens),
        top_k_device_locs=torch.zeros(B, S, K, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([length + s for length in lens for s in range(S)], dtype=torch.int64, device=DEV),
        req_pool_indices=torch.tensor(rids, dtype=torch.int64, device=DEV),
        num_real_reqs=torch.tensor([B], dtype=torch.int32, device=DEV),
    )

    def write_tails():
        for rid, length in zip(rids, lens):
            state.write_tail(rid, torch.arange(length - 1, length + S - 1))

    def step():
        plan = pool.swap_in(state, host_cache=host, device_buffer=dev, **static)
        pool.replay(plan, host_cache=layer_host, device_buffer=layer_dev, num_real_reqs=static["num_real_reqs"])
        return plan

    write_tails()
    # warm-up compiles the kernels; then undo what it wrote so the graph starts from a known state
    saved, saved_dev, saved_layer = state.clone(), dev.clone(), layer_dev.clone()
    step()
    for name in ("device_buffer_tokens", "lru_slots"):
        getattr(state, name).copy_(getattr(saved, name))
    dev.copy_(saved_dev)
    layer_dev.copy_(saved_layer)
    pool.reset_counters()
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = step()
        with pytest.raises(PoolFrozenError, match="reserve"):  # growth refused during capture, capture intact
            pool.ensure_capacity(batch=2 * B, num_steps=S, top_k=K)
    pointers = (plan.src.data_ptr(), plan.dst.data_ptr(), plan.count.data_ptr())

    ref_state, ref_dev, ref_layer = state.clone(), dev.clone(), layer_dev.clone()
    ref_counters = torch.zeros_like(pool.counters)
    copied = 0
    for call in range(4):
        if call:
            lens = [length + 1 + call for length in lens]
            static["seq_lens"].copy_(torch.tensor([length + s for length in lens for s in range(S)], dtype=torch.int64))
        write_tails()
        for rid, length in zip(rids, lens):
            ref_state.write_tail(rid, torch.arange(length - 1, length + S - 1))
        static["top_k_tokens"].copy_(_tokens(gen, lens))
        assert pool.ensure_capacity(batch=B, num_steps=S, top_k=K) is False  # steady state between replays
        graph.replay()

        ref_out = torch.zeros_like(static["top_k_device_locs"])
        src = torch.zeros(B, S * K, dtype=torch.int64, device=DEV)
        dst = torch.zeros(B, S * K, dtype=torch.int32, device=DEV)
        count = torch.zeros(B, dtype=torch.int32, device=DEV)
        reference.swap_in(
            ref_state,
            top_k_tokens=static["top_k_tokens"],
            top_k_device_locs=ref_out,
            seq_lens=static["seq_lens"],
            req_pool_indices=static["req_pool_indices"],
            num_real_reqs=static["num_real_reqs"],
            host_cache=host,
            device_buffer=ref_dev,
            plan=MissPlan(src, dst, count),
            counters=ref_counters,
        )
        reference.copy_planned(
            MissPlan(src, dst, count),
            num_real_reqs=static["num_real_reqs"],
            host_cache=layer_host,
            device_buffer=ref_layer,
        )
        torch.cuda.synchronize()
        assert torch.equal(static["top_k_device_locs"], ref_out)
        assert torch.equal(state.device_buffer_tokens, ref_state.device_buffer_tokens)
        assert torch.equal(state.lru_slots, ref_state.lru_slots)
        assert torch.equal(plan.count, count)
        assert_same_plan_rows(plan.src, plan.dst, src, dst, count)
        assert torch.equal(dev, ref_dev) and torch.equal(layer_dev, ref_layer)
        copied += int(count.sum())
        view = pool.miss_plan(B, S, K)
        assert (view.src.data_ptr(), view.dst.data_ptr(), view.count.data_ptr()) == pointers

    assert copied > 0
    got, want = read_counters(pool.counters), read_counters(ref_counters)
    assert got["misses_copied"] == want["misses_copied"] == copied == got["replayed_rows"]
    assert got["hits"] == want["hits"] and got["overflow"] == want["overflow"]


def test_replay_on_a_side_stream_is_ordered_by_events():
    """The side stream waits for the swap-in queued on the current stream; the event orders the reader after it."""
    gen = torch.Generator().manual_seed(9)
    state = HotBufferState.allocate(R, HOT, TAIL, LMAX, DEV, scratch=SCRATCH)
    rids, lens = [1, 3], [3000, 2000]
    for rid, length in zip(rids, lens):
        state.set_host_rows(rid, torch.arange(LMAX) + rid * LMAX)
        state.write_tail(rid, torch.arange(length - 1, length + S - 1))
    host = torch.randint(-(2**31), 2**31 - 1, (R * LMAX, WORDS), dtype=torch.int32, generator=gen).pin_memory()
    dev = torch.zeros(state.device_rows, WORDS, dtype=torch.int32, device=DEV)
    layer_dev = torch.zeros_like(dev)
    pool = PlanBufferPool(DEV)
    pool.ensure_capacity(batch=2, num_steps=S, top_k=K)
    plan = pool.swap_in(
        state,
        top_k_tokens=_tokens(gen, lens),
        top_k_device_locs=torch.zeros(2, S, K, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([length + s for length in lens for s in range(S)], device=DEV),
        req_pool_indices=torch.tensor(rids, device=DEV),
        host_cache=host,
        device_buffer=dev,
    )
    side = torch.cuda.Stream(DEV)
    done = pool.replay(plan, host_cache=host, device_buffer=layer_dev, stream=side)
    assert isinstance(done, torch.cuda.Event)
    torch.cuda.current_stream(DEV).wait_event(done)
    copied = layer_dev.clone()  # ordered after the side-stream copy by the event
    torch.cuda.synchronize()
    assert int(plan.count.sum()) > 0
    assert torch.equal(copied, dev)  # the same host rows land in the same device rows as the anchor's copy
