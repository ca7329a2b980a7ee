"""PlanBufferPool: exact views, growth policies, re-lay, steady state, guards, transactions, stats, logging, threads."""

from __future__ import annotations

import logging
import threading

import attrs
import pytest
import torch

from kvplan import (
    MaterializeGeometry,
    MissPlan,
    PlanBufferPool,
    PoolBudgetError,
    PoolCapacityError,
    PoolConfig,
    PoolFrozenError,
    check_materialize,
    check_miss_plan,
    check_spec_miss_plan,
    required_bytes,
)
from kvplan.counters import MISSES_COPIED, NUM_COUNTERS, OVERFLOW
from kvplan.stats import stat_keys
from kvplan.workspace import swap_in_workspace_columns

GEOMETRY = MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def make_pool(**config) -> PlanBufferPool:
    return PlanBufferPool("cpu", geometry=GEOMETRY, config=PoolConfig(**config))


def pointers(pool: PlanBufferPool, batch: int, num_steps: int, top_k: int, total_ctx: int) -> tuple[int, ...]:
    plan = pool.miss_plan(batch, num_steps, top_k)
    k_out, v_out = pool.kv_out(total_ctx)
    views = (plan.src, plan.dst, plan.count, pool.workspace(batch, num_steps, top_k), k_out, v_out)
    return tuple(v.data_ptr() for v in views)


def extent(pool: PlanBufferPool, name: str, dim: str) -> int:
    """A buffer's layout extent as allocated (the growth policies size these): rows (``batch``/``total_ctx``) or
    columns (its elements over its rows). ``capacity.batch``/``.columns`` are in step units instead (see
    test_capacities_are_in_the_units_of_the_last_step)."""
    flat = pool.stats().as_dict()
    rows = flat[f"{name}.capacity.rows"]
    return flat[f"{name}.capacity.elements"] // rows if dim == "columns" else rows


def assert_views_valid(pool: PlanBufferPool, batch: int, num_steps: int, top_k: int, total_ctx: int) -> None:
    """Every view has exactly the step's shape and passes the raw validators."""
    plan = pool.miss_plan(batch, num_steps, top_k)
    assert plan.src.shape == plan.dst.shape == (batch, num_steps * top_k)
    assert plan.count.shape == (batch,)
    check_spec_miss_plan(torch.empty(batch, num_steps, top_k, dtype=torch.int32), plan.src, plan.dst, plan.count)
    if num_steps == 1:
        check_miss_plan(torch.empty(batch, top_k, dtype=torch.int32), plan.src, plan.dst, plan.count)
    assert pool.workspace(batch, num_steps, top_k).shape == (batch, swap_in_workspace_columns(num_steps, top_k))
    g = pool.geometry
    if g is not None:
        k_out, v_out = pool.kv_out(total_ctx)
        assert k_out.shape == v_out.shape == (g.n_layers, total_ctx, g.num_kv_heads, g.head_dim)
        h, d = g.num_kv_heads, g.head_dim
        check_materialize(
            torch.empty(total_ctx, g.n_layers, 2 * h * d, dtype=g.dtype),
            torch.ones(g.n_layers, d),
            torch.full((g.n_layers,), 1e-6),
            torch.zeros(4, d),
            torch.zeros(total_ctx, dtype=torch.int64),
            h,
            d,
            d,
            k_out,
            v_out,
        )


# --------------------------------------------------------------------------------------------------------------------
# Configuration


