"""Issue 20, third pass: hostile use of the pool's plan replay, reservations and budget, the hot-buffer state, the
miss plan, the draft materializer and the metrics collector. One test (or one parametrized group) per class of the
issue, its example included; every refusal names the argument and leaves everything as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pool_steps import _run, _setup

from kvplan import (
    HotBufferState,
    MaterializeGeometry,
    MissPlan,
    PlanBufferPool,
    PoolBudgetError,
    PoolCapacityError,
    PoolConfig,
    reference,
    required_bytes,
)
from kvplan.counters import read_counters
from kvplan.materializer import FusedKVMaterializer

# ---------------------------------------------------------------------------------------------------------------------
# (4) replay of a plan whose rows a swap-in of another shape overwrote


def _swap_in_inputs(device, steps: int, seed: int = 0) -> dict:
    """A batch-2, top_k-4 swap-in's keyword arguments (state included), ``steps`` > 1 speculative."""
    state, host, dev, tokens, rids, seq_lens = _setup(device, steps=steps, seed=seed)
    return _run(None, state, host, dev, tokens, rids, seq_lens, spec=steps > 1)[1]


def test_replay_refuses_a_plan_a_swap_in_of_another_shape_overwrote(device):
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    single = pool.swap_in(**_swap_in_inputs(device, steps=1))  # [2, 4]
    spec_kwargs = _swap_in_inputs(device, steps=2, seed=1)
    spec = pool.swap_in(**spec_kwargs)  # [2, 8]: the same storage, laid out otherwise
    assert single.generation == spec.generation == pool.generation and spec.count.sum() > 0

    host = spec_kwargs["host_cache"] + 5
    layer_dev = torch.full_like(spec_kwargs["device_buffer"], -3)
    before = read_counters(pool.counters)
    with pytest.raises(PoolCapacityError, match=r"pool.replay: the plan \(\[2, 4\]\).* of \[2, 8\] overwrote it"):
        pool.replay(single, host_cache=host, device_buffer=layer_dev)
    assert (layer_dev == -3).all() and read_counters(pool.counters) == before  # nothing launched

    pool.replay(spec, host_cache=host, device_buffer=layer_dev)  # this step's plan replays
    want = torch.full_like(layer_dev, -3)
    reference.copy_planned(spec, host, want, num_real_reqs=None)
    assert torch.equal(layer_dev, want)


def test_replay_accepts_the_plans_of_the_layout_last_written_and_refuses_others():
    pool = PlanBufferPool("cpu")
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    rows = torch.zeros(4, 2)
    two_by_eight = pool.miss_plan(2, 2, 4)
    two_by_eight.count.zero_()
    same_layout = pool.miss_plan(2, 1, 8)  # [2, 8] too: the same views of the same storage
    pool.replay(two_by_eight, host_cache=rows, device_buffer=rows.clone())
    pool.replay(same_layout, host_cache=rows, device_buffer=rows.clone())
    other = pool.miss_plan(1, 1, 8)  # handing out a view of another layout counts as writing it
    with pytest.raises(PoolCapacityError, match=r"\[2, 8\].*\[1, 8\]"):
        pool.replay(two_by_eight, host_cache=rows, device_buffer=rows.clone())
    other.count.zero_()
    pool.replay(other, host_cache=rows, device_buffer=rows.clone())
    # a caller-owned plan claiming the pool's generation is not the pool's plan
    own = MissPlan(other.src.clone(), other.dst.clone(), other.count.clone(), generation=pool.generation)
    with pytest.raises(PoolCapacityError, match="pool.replay: "):
        pool.replay(own, host_cache=rows, device_buffer=rows.clone())


# ---------------------------------------------------------------------------------------------------------------------
# (7) FusedKVMaterializer growth is all or nothing


def _materializer(**kwargs) -> FusedKVMaterializer:
    torch.manual_seed(0)
    layers, heads, dim, hidden = 2, 1, 4, 8
    return FusedKVMaterializer(
        torch.randn(layers, 2 * heads * dim, hidden),
        torch.rand(layers, dim) + 0.5,
        kwargs.pop("eps", 1e-6),
        torch.randn(32, dim),
        num_kv_heads=kwargs.pop("num_kv_heads", heads),
        head_dim=kwargs.pop("head_dim", dim),
        rotary_dim=kwargs.pop("rotary_dim", dim),
        **kwargs,
    )


