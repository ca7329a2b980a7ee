"""Kernel launches through the pool: the plan lands in the pool's buffers, unsized shapes are refused, replay and
materialize write where the pool's views point, and results equal the reference."""

import re

import pytest
import torch
from helpers.plans import assert_same_plan_rows
from helpers.pool_steps import _run, _setup

from kvplan import MaterializeGeometry, MissPlan, PlanBufferPool, PoolCapacityError, reference
from kvplan.counters import read_counters


@pytest.mark.parametrize("spec", [True, False])
def test_pool_launch_writes_its_plan_and_equals_reference(device, spec):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    ref_state, ref_dev = state.clone(), dev.clone()
    steps = tokens.shape[1] if spec else 1
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=steps, top_k=4)
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, spec)
    plan = pool.swap_in(**kwargs)
    views = pool.miss_plan(2, steps, 4)
    assert plan.src.data_ptr() == views.src.data_ptr() and plan.count.data_ptr() == views.count.data_ptr()

    ref_out, ref_kwargs = _run(None, ref_state, host, ref_dev, tokens, rids, seq_lens, spec)
    cols = steps * 4
    ref_plan = MissPlan(
        torch.zeros(2, cols, dtype=torch.int64, device=device),
        torch.zeros(2, cols, dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
    )
    ref_counters = torch.zeros_like(pool.counters)
    ref_count = ref_plan.count
    returned = reference.swap_in(**ref_kwargs, plan=ref_plan, counters=ref_counters)
    assert returned is ref_plan  # every level returns the plan it wrote
    assert torch.equal(out, ref_out)
    assert torch.equal(dev, ref_dev)
    assert torch.equal(state.lru_slots, ref_state.lru_slots)
    assert torch.equal(state.device_buffer_tokens, ref_state.device_buffer_tokens)
    assert torch.equal(plan.count, ref_count)
    assert_same_plan_rows(plan.src, plan.dst, ref_plan.src, ref_plan.dst, ref_count)
    assert read_counters(pool.counters) == read_counters(ref_counters)
    assert ref_count.sum() > 0  # the case copies something


def test_launch_for_unsized_shape_raises_capacity_error(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device, steps=2)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=1, top_k=4)  # too few columns for 2 steps
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    before = state.clone()
    with pytest.raises(PoolCapacityError, match=r"Call pool.ensure_capacity\(batch=2, num_steps=2, top_k=4\) "):
        pool.swap_in(**kwargs)
    assert torch.equal(state.lru_slots, before.lru_slots)  # nothing launched
    assert (out == -9).all()


@pytest.mark.parametrize(
    ("spec", "rank", "text"),
    [
        (True, 2, "speculative top_k_tokens must have shape [batch, steps, top_k]. "),
        (False, 3, "top_k_tokens must have shape [batch, top_k]. "),
        (None, 4, "top_k_tokens must have shape [batch, top_k]. "),
    ],
)
def test_pool_swap_in_reports_a_wrong_rank_with_the_engines_text(device, spec, rank, text):
    state, host, dev, tokens, rids, seq_lens = _setup(device, steps=2)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    given = {2: tokens[:, 0], 3: tokens, 4: tokens[:, None]}[rank]
    with pytest.raises(ValueError) as info:
        pool.swap_in(**{**kwargs, "top_k_tokens": given, "top_k_device_locs": torch.empty_like(given)},
                     speculative=spec)  # fmt: skip
    assert str(info.value).startswith(text)  # docs/kernels.md §6: the text, then a space and a hint