def test_config_defaults_and_bucket_normalisation():
    assert PoolConfig() == PoolConfig(growth="geometric", growth_factor=2.0, batch_buckets=(), max_bytes=None)
    assert PoolConfig(growth="bucketed", batch_buckets=[16, 1, 8, 8]).batch_buckets == (1, 8, 16)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        PoolConfig().growth = "exact"


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"growth": "double"}, ValueError, "PoolConfig.growth must be one of 'exact', 'geometric', 'bucketed', got"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be a finite number > 1.0, got 1.0"),
        ({"growth_factor": float("inf")}, ValueError, "growth_factor must be a finite number > 1.0, got inf"),
        ({"growth_factor": True}, TypeError, "growth_factor must be a float, got bool True"),
        ({"growth": "bucketed"}, ValueError, "batch_buckets must list the CUDA-graph batch sizes"),
        ({"batch_buckets": (8,)}, ValueError, "only used by growth='bucketed', got growth='geometric'"),
        ({"growth": "bucketed", "batch_buckets": (0, 8)}, ValueError, "batch sizes > 0, got 0"),
        ({"growth": "bucketed", "batch_buckets": (2.0,)}, TypeError, "must hold ints, got float 2.0"),
        ({"growth": "bucketed", "batch_buckets": 8}, TypeError, "batch_buckets must be a sequence of ints, got int"),
        ({"max_bytes": -1}, ValueError, "PoolConfig.max_bytes must be >= 0 (or None for no budget), got -1"),
        ({"max_bytes": 1.5}, TypeError, "PoolConfig.max_bytes must be an int or None, got float 1.5"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, text):
    with pytest.raises(error) as info:
        PoolConfig(**kwargs)
    assert text in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"n_layers": 0}, ValueError, "MaterializeGeometry.n_layers must be > 0, got 0"),
        ({"head_dim": 8.0}, TypeError, "MaterializeGeometry.head_dim must be an int, got float 8.0"),
        ({"dtype": torch.int32}, ValueError, "MaterializeGeometry.dtype must be a floating dtype"),
        ({"dtype": "bfloat16"}, TypeError, "MaterializeGeometry.dtype must be a torch.dtype, got str"),
    ],
)
def test_geometry_rejects_bad_values(kwargs, error, text):
    fields = {"n_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float16} | kwargs
    with pytest.raises(error) as info:
        MaterializeGeometry(**fields)
    assert text in str(info.value)


def test_pool_constructor_checks_its_arguments():
    with pytest.raises(TypeError, match="config must be a PoolConfig or None, got dict"):
        PlanBufferPool("cpu", config={"growth": "exact"})
    with pytest.raises(TypeError, match="geometry must be a MaterializeGeometry or None, got tuple"):
        PlanBufferPool("cpu", geometry=(2, 2, 8, torch.float16))
    with pytest.raises(ValueError, match="device must name a torch device"):
        PlanBufferPool("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA, but no CUDA device is available"):
            PlanBufferPool("cuda")


# --------------------------------------------------------------------------------------------------------------------
# Views


def test_views_have_exact_shapes_and_pass_the_validators():
    pool = make_pool()
    assert pool.ensure_capacity(batch=3, num_steps=2, top_k=5, total_ctx=7) is True
    assert_views_valid(pool, 3, 2, 5, 7)
    assert_views_valid(pool, 3, 1, 5, 7)  # smaller shapes fit the same storage
    assert_views_valid(pool, 1, 2, 4, 1)
    plan = pool.miss_plan(3, 2, 5)
    assert plan.src.dtype == torch.int64 and plan.dst.dtype == torch.int32 and plan.count.dtype == torch.int32
    assert plan.src.stride(0) == plan.dst.stride(0) == 10
    assert pool.workspace(3, 2, 5).dtype == torch.int64
    k_out, _ = pool.kv_out(7)
    assert k_out.is_contiguous() and k_out.dtype == torch.bfloat16
    for view in (plan.src, plan.dst, plan.count, k_out, pool.counters):
        assert view.device == torch.device("cpu")


def test_views_are_cached_per_shape():
    pool = make_pool()
    pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    assert pool.miss_plan(4, 2, 8) is pool.miss_plan(4, 2, 8)
    assert pool.kv_out(16) is pool.kv_out(16)
    assert pool.workspace(4, 2, 8) is pool.workspace(4, 2, 8)
    assert pool._launch_buffers(4, 2, 8) is pool._launch_buffers(4, 2, 8)
    plan, kernel_plan, workspace, counters = pool._launch_buffers(4, 2, 8)
    assert kernel_plan is plan and plan is pool.miss_plan(4, 2, 8)  # eagerly the kernel writes the returned plan
    assert counters is pool.counters
    assert plan.src.shape == (4, 16) and workspace.shape == (4, swap_in_workspace_columns(2, 8))
    assert isinstance(plan, MissPlan) and plan.generation == pool.generation


@pytest.mark.parametrize(
    ("fetch", "where", "call"),
    [
        (lambda p: p.miss_plan(5, 2, 8), "miss_plan: ", "Call pool.ensure_capacity(batch=5, num_steps=2, top_k=8) "),
        (lambda p: p.miss_plan(4, 3, 8), "miss_plan: ", "Call pool.ensure_capacity(batch=4, num_steps=3, top_k=8) "),
        (lambda p: p.workspace(4, 2, 9), "workspace: ", "Call pool.ensure_capacity(batch=4, num_steps=2, top_k=9) "),
        (lambda p: p.kv_out(17), "kv_out: ", "Call pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=17) "),
        (
            lambda p: p._launch_buffers(8, 2, 8),
            "swap-in launch: ",
            "Call pool.ensure_capacity(batch=8, num_steps=2, top_k=8) ",
        ),
    ],
)
def test_unsized_views_raise_capacity_error_naming_the_call(fetch, where, call):
    pool = make_pool(growth="exact")
    pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    with pytest.raises(PoolCapacityError) as info:
        fetch(pool)
    assert str(info.value).startswith(where)
    assert call + "before the step" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_fresh_pool_refuses_views_but_serves_empty_shapes():
    pool = make_pool()
    with pytest.raises(PoolCapacityError, match=r"miss_src needs 4 elements \(1 x 4\), it holds 0"):
        pool.miss_plan(1, 1, 4)
    assert pool.miss_plan(0, 1, 4).src.shape == (0, 4)
    assert pool.kv_out(0)[0].shape == (2, 0, 2, 8)


def test_pool_without_geometry_refuses_context():
    pool = PlanBufferPool("cpu")
    with pytest.raises(ValueError, match="total_ctx must be 0 for a pool without materialize slabs, got total_ctx=1"):
        pool.ensure_capacity(batch=1, top_k=4, total_ctx=1)
    with pytest.raises(ValueError, match="kv_out: this pool has no materialize slabs"):
        pool.kv_out(0)
    assert pool.generation == 0
    assert pool.ensure_capacity(batch=2, top_k=4) is True
    assert not any(k.startswith("k_out.") for k in pool.stats().as_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"batch": -1}, ValueError, "ensure_capacity: batch must be >= 0, got -1"),
        ({"batch": 1, "num_steps": 0}, ValueError, "ensure_capacity: num_steps must be >= 1, got 0"),
        ({"batch": 1, "top_k": -2}, ValueError, "ensure_capacity: top_k must be >= 0, got -2"),
        ({"batch": 2.0}, TypeError, "ensure_capacity: batch must be an int, got float 2.0"),
        ({"batch": True}, TypeError, "ensure_capacity: batch must be an int, got bool True"),
        ({"batch": torch.tensor(2)}, TypeError, "a tensor would need a device sync"),
        ({"batch": [2]}, TypeError, "ensure_capacity: batch must be an int, got list [2]"),
        ({"batch": 1, "total_ctx": "3"}, TypeError, "ensure_capacity: total_ctx must be an int, got str '3'"),
    ],
)
def test_bad_arguments_raise_and_change_nothing(kwargs, error, text):
    pool = make_pool()
    pool.ensure_capacity(batch=2, top_k=4, total_ctx=3)
    before = pool.stats()
    with pytest.raises(error) as info:
        pool.ensure_capacity(**kwargs)
    assert text in str(info.value)
    assert pool.stats() == before