def test_a_failed_materializer_growth_leaves_it_usable(monkeypatch):
    mat, fresh = _materializer(), _materializer()
    mat.materialize(torch.randn(2, 8), torch.arange(2))  # holds 2 tokens
    before = _held(mat)
    empty, calls = torch.empty, []

    def failing_third_buffer(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:  # its pool's K slab, V slab, then the projection
            raise torch.OutOfMemoryError("injected: kv_proj")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_third_buffer)
    hidden, positions = torch.randn(3, 8), torch.arange(3) + 4
    with pytest.raises(PoolBudgetError, match=r"materialize\(\) of 3 tokens: .*could not allocate kv_proj") as info:
        mat.materialize(hidden, positions)
    monkeypatch.setattr(torch, "empty", empty)
    assert isinstance(info.value.__cause__.__cause__, torch.OutOfMemoryError)  # the pool's refusal, then the OOM
    assert len(calls) == 3 and _held(mat) == before  # nothing half-grown
    k, v = mat.materialize(hidden, positions)  # T between the old and the new size: the retry grows and works
    want_k, want_v = fresh.materialize(hidden, positions)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert mat.materialize(torch.randn(4, 8), torch.arange(4))[1].shape == (2, 4, 1, 4)


def _held(mat: FusedKVMaterializer) -> tuple:
    """What the materializer holds: its capacity, its pool's generation and the addresses of the projection and
    the slabs (the pool's buffers at capacity)."""
    tokens = mat.capacity_tokens
    k_out, v_out = mat.pool.kv_out(tokens)
    return tokens, mat.pool.generation, mat.pool.kv_proj(tokens).data_ptr(), k_out.data_ptr(), v_out.data_ptr()


# ---------------------------------------------------------------------------------------------------------------------
# (8) the budget's exact-size fallback retries at exactly the requested sizes


def test_budget_fallback_takes_exactly_the_requested_rows_and_columns():
    # what (8, 4) takes, plus miss_src (int64) and miss_dst (int32) grown from [8, 4] to exactly [1, 64]; the
    # policy's [8, 64] passes it (the workspace's [8, ...] rows already hold a [1, ...] one)
    budget = required_bytes(batch=8, top_k=4) + (64 - 32) * (8 + 4)
    pool = PlanBufferPool("cpu", config=PoolConfig(growth="geometric", max_bytes=budget))
    pool.ensure_capacity(batch=8, top_k=4)
    assert pool.ensure_capacity(batch=1, top_k=64)
    stats = pool.stats()
    assert dict(stats.buffer("miss_src").capacity) == {"batch": 1, "columns": 64, "rows": 1, "elements": 64}
    assert stats.reserved_bytes <= budget
    assert not pool.ensure_capacity(batch=8, top_k=4)  # 32 elements: still fits, re-laid over the 64
    with pytest.raises(PoolBudgetError, match="over its byte budget"):  # exact sizes past the budget still fail
        pool.ensure_capacity(batch=2, top_k=64)


# ---------------------------------------------------------------------------------------------------------------------
# (9) device rows past int32 are refused before anything is allocated


@pytest.mark.parametrize(
    ("sizes", "rows"),
    [
        (dict(num_reqs=2**26 + 1, hot=16, tail=16), (2**26 + 1) * 32),
        (dict(num_reqs=2**25, hot=16, tail=16, scratch=33), 2**25 * 65),
    ],
)
def test_device_rows_past_int32_are_refused_before_allocating(monkeypatch, sizes, rows):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before refusing")

    for name in ("arange", "full", "empty", "zeros"):
        monkeypatch.setattr(torch, name, no_allocation)
    with pytest.raises(ValueError, match=rf"at most 2147483648 device rows .*= {rows} device rows"):
        HotBufferState.allocate(max_len=4, **sizes)


def test_device_rows_up_to_int32_are_stored_exactly():
    state = HotBufferState.allocate(num_reqs=3, hot=2, tail=1, max_len=4, scratch=1)
    assert state.device_buffer_locs[-1, -1] == 8 and state.scratch_locs[-1, -1] == state.device_rows - 1


# ---------------------------------------------------------------------------------------------------------------------
# (10) one PoolCollector per registry


def test_a_second_collector_or_registration_with_the_same_series_is_refused():
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from kvplan.metrics import PoolCollector

    registry = CollectorRegistry()
    first = PoolCollector(PlanBufferPool("cpu"), worker="0")
    registry.register(first)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(PoolCollector(PlanBufferPool("cpu"), worker="0"))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(first)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE kvplan_pool_generation gauge") == 1
    assert text.count('kvplan_pool_generation{worker="0"}') == 1


# ---------------------------------------------------------------------------------------------------------------------
# (11) reservations combine


def test_reservations_combine_into_their_elementwise_maximum():
    pool = PlanBufferPool("cpu")
    pool.reserve(batch=64, top_k=1)
    pool.reserve(batch=1, num_steps=4, top_k=16)
    pool.freeze()
    assert not pool.ensure_capacity(batch=64, num_steps=4, top_k=16)
    assert pool.miss_plan(64, 4, 16).src.shape == (64, 64)
    pool.unfreeze()
    assert not pool.trim()  # never below what was reserved
    assert pool.stats().reserved_bytes == required_bytes(batch=64, num_steps=4, top_k=16)


