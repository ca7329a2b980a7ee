"""PlanBufferPool on a GPU: device placement, no synchronisation, CUDA-graph capture through the pool's views."""

from __future__ import annotations

import pytest
import torch

from kvplan import MaterializeGeometry, PlanBufferPool, PoolBudgetError, PoolFrozenError
from kvplan.counters import MISSES_COPIED

pytestmark = pytest.mark.gpu

DFLASH = MaterializeGeometry(n_layers=5, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
MAXIMA = {"batch": 256, "num_steps": 4, "top_k": 2048, "total_ctx": 8192}  # graph-padded speculative HiSparse step


def view_pointers(pool: PlanBufferPool, batch: int, num_steps: int, top_k: int, total_ctx: int) -> tuple[int, ...]:
    plan = pool.miss_plan(batch, num_steps, top_k)
    k_out, v_out = pool.kv_out(total_ctx)
    workspace = pool.workspace(batch, num_steps, top_k)
    return tuple(t.data_ptr() for t in (plan.src, plan.dst, plan.count, workspace, k_out, v_out))


def test_cpu_pool_created_while_a_cuda_device_is_current_stays_on_the_cpu():
    with torch.cuda.device(0):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(0)
        pool = PlanBufferPool("cpu", geometry=DFLASH)
        pool.ensure_capacity(batch=8, num_steps=2, top_k=64, total_ctx=32)
        plan = pool.miss_plan(8, 2, 64)
        k_out, v_out = pool.kv_out(32)
        for t in (plan.src, plan.dst, plan.count, pool.workspace(8, 2, 64), k_out, v_out, pool.counters):
            assert t.device == torch.device("cpu")
        assert torch.cuda.memory_allocated(0) == allocated


def test_cuda_pool_pins_its_device_and_allocates_there():
    pool = PlanBufferPool("cuda", geometry=DFLASH)
    assert pool.device == torch.device("cuda", torch.cuda.current_device())
    pool.ensure_capacity(batch=4, top_k=16, total_ctx=8)
    assert pool.miss_plan(4, 1, 16).src.device == pool.device and pool.counters.device == pool.device
    if torch.cuda.device_count() > 1:
        other = PlanBufferPool("cuda:1")
        with torch.cuda.device(0):
            other.ensure_capacity(batch=4, top_k=16)
        assert other.miss_plan(4, 1, 16).src.device == torch.device("cuda", 1)


def test_steady_state_and_growth_never_synchronise():
    pool = PlanBufferPool("cuda", geometry=DFLASH)
    pool.ensure_capacity(batch=64, num_steps=4, top_k=2048, total_ctx=4096)
    view_pointers(pool, 64, 4, 2048, 4096)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(100):
            assert pool.ensure_capacity(batch=64, num_steps=4, top_k=2048, total_ctx=4096) is False
            view_pointers(pool, 64, 4, 2048, 4096)
        assert pool.ensure_capacity(batch=128, num_steps=4, top_k=2048, total_ctx=8192) is True
        pool.reset_counters()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_reserve_capture_replay_through_the_pools_views():
    pool = PlanBufferPool("cuda", geometry=DFLASH)
    pool.reserve(**MAXIMA)
    pool.freeze()
    shape = (MAXIMA["batch"], MAXIMA["num_steps"], MAXIMA["top_k"], MAXIMA["total_ctx"])
    assert pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3]) is False
    generation, pointers = pool.generation, view_pointers(pool, *shape)
    plan = pool.miss_plan(*shape[:3])
    k_out, v_out = pool.kv_out(shape[3])
    source_k = torch.randn(k_out.shape, device="cuda").to(k_out.dtype)
    source_rows = torch.arange(plan.src.numel(), device="cuda").view(plan.src.shape)

    def step() -> None:
        plan.count.fill_(7)
        plan.src.copy_(source_rows)
        k_out.copy_(source_k)
        v_out.fill_(2.0)
        pool.counters[MISSES_COPIED : MISSES_COPIED + 1].add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graphs recommends
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # Steady-state steps between replays: every shape within the reservation, no growth, nothing moves.
    for b, s, k, c in ((1, 1, 2048, 0), (64, 4, 2048, 8192), (256, 2, 4096, 100), shape):
        assert pool.ensure_capacity(batch=b, num_steps=s, top_k=k, total_ctx=c) is False
    assert pool.generation == generation and view_pointers(pool, *shape) == pointers

    pool.reset_counters()
    for view in (plan.count, plan.src, k_out, v_out):
        view.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    fresh = pool.miss_plan(*shape[:3])
    fresh_k, fresh_v = pool.kv_out(shape[3])
    assert fresh.count.data_ptr() == plan.count.data_ptr() and fresh_k.data_ptr() == k_out.data_ptr()
    assert torch.all(fresh.count == 7)
    assert torch.equal(fresh.src, source_rows)
    assert torch.equal(fresh_k, source_k) and torch.all(fresh_v == 2.0)
    assert torch.all(pool.miss_plan(4, 4, 2048).count == 7)  # a smaller step's views read the same storage
    assert pool.stats().counters.misses_copied == 2


def test_growth_during_capture_raises_and_the_capture_ends_cleanly():
    pool = PlanBufferPool("cuda", geometry=DFLASH)
    pool.ensure_capacity(batch=4, top_k=8, total_ctx=16)
    plan = pool.miss_plan(4, 1, 8)
    generation, before = pool.generation, pool.stats()
    plan.count.fill_(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.count.fill_(1)
        with pytest.raises(PoolFrozenError) as info:
            pool.ensure_capacity(batch=64, top_k=8, total_ctx=16)
        assert pool.ensure_capacity(batch=4, top_k=8, total_ctx=16) is False  # steady state is capture-safe
        with pytest.raises(PoolFrozenError, match="capturing"):
            pool.trim()
        with pytest.raises(PoolFrozenError, match="capturing"):
            pool.reserve(batch=64, top_k=8)
    message = str(info.value)
    assert "the current CUDA stream is capturing a graph" in message
    assert "miss_src needs" in message and "call pool.reserve(batch=64" in message
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(plan.count == 1)
    assert pool.generation == generation and pool.stats() == before
    assert pool.ensure_capacity(batch=64, top_k=8, total_ctx=16) is True  # outside capture it grows again


def test_a_real_out_of_memory_is_a_budget_error_and_changes_nothing():
    pool = PlanBufferPool("cuda")
    pool.ensure_capacity(batch=4, top_k=8)
    plan, before = pool.miss_plan(4, 1, 8), pool.stats()
    with pytest.raises(PoolBudgetError, match="could not allocate miss_src"):
        pool.ensure_capacity(batch=1 << 38, top_k=8)  # 2^41 int64 elements: far beyond any GPU
    assert pool.miss_plan(4, 1, 8) is plan and pool.stats() == before