def test_bad_view_arguments_even_when_equal_to_a_cached_shape():
    pool = make_pool()
    pool.ensure_capacity(batch=2, top_k=4, total_ctx=3)
    pool.miss_plan(2, 1, 4)
    with pytest.raises(TypeError, match="miss_plan: batch must be an int, got float 2.0"):
        pool.miss_plan(2.0, 1, 4)
    with pytest.raises(TypeError, match="kv_out: total_ctx must be an int, got bool True"):
        pool.kv_out(True)
    with pytest.raises(ValueError, match="workspace: num_steps must be >= 1, got 0"):
        pool.workspace(2, 0, 4)


def test_numpy_style_ints_are_accepted():
    class Index:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            return self.value

    pool = make_pool()
    assert pool.ensure_capacity(batch=Index(2), top_k=Index(4)) is True
    assert pool.ensure_capacity(batch=Index(2), top_k=Index(4)) is False
    assert pool.miss_plan(Index(2), 1, Index(4)) is pool.miss_plan(2, 1, 4)


# --------------------------------------------------------------------------------------------------------------------
# Growth policies and re-lay


def test_exact_growth():
    pool = make_pool(growth="exact")
    pool.ensure_capacity(batch=3, num_steps=1, top_k=5, total_ctx=7)
    pool.ensure_capacity(batch=4, num_steps=1, top_k=5, total_ctx=9)
    assert extent(pool, "miss_src", "batch") == 4 and extent(pool, "miss_src", "columns") == 5
    assert extent(pool, "miss_count", "batch") == 4
    assert extent(pool, "k_out", "total_ctx") == 9