def test_a_refused_reservation_changes_nothing():
    pool = PlanBufferPool("cpu", config=PoolConfig(max_bytes=required_bytes(batch=64, top_k=1)))
    pool.reserve(batch=64, top_k=1)
    with pytest.raises(PoolBudgetError, match=r"reserve\(batch=1, num_steps=4, top_k=16, total_ctx=0\).*64"):
        pool.reserve(batch=1, num_steps=4, top_k=16)
    assert pool._reserved == (64, 1, 1, 0)


# ---------------------------------------------------------------------------------------------------------------------
# (12) NumPy scalars wherever an int or a float is taken


def test_numpy_scalars_are_taken_as_ints_and_floats():
    config = PoolConfig(growth_factor=np.float32(1.5), max_bytes=np.int64(1 << 20))
    assert (config.growth_factor, config.max_bytes) == (1.5, 1 << 20) and type(config.max_bytes) is int
    buckets = PoolConfig(growth="bucketed", batch_buckets=np.array([4, 1, 2]))
    assert buckets.batch_buckets == (1, 2, 4) and all(type(b) is int for b in buckets.batch_buckets)
    geometry = MaterializeGeometry(np.int64(2), np.int32(1), np.int16(4), torch.float32)
    assert geometry == MaterializeGeometry(2, 1, 4, torch.float32) and type(geometry.n_layers) is int

    state = HotBufferState.allocate(np.int64(2), np.int32(4), np.int64(2), np.int64(8), scratch=np.int8(1))
    assert state.device_rows == 14
    state.set_host_rows(np.int64(1), np.array([5, 6, 7]))
    assert state.host_cache_locs[1, :4].tolist() == [5, 6, 7, -1]
    state.write_tail(0, [np.int32(3), np.int64(4)])
    state.fill_short(np.int64(0), np.int64(2), np.array([1, 2], dtype=np.uint8))
    assert state.host_cache_locs[0, :3].tolist() == [1, 2, -1]

    mat = _materializer(eps=np.float32(1e-6), max_position_hint=np.int64(32), num_kv_heads=np.int64(1))
    mat.reserve(np.int64(4))
    assert mat.capacity_tokens == 4 and type(mat.max_position_hint) is int
    assert torch.allclose(mat.eps, torch.full((2,), 1e-6))
    assert torch.allclose(_materializer(eps=[np.float64(1e-5), np.float32(1e-6)]).eps, torch.tensor([1e-5, 1e-6]))


