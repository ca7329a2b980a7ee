"""Property tests: random step sequences under every growth policy keep the pool's contract after each step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan import (
    MaterializeGeometry,
    PlanBufferPool,
    PoolBudgetError,
    PoolConfig,
    check_materialize,
    check_miss_plan,
    check_spec_miss_plan,
    required_bytes,
)
from kvplan.stats import stat_keys
from kvplan.workspace import swap_in_workspace_columns

GEOMETRY = MaterializeGeometry(n_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16)
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

configs = st.one_of(
    st.just(PoolConfig(growth="exact")),
    st.sampled_from([1.25, 1.5, 2.0, 3.0]).map(lambda f: PoolConfig(growth="geometric", growth_factor=f)),
    st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.sampled_from([1.5, 2.0])).map(
        lambda bf: PoolConfig(growth="bucketed", batch_buckets=bf[0], growth_factor=bf[1])
    ),
)
geometries = st.sampled_from([None, GEOMETRY])
step_shapes = st.tuples(st.integers(0, 48), st.integers(1, 4), st.integers(0, 12), st.integers(0, 40))


def shape_for(geometry, shape):
    batch, num_steps, top_k, total_ctx = shape
    return batch, num_steps, top_k, total_ctx if geometry is not None else 0


def needs(geometry, batch, num_steps, top_k, total_ctx) -> dict[str, tuple[int, int]]:
    """Per buffer: (rows, cols) the step needs, in the units the stats report capacity in."""
    out = {
        "miss_src": (batch, num_steps * top_k),
        "miss_dst": (batch, num_steps * top_k),
        "miss_count": (batch, 1),
        "workspace": (batch, swap_in_workspace_columns(num_steps, top_k)),
    }
    if geometry is not None:
        out["k_out"] = out["v_out"] = (total_ctx, geometry.elements_per_token)
    return out


def check_views(pool: PlanBufferPool, batch, num_steps, top_k, total_ctx) -> None:
    plan = pool.miss_plan(batch, num_steps, top_k)
    assert plan.src.shape == plan.dst.shape == (batch, num_steps * top_k) and plan.count.shape == (batch,)
    check_spec_miss_plan(torch.empty(batch, num_steps, top_k, dtype=torch.int32), plan.src, plan.dst, plan.count)
    if num_steps == 1:
        check_miss_plan(torch.empty(batch, top_k, dtype=torch.int32), plan.src, plan.dst, plan.count)
    assert pool.workspace(batch, num_steps, top_k).shape == (batch, swap_in_workspace_columns(num_steps, top_k))
    g = pool.geometry
    if g is not None:
        k_out, v_out = pool.kv_out(total_ctx)
        kv = torch.empty(total_ctx, g.n_layers, 2 * g.num_kv_heads * g.head_dim, dtype=g.dtype)
        weight, eps = torch.ones(g.n_layers, g.head_dim), torch.ones(g.n_layers)
        positions = torch.zeros(total_ctx, dtype=torch.int64)
        cos_sin = torch.zeros(1, g.head_dim)
        check_materialize(kv, weight, eps, cos_sin, positions, g.num_kv_heads, g.head_dim, g.head_dim, k_out, v_out)


def rows_rule_holds(config: PoolConfig, kind: str, old: int, new: int, need: int) -> bool:
    """The growth policy's promise for one dimension that grew from ``old`` to ``new`` for a request of ``need``."""
    if config.growth == "exact" or kind == "fixed":
        return new == need
    if kind == "batch" and config.growth == "bucketed" and need <= config.batch_buckets[-1]:
        return new == min(b for b in config.batch_buckets if b >= need)
    return new >= need and new >= math.ceil(old * config.growth_factor)


def _extents(flat: dict[str, int], name: str) -> tuple[int, int]:
    """A buffer's layout ``(rows, cols)`` from its stats (capacities are in step units; ``rows`` is the layout's)."""
    rows, elements = flat[f"{name}.capacity.rows"], flat[f"{name}.capacity.elements"]
    return rows, (elements // rows if rows else 0)


def without_used(flat: dict[str, int]) -> dict[str, int]:
    """What no step that fits may change: everything but the bytes the step uses and the capacities in step units
    (``batch`` at the step's columns, ``columns`` at its batch); ``rows`` and ``elements`` stay."""
    step_units = (".used_bytes.", ".capacity.batch", ".capacity.columns")
    return {k: v for k, v in flat.items() if not any(part in k for part in step_units)}


@PROPERTY_SETTINGS
@given(config=configs, geometry=geometries, steps=st.lists(step_shapes, min_size=1, max_size=10))
def test_random_step_sequences_keep_the_contract(config, geometry, steps):
    pool = PlanBufferPool("cpu", geometry=geometry, config=config)
    maxima = [0, 1, 0, 0]
    previous = pool.stats().as_dict()
    for raw in steps:
        shape = shape_for(geometry, raw)
        maxima = [max(m, v) for m, v in zip(maxima, shape)]
        wanted = needs(geometry, *shape)
        fitted = all(r * c <= previous[f"{name}.capacity.elements"] for name, (r, c) in wanted.items())

        grew = pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3])

        stats = pool.stats()
        flat = stats.as_dict()
        assert grew is not fitted  # growth exactly when something did not fit
        assert flat["generation"] == previous["generation"] + int(grew)
        if not grew:  # nothing moved: capacities, bytes, peaks, events (only what the step uses changes)
            assert without_used(flat) == without_used(previous)
        for name, (rows, cols) in wanted.items():
            assert rows * cols <= flat[f"{name}.capacity.elements"]
            assert flat[f"{name}.reserved_bytes.peak"] >= previous[f"{name}.reserved_bytes.peak"]
            if flat[f"{name}.capacity.elements"] != previous[f"{name}.capacity.elements"]:
                # the growth policy's rule on the layout's own extents: rows as laid out, columns = elements / rows
                extents = {key: _extents(f, name) for key, f in (("new", flat), ("old", previous))}
                kind = "batch" if f"{name}.capacity.batch" in flat else "total_ctx"
                for index, dim in enumerate((kind, "columns")):
                    if dim == "columns" and f"{name}.capacity.columns" not in flat:
                        continue
                    old, new = extents["old"][index], extents["new"][index]
                    if new != old:
                        need = (rows, cols)[index]
                        assert rows_rule_holds(config, dim, old, new, need), (name, dim, need)
        assert stats.peak_bytes >= previous["total.reserved_bytes.peak"]
        assert stats.reserved_bytes == sum(b.reserved_bytes for b in stats.buffers)
        assert stats.reserved_bytes <= stats.peak_bytes
        assert all(isinstance(v, int) and v >= 0 for v in flat.values())
        assert tuple(flat) == stat_keys(geometry, budget=config.max_bytes is not None)
        bound = required_bytes(
            config,
            geometry,
            batch=maxima[0],
            num_steps=maxima[1],
            top_k=maxima[2],
            total_ctx=maxima[3],
            worst_case_growth=True,
        )
        assert stats.reserved_bytes <= bound
        check_views(pool, *shape)
        previous = flat