def test_geometric_growth_at_least_factor_times_old():
    pool = make_pool(growth="geometric", growth_factor=1.5)
    pool.ensure_capacity(batch=4, top_k=4, total_ctx=10)  # from empty: the request itself
    assert extent(pool, "miss_count", "batch") == 4 and extent(pool, "k_out", "total_ctx") == 10
    pool.ensure_capacity(batch=5, top_k=4, total_ctx=11)
    assert extent(pool, "miss_count", "batch") == 6 and extent(pool, "k_out", "total_ctx") == 15
    pool.ensure_capacity(batch=20, top_k=4, total_ctx=11)  # a jump past factor x old takes the request
    assert extent(pool, "miss_count", "batch") == 20


def test_bucketed_growth_rounds_batch_to_buckets_and_falls_back_with_a_warning(caplog):
    pool = make_pool(growth="bucketed", batch_buckets=(1, 4, 16))
    with caplog.at_level(logging.INFO, logger="kvplan"):
        pool.ensure_capacity(batch=3, num_steps=1, top_k=5, total_ctx=3)
        assert extent(pool, "miss_src", "batch") == 4 and extent(pool, "miss_src", "columns") == 5
        assert extent(pool, "k_out", "total_ctx") == 3
        pool.ensure_capacity(batch=5, num_steps=1, top_k=6, total_ctx=4)  # columns and context: geometric
        assert extent(pool, "miss_src", "batch") == 16 and extent(pool, "miss_src", "columns") == 10
        assert extent(pool, "k_out", "total_ctx") == 6
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
        pool.ensure_capacity(batch=17, num_steps=1, top_k=6)
        pool.ensure_capacity(batch=17, num_steps=1, top_k=6, total_ctx=40)  # only context grows: no warning
    assert extent(pool, "miss_count", "batch") == 32  # above the largest bucket: geometric
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "above the largest batch bucket 16" in warnings[0].getMessage()


def test_dimensions_grow_independently():
    pool = make_pool(growth="exact")
    pool.ensure_capacity(batch=4, num_steps=1, top_k=8, total_ctx=16)
    before = pool.stats().as_dict()
    pool.ensure_capacity(batch=4, num_steps=1, top_k=8, total_ctx=32)  # context only: the plan is untouched
    after = pool.stats().as_dict()
    for name in ("miss_src", "miss_dst", "miss_count", "workspace"):
        assert after[f"{name}.grow_events"] == before[f"{name}.grow_events"]
    assert after["k_out.grow_events"] == before["k_out.grow_events"] + 1
    assert after["total.grow_causes.context"] == before["total.grow_causes.context"] + 1
    assert after["total.grow_causes.batch"] == before["total.grow_causes.batch"] == 1  # only the first step