@pytest.mark.parametrize(
    ("build", "error", "text"),
    [
        (lambda: PoolConfig(max_bytes=True), TypeError, "PoolConfig.max_bytes must be an int or None, got bool"),
        (lambda: PoolConfig(max_bytes=np.bool_(True)), TypeError, "PoolConfig.max_bytes must be an int or None"),
        (lambda: PoolConfig(growth_factor=True), TypeError, "PoolConfig.growth_factor must be a float, got bool"),
        (lambda: PoolConfig(growth="bucketed", batch_buckets=[np.bool_(1)]), TypeError, "must hold ints"),
        (lambda: HotBufferState.allocate(True, 4, 2, 8), ValueError, "num_reqs must be an int >= 1, got True"),
        (lambda: HotBufferState.allocate(2, 4, 2, 8).set_host_rows(0, np.array([True])), ValueError, "host_rows"),
        (lambda: HotBufferState.allocate(2, 4, 2, 8).set_host_rows(0, np.array([1.5])), ValueError, "host_rows"),
        (lambda: _materializer(eps=True), TypeError, "eps must be a float"),
        (lambda: _materializer(max_position_hint=np.bool_(True)), ValueError, "max_position_hint must be an int"),
    ],
)
def test_bools_stay_refused(build, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        build()


# ---------------------------------------------------------------------------------------------------------------------
# (13) HotBufferState and MissPlan arguments


@pytest.mark.parametrize("unordered", [{3, 1, 2}, frozenset({1, 2}), {1: 0, 2: 0}, {1: 0}.keys()])
def test_unordered_host_rows_are_refused(unordered):
    state = HotBufferState.allocate(2, 4, 2, 8)
    before = state.clone()
    with pytest.raises(TypeError, match="host_rows must be an ordered sequence"):
        state.set_host_rows(0, unordered)
    assert torch.equal(state.host_cache_locs, before.host_cache_locs)


@pytest.mark.parametrize(
    ("build", "error", "text"),
    [
        (lambda: MissPlan("a", 1, None), TypeError, "MissPlan.src must be a torch.Tensor, got str"),
        (lambda: MissPlan(torch.zeros(1, 1, dtype=torch.int64), 1, None), TypeError, "MissPlan.dst must be"),
        (lambda: MissPlan(*_plan_tensors(), generation="x"), TypeError, "MissPlan.generation must be an int or None"),
        (lambda: MissPlan(*_plan_tensors(), generation=True), TypeError, "MissPlan.generation must be an int or None"),
        (lambda: MissPlan(*_plan_tensors(), generation=-1), ValueError, "MissPlan.generation must be >= 0, got -1"),
        (lambda: MissPlan(*_plan_tensors("meta")), ValueError, "MissPlan.src must hold data"),
        (lambda: MissPlan.allocate(-1, 4, "cpu"), ValueError, "MissPlan.allocate: batch must be an int >= 0, got -1"),
        (lambda: MissPlan.allocate(2, -4, "cpu"), ValueError, "MissPlan.allocate: columns must be an int >= 0"),
        (lambda: MissPlan.allocate(2.0, 4, "cpu"), TypeError, "MissPlan.allocate: batch must be an int"),
        (lambda: MissPlan.allocate(2, 4, "meta"), ValueError, "MissPlan.allocate: device must hold data"),
        (lambda: HotBufferState.allocate(2, 4, 2, 8, device="meta"), ValueError, "device must hold data"),
        (
            lambda: HotBufferState.allocate(2, 4, 2, 8).set_host_rows(0, torch.arange(3, device="meta")),
            ValueError,
            "host_rows must hold data",
        ),
        (
            lambda: HotBufferState.allocate(2, 4, 2, 8).write_tail(0, torch.arange(2, device="meta")),
            ValueError,
            "tokens must hold data",
        ),
        (
            lambda: HotBufferState(*(t.to("meta") for t in _state_tables())),
            ValueError,
            "device_buffer_tokens must hold data",
        ),
    ],
)
def test_plan_and_state_arguments_are_refused_by_name(build, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        build()


def _plan_tensors(device="cpu"):
    return (
        torch.zeros(2, 4, dtype=torch.int64, device=device),
        torch.zeros(2, 4, dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
    )


def _state_tables():
    s = HotBufferState.allocate(2, 4, 2, 8)
    return s.device_buffer_tokens, s.device_buffer_locs, s.lru_slots, s.host_cache_locs


def test_missplan_keeps_numpy_generations_and_plain_plans():
    src, dst, count = _plan_tensors()
    assert MissPlan(src, dst, count, generation=np.int64(3)).generation == 3
    assert MissPlan(src, dst, count).generation is None


# ---------------------------------------------------------------------------------------------------------------------
# (14) materialize's documented k_norm_weight, eps past float32, impossible reservations


def test_kernel_docstring_promises_only_the_stacked_norm_weight_it_takes(device):
    import kvplan.kernels as kernels

    assert "[D]`` shared" not in kernels.materialize.__doc__
    kv = torch.randn(2, 2, 8, device=device)
    with pytest.raises(ValueError, match="k_norm_weight"):
        kernels.materialize(
            kv, torch.ones(4, device=device), torch.full((2,), 1e-6, device=device), torch.randn(8, 4, device=device),
            torch.arange(2, device=device), num_kv_heads=1, head_dim=4, rotary_dim=4,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("eps", "text"),
    [
        (1e-50, r"eps must be representable in float32 .*1e-50 underflows to 0"),
        (1e39, r"eps must be representable in float32 .*1e\+39 overflows to inf"),
        ([1e-6, 1e-50], r"1e-50 underflows to 0"),
        (torch.tensor([1e-6, 1e39], dtype=torch.float64), r"1e\+39 overflows to inf"),
        (0.0, r"eps must be > 0 and finite, got \[0.0\]"),
        (float("nan"), r"eps must be > 0 and finite, got \[nan\]"),
    ],
)
def test_eps_past_float32_is_named_as_such(eps, text):
    with pytest.raises(ValueError, match=text):
        _materializer(eps=eps)
    mat = _materializer()
    with pytest.raises(ValueError, match=text):
        mat.refresh_weights(eps=eps)
    assert torch.allclose(mat.eps, torch.full((2,), 1e-6))


@pytest.mark.parametrize("tokens", [2**62, 2**63, 10**30])
def test_an_impossible_materializer_reservation_is_a_budget_error(tokens):
    mat = _materializer()
    mat.reserve(2)
    before = _held(mat)
    with pytest.raises(PoolBudgetError, match=rf"reserve\(max_tokens={tokens}\).*more than a tensor can hold"):
        mat.reserve(tokens)
    assert _held(mat) == before and before[0] == 2