def test_replay_copies_the_plan_and_refuses_a_stale_plan(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    layer_host = host + 7
    layer_dev = torch.zeros_like(dev)
    assert pool.replay(plan, host_cache=layer_host, device_buffer=layer_dev) is None
    want = torch.zeros_like(dev)
    reference.copy_planned(plan, layer_host, want, num_real_reqs=None)
    assert torch.equal(layer_dev, want) and layer_dev.any()
    counters = read_counters(pool.counters)
    assert counters["replayed_rows"] == int(plan.count.sum()) == counters["misses_copied"]
    pool.ensure_capacity(batch=4, num_steps=4, top_k=4)  # grows: the old plan's buffers are gone
    with pytest.raises(PoolCapacityError, match="generation"):
        pool.replay(plan, host_cache=layer_host, device_buffer=layer_dev)


def test_pool_materialize_writes_the_slab_views(device):
    torch.manual_seed(0)
    geometry = MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    pool = PlanBufferPool(device, geometry=geometry)
    T = 5
    kv = torch.randn(T, 2, 2 * 2 * 8, device=device)
    w, eps = torch.rand(2, 8, device=device) + 0.5, torch.full((2,), 1e-6, device=device)
    freqs = torch.arange(32.0)[:, None] * torch.rand(4)[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], 1).to(device)
    positions = torch.tensor([3, 0, 31, 7, 9], dtype=torch.int32)
    with pytest.raises(PoolCapacityError) as info:
        pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)
    message = str(info.value)
    assert message.startswith("pool.materialize: ")
    call = re.search(r"Call (pool\.ensure_capacity\([^)]*\)) before the step", message).group(1)
    assert call == "pool.ensure_capacity(batch=0, num_steps=1, top_k=0, total_ctx=5)"
    # the engines' texts come before the pool's size: a kv breaking one of them reports it
    with pytest.raises(ValueError, match=r"^Invalid fused KV projection shape: got \(5, 2, 31\)"):
        pool.materialize(kv[..., :31], w, eps, cos_sin, positions, rotary_dim=8)
    with pytest.raises(ValueError, match=r"^Invalid fused KV rotary/head dim pair: rotary_dim=7, head_dim=8\."):
        pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=7)
    assert eval(call, {"pool": pool}) is True  # the suggested call, as printed, is the one to make
    k, v = pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)
    views = pool.kv_out(T)
    assert k.data_ptr() == views[0].data_ptr() and v.data_ptr() == views[1].data_ptr()
    k_ref, v_ref = reference.materialize(kv, w, eps, cos_sin, positions, num_kv_heads=2, head_dim=8, rotary_dim=8)
    assert torch.equal(v, v_ref)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)


def test_pool_materialize_reports_the_engines_texts_before_its_own(device):
    """A kv breaking a rule of docs/kernels.md §6 reports that rule, whatever else is wrong with it for this pool (an
    eps given as a float, another dtype or layer count than the pool's geometry). At T == 0 the list passes: a kv of
    the pool's geometry gets empty outputs, one of another model the pool's refusal."""
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=8,
                                                               dtype=torch.float32))  # fmt: skip
    pool.ensure_capacity(batch=0, total_ctx=4)
    w, cos_sin, positions = torch.ones(2, 8, device=device), torch.randn(8, 8, device=device), torch.arange(3)
    eps = torch.full((2,), 1e-6, device=device)
    with pytest.raises(ValueError, match=r"^Invalid stacked fused KV projection shape: got \(3, 32\)"):
        pool.materialize(torch.randn(3, 32, device=device), w, 1e-6, cos_sin, positions, rotary_dim=8)
    with pytest.raises(ValueError, match=r"^Invalid fused KV projection shape: got \(3, 2, 33\)"):
        pool.materialize(torch.randn(3, 2, 33, device=device).half(), w, eps, cos_sin, positions, rotary_dim=8)
    with pytest.raises(ValueError, match=r"^Invalid stacked k_norm_weight shape for fused KV materialization"):
        pool.materialize(torch.randn(3, 3, 32, device=device), w, eps, cos_sin, positions, rotary_dim=8)
    with pytest.raises(ValueError, match=r"^pool.materialize: kv must be \[total_ctx, 2, 32\] torch.float32"):
        pool.materialize(torch.randn(3, 2, 32, device=device).half(), w, eps, cos_sin, positions, rotary_dim=8)
    k, v = pool.materialize(torch.randn(0, 2, 32, device=device), w, eps, cos_sin, positions[:0], rotary_dim=8)
    assert k.shape == v.shape == (2, 0, 2, 8)
    with pytest.raises(ValueError, match=r"^pool.materialize: kv must be \[total_ctx, 2, 32\]"):  # even without tokens
        pool.materialize(torch.randn(0, 3, 32, device=device), w, eps, cos_sin, positions[:0], rotary_dim=8)


def test_pool_without_geometry_refuses_materialize(device):
    pool = PlanBufferPool(device)
    with pytest.raises(ValueError, match="no materialize slabs"):
        pool.materialize(
            torch.zeros(1, 1, 4), torch.ones(1, 2), torch.ones(1), torch.ones(4, 2), torch.zeros(1), rotary_dim=2
        )


def test_replay_on_a_side_stream_needs_a_cuda_pool(device):
    if device.type == "cuda":
        pytest.skip("the CUDA path is tested in tests/pool/test_pool_graph_gpu.py")
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    before = dev.clone()
    with pytest.raises(ValueError, match="stream= needs a CUDA pool"):
        pool.replay(plan, host_cache=host, device_buffer=dev, stream=object())
    assert torch.equal(dev, before)