def test_steps_or_top_k_change_relays_rows_without_reallocating():
    pool = make_pool(growth="exact")
    pool.ensure_capacity(batch=4, num_steps=4, top_k=8, total_ctx=4)
    ptrs, generation = pointers(pool, 4, 4, 8, 4), pool.generation
    for batch, num_steps, top_k in ((4, 2, 16), (2, 8, 8), (4, 1, 32), (1, 4, 32)):
        assert pool.ensure_capacity(batch=batch, num_steps=num_steps, top_k=top_k, total_ctx=4) is False
        plan = pool.miss_plan(batch, num_steps, top_k)
        assert plan.src.shape == (batch, num_steps * top_k) and plan.src.stride(0) == plan.dst.stride(0)
        assert plan.src.data_ptr() == ptrs[0] and plan.dst.data_ptr() == ptrs[1]
        assert_views_valid(pool, batch, num_steps, top_k, 4)
    assert pool.generation == generation
    assert pool.stats().grow_events == 1


# --------------------------------------------------------------------------------------------------------------------
# Steady state


def test_steady_state_keeps_pointers_generation_and_allocates_nothing(monkeypatch):
    pool = make_pool()
    shapes = [(4, 2, 8, 16), (2, 1, 8, 3), (4, 1, 16, 16)]
    for shape in shapes:
        pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3])
        pointers(pool, *shape)  # warm the view caches
    generation = pool.generation
    expected = {shape: pointers(pool, *shape) for shape in shapes}

    def no_allocation(*args, **kwargs):
        raise AssertionError("steady state allocated")

    for name in ("empty", "zeros", "empty_like", "zeros_like", "full"):
        monkeypatch.setattr(torch, name, no_allocation)
    monkeypatch.setattr(pool, "_allocate", no_allocation)
    for _ in range(3):
        for shape in shapes:
            assert pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3]) is False
            assert pointers(pool, *shape) == expected[shape]
    assert pool.generation == generation


# --------------------------------------------------------------------------------------------------------------------
# Transactions: budget and allocation failure


def snapshot(pool: PlanBufferPool, shape) -> tuple:
    plan = pool.miss_plan(*shape[:3])
    return pool.stats(), pool.generation, plan, pool.kv_out(shape[3]), pointers(pool, *shape)


def test_budget_refusal_names_buffer_request_current_and_budget_and_changes_nothing():
    shape = (4, 1, 8, 16)
    pool = make_pool(growth="exact", max_bytes=required_bytes(PoolConfig(), GEOMETRY, batch=4, top_k=8, total_ctx=16))
    pool.ensure_capacity(batch=4, top_k=8, total_ctx=16)
    before = snapshot(pool, shape)
    with pytest.raises(PoolBudgetError) as info:
        pool.ensure_capacity(batch=4, top_k=8, total_ctx=17)
    message = str(info.value)
    assert "ensure_capacity(batch=4, num_steps=1, top_k=8, total_ctx=17)" in message
    assert "k_out 1024 B -> 1088 B" in message and "v_out" in message
    assert f"from {before[0].reserved_bytes} B" in message
    assert f"max_bytes={pool.config.max_bytes}" in message
    after = snapshot(pool, shape)
    assert after[0] == before[0] and after[1] == before[1] and after[4] == before[4]
    assert after[2] is before[2] and after[3] is before[3]  # the very same view objects


def test_budget_falls_back_to_exact_sizes_when_policy_rounding_would_exceed_it():
    exact = required_bytes(PoolConfig(), None, batch=5, top_k=8)
    pool = PlanBufferPool("cpu", config=PoolConfig(growth="geometric", max_bytes=exact))
    pool.ensure_capacity(batch=4, top_k=8)
    assert pool.ensure_capacity(batch=5, top_k=8) is True  # x2 would be 8 rows, over the budget
    assert extent(pool, "miss_src", "batch") == 5
    assert pool.stats().reserved_bytes == exact


@pytest.mark.parametrize("failing_call", [1, 2, 4])
def test_allocation_failure_is_all_or_nothing(monkeypatch, failing_call):
    shape = (2, 1, 4, 4)
    pool = make_pool()
    pool.ensure_capacity(batch=2, top_k=4, total_ctx=4)
    pool.counters[MISSES_COPIED] = 5
    before = snapshot(pool, shape)
    real, calls = pool._allocate, []

    def flaky(numel, dtype):
        calls.append(numel)
        if len(calls) == failing_call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(numel, dtype)

    monkeypatch.setattr(pool, "_allocate", flaky)
    with pytest.raises(PoolBudgetError) as info:
        pool.ensure_capacity(batch=8, num_steps=2, top_k=4, total_ctx=64)  # every buffer grows
    message = str(info.value)
    assert "ensure_capacity(batch=8, num_steps=2, top_k=4, total_ctx=64) could not allocate" in message
    assert "simulated" in message and f"the pool holds {before[0].reserved_bytes} B" in message
    after = snapshot(pool, shape)
    assert after[0] == before[0] and after[1] == before[1] and after[4] == before[4]
    assert after[2] is before[2] and after[3] is before[3]
    assert int(pool.counters[MISSES_COPIED]) == 5