@PROPERTY_SETTINGS
@given(config=configs, geometry=geometries, maxima=step_shapes, probes=st.lists(step_shapes, max_size=5))
def test_required_bytes_is_what_reserve_reserves_and_frozen_reserved_pools_serve_every_fitting_step(
    config, geometry, maxima, probes
):
    maxima = shape_for(geometry, maxima)
    kwargs = dict(zip(("batch", "num_steps", "top_k", "total_ctx"), maxima))
    expected = required_bytes(config, geometry, **kwargs)
    pool = PlanBufferPool("cpu", geometry=geometry, config=config)
    assert pool.stats().reserved_bytes == 0
    pool.reserve(**kwargs)
    assert pool.stats().reserved_bytes == expected == pool.required_bytes(**kwargs)
    assert expected <= required_bytes(config, geometry, **kwargs, worst_case_growth=True)
    pool.freeze()
    generation = pool.generation
    for probe in probes:
        shape = tuple(min(p, m) if i != 1 else max(1, min(p, m)) for i, (p, m) in enumerate(zip(probe, maxima)))
        assert pool.ensure_capacity(batch=shape[0], num_steps=shape[1], top_k=shape[2], total_ctx=shape[3]) is False
        check_views(pool, *shape)
    assert pool.generation == generation


@PROPERTY_SETTINGS
@given(
    config=configs,
    budget=st.integers(0, 4096),
    steps=st.lists(step_shapes.map(lambda s: (s[0], s[1], s[2], 0)), min_size=1, max_size=8),
)
def test_budget_is_never_exceeded_and_refusals_change_nothing(config, budget, steps):
    config = PoolConfig(
        growth=config.growth, growth_factor=config.growth_factor, batch_buckets=config.batch_buckets, max_bytes=budget
    )
    pool = PlanBufferPool("cpu", config=config)
    for shape in steps:
        before = pool.stats()
        kwargs = dict(zip(("batch", "num_steps", "top_k", "total_ctx"), shape))
        try:
            pool.ensure_capacity(**kwargs)
        except PoolBudgetError as exc:
            assert pool.stats() == before
            assert f"max_bytes={budget}" in str(exc)
            # refused only when even exact sizes (no policy rounding) of the buffers that must grow exceed the budget
            assert exact_growth_total(before.as_dict(), needs(None, *shape)) > budget
            continue
        assert pool.stats().reserved_bytes <= budget
        check_views(pool, *shape)


ITEMSIZE = {"miss_src": 8, "miss_dst": 4, "miss_count": 4, "workspace": 8}


def exact_growth_total(flat: dict[str, int], wanted: dict[str, tuple[int, int]]) -> int:
    """Reserved bytes after growing, without rounding, only the dimensions of the buffers that are too small."""
    total = flat["total.reserved_bytes.current"]
    for name, (rows, cols) in wanted.items():
        if rows * cols <= flat[f"{name}.capacity.elements"]:
            continue
        old_cols = flat.get(f"{name}.capacity.columns", 1)
        new = max(rows, flat[f"{name}.capacity.batch"]) * max(cols, old_cols)
        total += (new - flat[f"{name}.capacity.elements"]) * ITEMSIZE[name]
    return total


@pytest.mark.parametrize("growth", ["exact", "geometric"])
def test_worst_case_bound_is_reached_by_a_growing_sequence(growth):
    """The bound is tight for one dimension: growing to max - 1 then max lands on ceil((max - 1) * factor)."""
    config = PoolConfig(growth=growth)
    pool = PlanBufferPool("cpu", config=config)
    pool.ensure_capacity(batch=9)
    pool.ensure_capacity(batch=10)
    assert pool.stats().buffer("miss_count").reserved_bytes == 4 * (10 if growth == "exact" else 18)
    bound = required_bytes(config, None, batch=10, worst_case_growth=True)
    assert pool.stats().reserved_bytes == bound