def test_pool_launches_take_the_state_positionally_and_refuse_other_records(device):
    """``pool.swap_in(state, top_k_tokens, ...)`` positionally equals the keyword call; a non-HotBufferState
    state or flat tables are refused before anything is written."""
    state, host, dev, tokens, rids, seq_lens = _setup(device, seed=3)
    kw_state, kw_dev = state.clone(), dev.clone()
    pool, kw_pool = PlanBufferPool(device), PlanBufferPool(device)
    for p in (pool, kw_pool):
        p.ensure_capacity(batch=2, num_steps=2, top_k=4)
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    kw_out, kw_kwargs = _run(kw_pool, kw_state, host, kw_dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(state, kwargs["top_k_tokens"], out, kwargs["req_pool_indices"], kwargs["seq_lens"], host, dev)
    kw_plan = kw_pool.swap_in(**kw_kwargs)
    assert torch.equal(out, kw_out) and torch.equal(dev, kw_dev) and torch.equal(plan.count, kw_plan.count)
    assert torch.equal(state.lru_slots, kw_state.lru_slots) and int(plan.count.sum()) > 0

    before_out, before_lru = out.clone(), state.lru_slots.clone()
    tables = dict(
        device_buffer_tokens=state.device_buffer_tokens,
        device_buffer_locs=state.device_buffer_locs,
        lru_slots=state.lru_slots,
        host_cache_locs=state.host_cache_locs,
    )
    for top_k in (tokens, tokens[:, 0]):  # both paths
        args = dict(kwargs, top_k_tokens=top_k, top_k_device_locs=out if top_k.dim() == 3 else out[:, 0])
        if top_k.dim() == 2:
            args["seq_lens"] = seq_lens.view(2, -1)[:, 0].contiguous()
        with pytest.raises(TypeError, match="state must be a kvplan.HotBufferState .*got dict"):
            pool.swap_in(**dict(args, state=tables))
        with pytest.raises(TypeError, match="got an unexpected keyword argument 'device_buffer_tokens'"):
            pool.swap_in(**{k: v for k, v in args.items() if k != "state"}, **tables)
    assert torch.equal(out, before_out) and torch.equal(state.lru_slots, before_lru)


def test_pool_materialize_takes_eps_as_the_materializer_does(device):
    """Issue 22.3: one float for every layer, or one per layer, beside the kernel's [n_layers] tensor."""
    torch.manual_seed(1)
    geometry = MaterializeGeometry(n_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    pool = PlanBufferPool(device, geometry=geometry)
    pool.ensure_capacity(batch=0, total_ctx=3)
    kv = torch.randn(3, 2, 16, device=device)
    w, cos_sin = torch.rand(2, 8, device=device) + 0.5, torch.randn(8, 8, device=device)
    positions = torch.tensor([0, 5, 7], device=device)
    results = []
    for eps in (torch.full((2,), 1e-3, device=device), 1e-3, [1e-3, 1e-3]):
        k, v = pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)
        results.append((k.clone(), v.clone()))
    assert all(torch.equal(k, results[0][0]) and torch.equal(v, results[0][1]) for k, v in results)
    with pytest.raises(ValueError, match="eps must hold 2 values"):
        pool.materialize(kv, w, [1e-3], cos_sin, positions, rotary_dim=8)


@pytest.fixture
def relaunched(monkeypatch) -> list:
    """Launches are kept by the kernels' recorders (the interpreter's never are, so a recorder that keeps them
    stands in for the GPU's) and a relaunch is appended here instead of launched."""
    from helpers.kernel_calls import _KeepingRecorder

    from kvplan.kernels import copy, fused_kv, hisparse
    from kvplan.runtime import launch_replay

    for module in (copy, hisparse, fused_kv):
        monkeypatch.setattr(module, "Recorder", _KeepingRecorder)
    launches: list = []
    monkeypatch.setattr(launch_replay, "relaunch", launches.append)
    return launches


def test_the_pools_launch_records_are_its_own_counted_and_dropped_by_a_growth(relaunched, device):
    """A pool's eager launches record into the pool's own records (bounded by ``PoolConfig.launch_records``; the
    kernels keep none of their own): ``stats()`` counts them and the relaunches, a growth drops them (they name the
    old buffers), and a pool with ``launch_records=0`` checks and launches every call in full."""
    from kvplan import PoolConfig

    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device, config=PoolConfig(launch_records=2))
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    stats = pool.stats()
    assert (stats.launch_records, stats.launch_graphs, stats.relaunches) == (0, 0, 0)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    for _ in range(3):
        plan = pool.swap_in(**kwargs)
    pool.replay(plan, host_cache=host, device_buffer=dev.clone())
    stats = pool.stats().as_dict()
    assert (stats["total.launch_records"], stats["total.relaunches"]) == (2, 2)  # the swap-in's and the replay's
    assert len(relaunched) == 2
    _, single = _run(pool, state, host, dev, tokens, rids, seq_lens, False)
    pool.ensure_capacity(batch=2, num_steps=1, top_k=4)
    pool.swap_in(**single)  # a third layout: the least recently used record goes (the bound is 2)
    assert pool.stats().launch_records == 2
    pool.ensure_capacity(batch=4, num_steps=2, top_k=4)  # a growth: the buffers moved, the records named them
    assert pool.stats().launch_records == 0 and pool.stats().relaunches == 2
    unrecorded = PlanBufferPool(device, config=PoolConfig(launch_records=0))
    unrecorded.ensure_capacity(batch=2, num_steps=2, top_k=4)
    for _ in range(2):
        unrecorded.swap_in(**kwargs)
    assert (unrecorded.stats().launch_records, unrecorded.stats().relaunches) == (0, 0)