# --------------------------------------------------------------------------------------------------------------------
# Freeze, reserve, trim, generation


def test_frozen_pool_refuses_growth_with_reserve_hint_and_serves_reserved_shapes():
    pool = make_pool(growth="geometric")
    assert pool.reserve(batch=4, num_steps=2, top_k=8, total_ctx=16) is True
    pool.freeze()
    assert pool.frozen
    generation = pool.generation
    for shape in ((4, 2, 8, 16), (4, 1, 16, 16), (1, 2, 8, 3)):  # the reserved maxima and what fits in them
        assert pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3]) is False
        assert_views_valid(pool, *shape)
    before = pool.stats()
    for kwargs, buffer in (
        ({"batch": 5, "num_steps": 2, "top_k": 8, "total_ctx": 16}, "miss_src"),
        ({"batch": 4, "num_steps": 3, "top_k": 8, "total_ctx": 16}, "miss_src"),
        ({"batch": 4, "num_steps": 2, "top_k": 9, "total_ctx": 16}, "workspace"),
        ({"batch": 4, "num_steps": 2, "top_k": 8, "total_ctx": 17}, "k_out"),
    ):
        with pytest.raises(PoolFrozenError) as info:
            pool.ensure_capacity(**kwargs)
        message = str(info.value)
        assert "the pool is frozen" in message and f"{buffer} needs" in message
        assert "call pool.reserve(batch=" in message and "before freeze() and graph capture" in message
    with pytest.raises(PoolFrozenError, match=r"trim\(\) refused: the pool is frozen"):
        pool.trim()
    with pytest.raises(PoolFrozenError, match="k_out needs 1280 B"):
        pool.reserve(batch=4, total_ctx=20)
    assert pool.stats() == before and pool.generation == generation
    pool.unfreeze()
    assert pool.ensure_capacity(batch=5, num_steps=2, top_k=8, total_ctx=16) is True


def test_reserve_is_exact_matches_required_bytes_and_never_shrinks():
    config = PoolConfig(growth="bucketed", batch_buckets=(8, 16))
    pool = PlanBufferPool("cpu", geometry=GEOMETRY, config=config)
    maxima = {"batch": 5, "num_steps": 3, "top_k": 7, "total_ctx": 11}
    assert pool.required_bytes(**maxima) == required_bytes(config, GEOMETRY, **maxima)
    assert pool.stats().reserved_bytes == 0  # sizing allocated nothing
    pool.reserve(**maxima)
    assert pool.stats().reserved_bytes == required_bytes(config, GEOMETRY, **maxima)
    assert extent(pool, "miss_src", "batch") == 5 and extent(pool, "miss_src", "columns") == 21
    assert extent(pool, "k_out", "total_ctx") == 11
    assert pool.stats().grow_causes.reserve == 1
    generation = pool.generation
    assert pool.reserve(batch=2, top_k=4) is False
    assert pool.generation == generation and extent(pool, "k_out", "total_ctx") == 11


def test_trim_shrinks_to_last_step_or_reservation():
    pool = make_pool(growth="exact")
    pool.reserve(batch=2, top_k=4, total_ctx=8)
    pool.ensure_capacity(batch=16, num_steps=2, top_k=8, total_ctx=64)
    peak = pool.stats().reserved_bytes
    pool.ensure_capacity(batch=3, num_steps=1, top_k=8, total_ctx=4)
    generation = pool.generation
    assert pool.trim() is True
    assert pool.generation == generation + 1
    stats = pool.stats()
    assert stats.buffer("miss_src").reserved_bytes == 3 * 8 * 8  # the last step
    assert extent(pool, "k_out", "total_ctx") == 8  # the reservation, larger than the last step
    assert stats.peak_bytes == peak and stats.buffer("k_out").peak_bytes == 64 * 32 * 2
    assert stats.trim_events == 1 and stats.grow_events == 2
    assert_views_valid(pool, 3, 1, 8, 4)
    assert pool.trim() is False and pool.generation == generation + 1


