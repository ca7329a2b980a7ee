"""Hostile use of PlanBufferPool: a hypothesis state machine drives random growth, reservations, budgets, injected
allocation failures, freeze, trim and views kept across growth, with sizes past int64, NumPy ints and wrong types
mixed in; the pool's invariants are checked after every operation, and every refusal must leave it exactly as it was.
The issue's examples (sizes past int64, an absurd growth factor, NumPy ints on the fast path, a draft model of
another geometry) are pinned down as plain tests below.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvplan.arena
import kvplan.pool
from kvplan import (
    MaterializeGeometry,
    PlanBufferPool,
    PoolBudgetError,
    PoolCapacityError,
    PoolConfig,
    PoolFrozenError,
    check_spec_miss_plan,
    required_bytes,
)
from kvplan.config import MAX_TENSOR_BYTES
from kvplan.errors import NotAnIntError
from kvplan.workspace import swap_in_workspace_columns

GEOMETRY = MaterializeGeometry(n_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16)

configs = st.one_of(
    st.builds(PoolConfig, growth=st.just("exact"), max_bytes=st.one_of(st.none(), st.integers(0, 400_000))),
    st.builds(
        PoolConfig,
        growth=st.just("geometric"),
        growth_factor=st.sampled_from([1.25, 2.0, 1e300]),
        max_bytes=st.one_of(st.none(), st.integers(0, 400_000)),
    ),
    st.builds(
        PoolConfig,
        growth=st.just("bucketed"),
        batch_buckets=st.lists(st.integers(1, 40), min_size=1, max_size=4),
        growth_factor=st.sampled_from([1.5, 1e300]),
    ),
)
small = st.integers(0, 40)
sizes = st.one_of(
    small,
    small.map(np.int64),
    small.map(np.int32),
    # any non-zero buffer with one of these extents passes 2^63 bytes: refused before allocating, never allocated
    st.sampled_from([2**62, 2**63, 2**64, 10**30]),
    st.integers(-3, -1),
    st.sampled_from([True, 2.0, "4", None]),
)
steps = st.one_of(st.integers(1, 4), st.integers(1, 4).map(np.int16), st.sampled_from([0, 2**62, 2**63]))


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _expected_error(pool: PlanBufferPool, batch, num_steps, top_k, total_ctx) -> type | None:
    """The argument error a request must get (None: the request is valid and may only fail on growth)."""
    values = (batch, num_steps, top_k, total_ctx)
    if not all(_is_int(v) for v in values):
        return NotAnIntError  # (a TypeError and a ValueError: the one rule of docs/errors.md)
    batch, num_steps, top_k, total_ctx = (int(v) for v in values)
    if batch < 0 or num_steps < 1 or top_k < 0 or total_ctx < 0:
        return ValueError
    if total_ctx > 0 and pool.geometry is None:
        return ValueError
    return None


class PoolMachine(RuleBasedStateMachine):
    """A model of what the pool must report: generation, frozen, the last request that fitted."""

    @initialize(config=configs, with_geometry=st.booleans())
    def build(self, config, with_geometry):
        self.pool = PlanBufferPool("cpu", geometry=GEOMETRY if with_geometry else None, config=config)
        self.generation = 0
        self.frozen = False
        self.last = None  # (batch, num_steps, top_k, total_ctx) of the last ensure_capacity that succeeded
        self.fail_in = None  # allocations left before an injected failure
        self.failure: BaseException | None = None
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (view, the values written into it)
        allocate = self.pool._allocate

        def flaky_allocate(numel, dtype):
            if self.fail_in is not None:
                if self.fail_in == 0:
                    self.fail_in = None
                    raise self.failure
                self.fail_in -= 1
            return allocate(numel, dtype)

        self.pool._allocate = flaky_allocate

    def snapshot(self):
        pool = self.pool
        stats = pool.stats().as_dict()
        pointers = tuple(b.storage.data_ptr() for b in pool._gen.buffers.values())
        return pool.generation, pool.frozen, stats, pointers, pool._last

    def _grow_call(self, call, batch, num_steps, top_k, total_ctx):
        expected = _expected_error(self.pool, batch, num_steps, top_k, total_ctx)
        before = self.snapshot()
        injected = self.fail_in is not None
        try:
            grew = getattr(self.pool, call)(batch=batch, num_steps=num_steps, top_k=top_k, total_ctx=total_ctx)
        except (TypeError, ValueError, PoolBudgetError, PoolFrozenError) as exc:
            assert self.snapshot() == before, f"{call} raised {exc!r} and changed the pool"
            if expected is not None:
                assert type(exc) is expected, exc
            elif self.frozen and "more than a tensor can hold" not in str(exc):  # (sizes no tensor has: any pool)
                assert isinstance(exc, PoolFrozenError), exc
            else:
                assert isinstance(exc, PoolBudgetError), exc
                too_large = "more than a tensor can hold" in str(exc)
                assert too_large or injected or self.pool.config.max_bytes is not None, exc
            assert call in str(exc) or isinstance(exc, (TypeError, ValueError)), exc
            return
        assert expected is None, f"{call}({batch}, {num_steps}, {top_k}, {total_ctx}) was accepted"
        assert isinstance(grew, bool)
        self.generation += int(grew)
        if not grew:
            assert self.snapshot()[3] == before[3]  # nothing moved
        if call == "ensure_capacity":
            self.last = tuple(int(v) for v in (batch, num_steps, top_k, total_ctx))

    @rule(batch=sizes, num_steps=steps, top_k=sizes, total_ctx=sizes)
    def ensure(self, batch, num_steps, top_k, total_ctx):
        self._grow_call("ensure_capacity", batch, num_steps, top_k, total_ctx)

    @rule(batch=small, num_steps=st.integers(1, 4), top_k=small, total_ctx=small)
    def ensure_valid(self, batch, num_steps, top_k, total_ctx):
        self._grow_call("ensure_capacity", batch, num_steps, top_k, total_ctx if self.pool.geometry else 0)

    @rule(batch=sizes, num_steps=steps, top_k=sizes, total_ctx=sizes)
    def reserve(self, batch, num_steps, top_k, total_ctx):
        self._grow_call("reserve", batch, num_steps, top_k, total_ctx)

    @rule()
    def trim(self):
        before = self.snapshot()
        try:
            shrank = self.pool.trim()
        except (PoolFrozenError, PoolBudgetError) as exc:
            assert self.snapshot() == before
            assert isinstance(exc, PoolFrozenError) == self.frozen, exc
            return
        assert not self.frozen
        self.generation += int(shrank)

    @rule()
    def freeze(self):
        self.pool.freeze()
        self.frozen = True

    @rule()
    def unfreeze(self):
        self.pool.unfreeze()
        self.frozen = False

    @rule(after=st.integers(0, 2), kind=st.sampled_from(["oom", "memory", "overflow"]))
    def inject_allocation_failure(self, after, kind):
        self.fail_in = after
        self.failure = {
            "oom": RuntimeError("CUDA out of memory (injected)"),
            "memory": MemoryError("injected"),
            "overflow": OverflowError("injected"),
        }[kind]

    @precondition(lambda self: self.last is not None)
    @rule(value=st.integers(-(2**31), 2**31 - 1))
    def write_views(self, value):
        """Write into the views of the last step; no later pool operation may touch those values."""
        batch, num_steps, top_k, total_ctx = self.last
        plan = self.pool.miss_plan(batch, num_steps, top_k)
        views = [plan.src, plan.dst, plan.count, self.pool.workspace(batch, num_steps, top_k)]
        if self.pool.geometry is not None:
            views += list(self.pool.kv_out(total_ctx))
        self.kept = []
        for i, view in enumerate(views):
            view.fill_(value % 1000 + i)
            self.kept.append((view, view.clone()))
        self.kept_generation = self.pool.generation
        self.kept_plan = plan

    @precondition(lambda self: bool(self.kept))
    @rule()
    def replay_kept_plan(self):
        """A plan from an older generation is refused by replay before anything is launched."""
        if self.kept_generation == self.pool.generation:
            return
        rows = torch.zeros(4, 2)
        with pytest.raises(PoolCapacityError, match="the plan is from generation"):
            self.pool.replay(self.kept_plan, host_cache=rows, device_buffer=rows.clone())

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        stats = pool.stats()
        flat = stats.as_dict()
        assert all(type(v) is int and v >= 0 for v in flat.values()), flat
        assert stats.generation == pool.generation == self.generation
        assert stats.frozen == pool.frozen == self.frozen
        assert stats.reserved_bytes == sum(b.reserved_bytes for b in stats.buffers)
        assert all(b.reserved_bytes <= MAX_TENSOR_BYTES for b in stats.buffers)
        if pool.config.max_bytes is not None:
            assert stats.reserved_bytes <= pool.config.max_bytes
        for view, values in self.kept:
            assert torch.equal(view, values), "a pool operation wrote into a step's views"
        if self.last is not None:  # the last step's shapes are still served, exactly
            batch, num_steps, top_k, total_ctx = self.last
            plan = pool.miss_plan(batch, num_steps, top_k)
            assert plan.src.shape == (batch, num_steps * top_k) and plan.count.shape == (batch,)
            tokens = torch.empty(batch, num_steps, top_k, dtype=torch.int32)
            check_spec_miss_plan(tokens, plan.src, plan.dst, plan.count)
            workspace = pool.workspace(batch, num_steps, top_k)
            assert workspace.shape == (batch, swap_in_workspace_columns(num_steps, top_k))
            if pool.geometry is not None:
                k_out, v_out = pool.kv_out(total_ctx)
                assert k_out.shape == v_out.shape == (2, total_ctx, 1, 4)


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------------------------------------------------------------
# The examples


def _state_of(pool: PlanBufferPool):
    return pool.generation, pool.stats().as_dict(), tuple(b.storage.data_ptr() for b in pool._gen.buffers.values())


@pytest.mark.parametrize(
    "request_",
    [
        dict(batch=2**63),
        dict(batch=1, num_steps=2**40, top_k=2**40),
        dict(batch=2**40, top_k=2**20),  # 2^63 bytes of miss_src exactly: one byte past what a tensor holds
    ],
)
@pytest.mark.parametrize("call", ["ensure_capacity", "reserve"])
def test_sizes_past_int64_are_budget_errors_and_change_nothing(request_, call):
    pool = PlanBufferPool("cpu")
    pool.ensure_capacity(batch=2, top_k=4)
    before = _state_of(pool)
    with pytest.raises(PoolBudgetError, match=rf"^{call}\(.*\) would need \w+ of .* more than a tensor can hold"):
        getattr(pool, call)(**request_)
    assert _state_of(pool) == before
    assert pool.ensure_capacity(batch=2, top_k=4) is False  # still serves what it held


def test_an_absurd_growth_factor_fails_its_second_growth_with_a_budget_error():
    pool = PlanBufferPool("cpu", config=PoolConfig(growth_factor=1e300))
    pool.ensure_capacity(batch=2, top_k=4)  # first growth: from nothing, the request itself
    before = _state_of(pool)
    with pytest.raises(PoolBudgetError, match=r"would need miss_src of \d\.\d{3}E\+\d+ B .* lower the step's maxima"):
        pool.ensure_capacity(batch=3, top_k=4)
    assert _state_of(pool) == before


def test_worst_case_growth_bytes_are_exact_for_any_factor():
    """required_bytes(worst_case_growth=True) with a factor of 1e300: the exact (astronomic) bound, no OverflowError."""
    factor = Fraction(1e300)

    def worst(n: int) -> int:  # the most a geometric dimension reaches while requests stay <= n
        return max(n, math.ceil((n - 1) * factor))

    batch, top_k = 10**10, 4
    rows, columns, workspace = worst(batch), worst(top_k), worst(swap_in_workspace_columns(1, top_k))
    expected = rows * columns * 8 + rows * columns * 4 + rows * 4 + rows * workspace * 8
    got = required_bytes(PoolConfig(growth_factor=1e300), batch=batch, top_k=top_k, worst_case_growth=True)
    assert isinstance(got, int) and got == expected > 10**600


def test_numpy_ints_take_the_steady_state_fast_path(monkeypatch):
    geometry = MaterializeGeometry(1, 1, 4, torch.float32)
    pool = PlanBufferPool("cpu", geometry=geometry)
    pool.ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    plan, workspace, kv = pool.miss_plan(4, 2, 8), pool.workspace(4, 2, 8), pool.kv_out(16)

    def slow(*args, **kwargs):
        raise AssertionError("the slow path ran for a shape the pool already serves")

    monkeypatch.setattr(pool, "_ensure_slow", slow)
    monkeypatch.setattr(kvplan.arena, "check_request", slow)
    monkeypatch.setattr(kvplan.pool, "check_request", slow)
    for cast in (np.int64, np.int32, np.uint16, int):
        assert pool.ensure_capacity(batch=cast(4), num_steps=cast(2), top_k=cast(8), total_ctx=cast(16)) is False
        assert all(type(v) is int for v in pool._last)  # the remembered request stays plain ints
        assert pool.miss_plan(cast(4), cast(2), cast(8)) is plan
        assert pool.workspace(cast(4), cast(2), cast(8)) is workspace
        assert pool.kv_out(cast(16)) == kv


@pytest.mark.parametrize("bad", [True, 4.0, torch.tensor(4)])
def test_values_equal_to_a_cached_shape_still_need_the_right_type(bad):
    pool = PlanBufferPool("cpu")
    pool.ensure_capacity(batch=4, top_k=1)
    with pytest.raises(NotAnIntError, match="ensure_capacity: batch must be an int"):
        pool.ensure_capacity(batch=bad if not isinstance(bad, bool) else bad, top_k=1)


@pytest.mark.parametrize(
    ("kv_shape", "dtype"),
    [((3, 1, 16), torch.float32), ((3, 2, 16), torch.float64), ((0, 1, 16), torch.float32)],
    ids=["layers", "dtype", "no-tokens-layers"],
)
def test_pool_materialize_names_its_geometry_for_a_kv_of_another_model(kv_shape, dtype):
    geometry = MaterializeGeometry(2, 2, 4, torch.float32)
    pool = PlanBufferPool("cpu", geometry=geometry)
    pool.ensure_capacity(batch=1, total_ctx=3)
    kv = torch.zeros(kv_shape, dtype=dtype)
    weight, eps = torch.ones(kv_shape[1], 4), torch.full((kv_shape[1],), 1e-6)
    with pytest.raises(ValueError, match=r"pool\.materialize: kv must be \[total_ctx, 2, 16\] torch.float32 on cpu"):
        pool.materialize(kv, weight, eps, torch.zeros(4, 4), torch.zeros(kv_shape[0], dtype=torch.int64), rotary_dim=4)