def _repeated_calls(pool: PlanBufferPool, device) -> None:
    """Three identical swap-ins, each plan replayed, and three identical materializes through ``pool``."""
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4, total_ctx=3)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    target = dev.clone()
    kv = torch.randn(3, 2, 2 * 2 * 8, device=device)
    w, cos_sin = torch.ones(2, 8, device=device), torch.randn(16, 8, device=device)
    positions = torch.tensor([0, 5, 7], device=device)
    for _ in range(3):
        plan = pool.swap_in(**kwargs)
        pool.replay(plan, host_cache=host, device_buffer=target)
        pool.materialize(kv, w, 1e-3, cos_sin, positions, rotary_dim=8)


_GEOMETRY = dict(n_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.mark.parametrize("replay", ["graph", "plain"])
def test_a_pool_relaunches_under_its_replay_policy(relaunched, replay, device):
    """``launch_replay="graph"`` and ``"plain"``: the second and third of each identical call are relaunched, their
    checks skipped, and the pool's records relaunch under the policy configured (``LaunchCache.replay``: whether a
    call of several launches becomes a CUDA graph, tests/kernels/test_launch_cache.py; the CPU captures none)."""
    from kvplan import PoolConfig

    pool = PlanBufferPool(device, geometry=MaterializeGeometry(**_GEOMETRY), config=PoolConfig(launch_replay=replay))
    _repeated_calls(pool, device)
    stats = pool.stats()
    assert (stats.launch_records, stats.relaunches) == (3, 6)  # swap-in, replay, materialize: recorded once each
    assert len(relaunched) == 6 and pool._launch_records.replay == replay
    if device.type != "cuda":
        assert stats.launch_graphs == 0
    elif replay == "plain":
        assert stats.launch_graphs == 0  # never a graph, however often relaunched


def test_a_pool_with_launch_replay_off_checks_and_launches_every_call(relaunched, monkeypatch, device):
    """``launch_replay="off"``: nothing is recorded and nothing relaunched, however often a call repeats; every call
    is checked."""
    from kvplan import PoolConfig
    from kvplan.kernels import hisparse

    checks = [0]
    check = hisparse.check_swap_in

    def counting(*args, **kwargs):
        checks[0] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(hisparse, "check_swap_in", counting)
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(**_GEOMETRY), config=PoolConfig(launch_replay="off"))
    _repeated_calls(pool, device)
    stats = pool.stats()
    assert (stats.launch_records, stats.launch_graphs, stats.relaunches) == (0, 0, 0)
    assert relaunched == [] and checks[0] == 3 and pool._launch_records is None
    control = PlanBufferPool(device, geometry=MaterializeGeometry(**_GEOMETRY))  # the default policy relaunches
    _repeated_calls(control, device)
    assert control.stats().relaunches == 6 and checks[0] == 4


@pytest.mark.parametrize("bad", ["graphs", "Graph", "", "none", None, True, 0, ("graph",)])
def test_launch_replay_must_be_a_known_policy(bad):
    from kvplan import PoolConfig

    expected = re.escape(f"PoolConfig.launch_replay must be one of 'graph', 'plain', 'off', got {bad!r}")
    with pytest.raises(ValueError, match=f"^{expected}$"):
        PoolConfig(launch_replay=bad)


@pytest.mark.parametrize("bad", [-1, 1 << 21, 2.0, True, "8"])
def test_launch_records_must_be_a_bounded_count(bad):
    from kvplan import PoolConfig

    error = ValueError if type(bad) is int else TypeError
    with pytest.raises(error, match=r"PoolConfig\.launch_records must be"):
        PoolConfig(launch_records=bad)