def test_generation_counts_reallocations_only():
    pool = make_pool()
    assert pool.generation == 0
    pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    assert pool.generation == 1
    stale = pool.miss_plan(4, 2, 8)
    pool.ensure_capacity(batch=4, num_steps=1, top_k=16, total_ctx=8)  # re-lay, nothing reallocated
    pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    assert pool.generation == 1
    pool.ensure_capacity(batch=9, num_steps=2, top_k=8, total_ctx=16)
    assert pool.generation == 2
    fresh = pool.miss_plan(4, 2, 8)
    assert isinstance(fresh, MissPlan) and stale.generation == 1 and fresh.generation == 2
    assert fresh.src.data_ptr() != stale.src.data_ptr()


# --------------------------------------------------------------------------------------------------------------------
# Stats, counters, logging


def test_stats_schema_and_totals():
    pool = make_pool(max_bytes=1 << 20)
    pool.ensure_capacity(batch=3, num_steps=2, top_k=4, total_ctx=5)
    stats = pool.stats()
    flat = stats.as_dict()
    assert all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in flat.values())
    assert tuple(flat) == stat_keys(pool.geometry, budget=True)
    assert flat["total.budget_bytes"] == 1 << 20
    assert stats.reserved_bytes == sum(b.reserved_bytes for b in stats.buffers)
    assert flat["total.reserved_bytes.current"] == stats.reserved_bytes and flat["generation"] == 1
    assert flat["miss_src.capacity.columns"] == 8 and flat["k_out.capacity.ctx"] >= 5
    used = (flat["miss_src.used_bytes.current"], flat["k_out.used_bytes.current"])
    assert used == (3 * 8 * 8, 2 * 5 * 16 * 2)
    causes = (flat["total.grow_causes.batch"], flat["total.grow_causes.steps"], flat["total.grow_causes.top_k"])
    assert causes == (1, 1, 1)
    assert flat["counters.misses_copied"] == flat["counters.replayed_bytes"] == 0
    with pytest.raises(KeyError, match="no pool buffer named 'nope'"):
        stats.buffer("nope")


def test_counters_survive_growth_and_reset():
    pool = make_pool()
    counters = pool.counters
    assert counters.shape == (NUM_COUNTERS,) and counters.dtype == torch.int64
    pool.ensure_capacity(batch=2, top_k=4)
    counters[MISSES_COPIED] += 7
    counters[OVERFLOW] += 2
    pool.ensure_capacity(batch=64, num_steps=4, top_k=16, total_ctx=32)
    assert pool.counters is counters
    flat = pool.stats().as_dict()
    assert flat["counters.misses_copied"] == 7 and flat["counters.overflow"] == 2 and flat["counters.hits"] == 0
    pool.reset_counters()
    assert pool.stats().counters.misses_copied == 0 and pool.counters.data_ptr() == counters.data_ptr()


def test_one_info_line_per_growth_with_sizes_and_cause(caplog):
    pool = make_pool(growth="exact")
    with caplog.at_level(logging.INFO, logger="kvplan"):
        pool.ensure_capacity(batch=2, top_k=4, total_ctx=2)
        pool.ensure_capacity(batch=2, top_k=4, total_ctx=2)  # steady: no line
        pool.ensure_capacity(batch=2, num_steps=3, top_k=4, total_ctx=2)
    lines = [r for r in caplog.records if r.name == "kvplan" and r.levelno == logging.INFO]
    assert len(lines) == 2
    message = lines[1].getMessage()
    assert "cause: steps" in message and "generation 1 -> 2" in message
    assert "miss_src 2x4 64 B -> 2x12 192 B" in message and "k_out" not in message


# --------------------------------------------------------------------------------------------------------------------
# Threads


def test_two_threads_hammering_one_pool_leave_it_consistent():
    pool = make_pool(growth="geometric", growth_factor=1.5)
    shapes = {
        0: [(1, 1, 4, 2), (3, 2, 4, 5), (6, 1, 8, 9), (2, 4, 4, 1)],
        1: [(5, 1, 2, 7), (2, 3, 3, 3), (8, 2, 2, 12), (1, 1, 16, 4)],
    }
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def hammer(which: int) -> None:
        try:
            start.wait()
            for i in range(60):
                b, s, k, c = shapes[which][i % 4]
                b, c = b + i // 8, c + i // 6  # keep growing now and then
                pool.ensure_capacity(batch=b, num_steps=s, top_k=k, total_ctx=c)
                try:
                    plan = pool.miss_plan(b, s, k)
                    k_out, _ = pool.kv_out(c)
                except PoolCapacityError:
                    continue  # impossible without trim, but it would be a refusal, never a wrong view
                assert plan.src.shape == (b, s * k) and plan.count.shape == (b,)
                assert k_out.shape == (2, c, 2, 8)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    stats = pool.stats()
    assert stats.reserved_bytes == sum(b.reserved_bytes for b in stats.buffers)
    assert stats.generation == stats.grow_events
    for which in (0, 1):
        for i in range(60):
            b, s, k, c = shapes[which][i % 4]
            shape = (b + i // 8, s, k, c + i // 6)
            assert pool.ensure_capacity(batch=shape[0], num_steps=s, top_k=k, total_ctx=shape[3]) is False
            assert_views_valid(pool, *shape)


def test_geometry_is_the_one_keyword_for_the_slabs():
    """``materialize=``, the name of an unreleased 0.1, is gone: refused as any unknown keyword."""
    assert PlanBufferPool("cpu", geometry=GEOMETRY).geometry == GEOMETRY
    with pytest.raises(TypeError, match="unexpected keyword argument 'materialize'"):
        PlanBufferPool("cpu", materialize=GEOMETRY)
    with pytest.raises(TypeError, match="geometry must be a MaterializeGeometry or None, got tuple"):
        PlanBufferPool("cpu", geometry=(2, 2, 8, torch.float16))


def test_capacities_are_in_the_units_of_the_last_step():
    """Issue 22.5: a plan buffer laid out as 4 x 64 holds a padded batch of 8 at 32 columns; its batch capacity
    then reads 8 (and its columns capacity, at that batch, 32), as the Prometheus gauge does."""
    pool = make_pool(growth="exact")
    pool.ensure_capacity(batch=4, num_steps=4, top_k=16)
    before = pool.stats().as_dict()
    pool.ensure_capacity(batch=8, num_steps=2, top_k=16)  # the plan fits: the same elements, re-laid
    flat = pool.stats().as_dict()
    assert flat["miss_src.grow_events"] == before["miss_src.grow_events"]
    assert flat["miss_src.capacity.batch"] == 8 and flat["miss_src.capacity.columns"] == 32
    assert flat["miss_src.capacity.rows"] == 4 and flat["miss_src.capacity.elements"] == 256
    assert flat["miss_count.capacity.batch"] == 8


def test_a_grown_workspace_vouches_for_nothing_whatever_its_memory_held(monkeypatch):
    """New storage may be an earlier workspace's, its words vouching for tables other tensors have since written:
    the pool marks every new workspace buffer fresh (row 0's words -1, which no format word equals)."""
    pool = make_pool()
    allocate = pool._allocate

    def recycled(numel, dtype):
        storage = allocate(numel, dtype)
        storage.fill_(0x1234_5678_1234_5678 if dtype == torch.int64 else 0)  # words that could pass for anything
        return storage

    monkeypatch.setattr(pool, "_allocate", recycled)
    for batch, steps, top_k in ((2, 1, 8), (4, 2, 8)):
        pool.ensure_capacity(batch=batch, num_steps=steps, top_k=top_k)
        words = pool.workspace(batch, steps, top_k).view(torch.int32)
        assert words[0, :8].tolist() == [-1] * 8
        assert words[1, :8].tolist() == [0x1234_5678] * 8  # only row 0 is written: it speaks for every row
