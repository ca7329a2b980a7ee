"""The kernels as torch custom ops (kvplan.ops): schemas, opcheck, and compiled engine steps through the pool.

Under the Triton interpreter on CPU here (tiny shapes, ``aot_eager`` plus one inductor compile). The engine, its steps
and the eager/compiled comparison are tests/helpers/ops_scenarios.py's, shared with the GPU file
(tests/kernels/test_ops_gpu.py), which runs them at production shapes with inductor and CUDA graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
import torch
from helpers.ops_scenarios import (
    CountingBackend,
    Engine,
    Shapes,
    compare_steps,
    engine_step,
    fresh_dynamo,  # noqa: F401  (autouse: a fresh dynamo around every test)
    make_engine,
    make_pool,
    mark_batch_dynamic,
    materialize_op_args,
    run_step,
    step_inputs,
    swap_in_call_for,
)
from torch import Tensor

from kvplan import MaterializeGeometry, PoolCapacityError, kernels, ops
from kvplan.calls import FLAT_FIELDS, CopyCall, MaterializeCall, SwapInCall
from kvplan.counters import REPLAY_COPY_BASE, SWAP_IN_COPY_BASE, new_counters
from kvplan.plan import MissPlan, traceable_plan
from kvplan.state import HotBufferState

I32, I64 = torch.int32, torch.int64
SMALL = Shapes(
    requests=6,
    hot=8,
    tail=4,
    max_len=40,
    scratch=2,
    row=8,  # bf16 elements per KV row (16 bytes)
    layers=2,  # layer 0 by swap-in, layer 1 by plan replay
    geometry=MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    rotary_dim=8,
    max_pos=64,
    max_batch=4,
    steps=2,
    top_k=4,
    min_extra=2,
)  # host caches on the device (CPU tensors here), pool not frozen: tests grow it
GEOMETRY = SMALL.geometry

SWAP_IN_WRITES = {
    "top_k_device_locs",
    "device_buffer_tokens",
    "lru_slots",
    "device_buffer",
    "miss_src",
    "miss_dst",
    "miss_count",
    "workspace",
    "counters",
}
WRITES = {
    "swap_in": SWAP_IN_WRITES,  # both paths: ``speculative`` is the op's first argument
    "copy_planned": {"device_buffer", "counters"},
    "materialize": {"k_out", "v_out"},
}


# ---------------------------------------------------------------------------------------------------------------------
# Registration


@pytest.mark.parametrize("name", sorted(WRITES))
def test_ops_are_registered_declaring_exactly_what_they_write(name):
    schema = getattr(torch.ops.kvplan, name).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name]
    assert not schema.returns  # nothing returned: a custom op may not return an alias of an input
    optional = {a.name for a in schema.arguments if isinstance(a.type, torch.OptionalType)}
    ints = {a.name for a in schema.arguments if str(a.type) in ("int", "SymInt")}
    if name == "swap_in":
        # the flat schema is SwapInCall's fields in order (the plan as its three tensors), the path flag first
        assert [a.name for a in schema.arguments] == list(FLAT_FIELDS)
        at = SwapInCall._fields.index("plan")
        assert FLAT_FIELDS[at : at + 3] == ("miss_src", "miss_dst", "miss_count")
        assert schema.arguments[0].name == "speculative" and str(schema.arguments[0].type) == "bool"
        assert optional == {
            "scratch_locs",
            "num_real_reqs",
            "miss_src",
            "miss_dst",
            "miss_count",
            "workspace",
            "counters",
        }
        assert not ints
    if name == "materialize":
        assert ints == {"num_kv_heads", "head_dim", "rotary_dim"} and not optional
    if name == "copy_planned":
        assert ints == {"counter_base"} and optional == {"num_real_reqs", "counters", "workspace"}


def test_there_is_one_swap_in_op_for_both_paths():
    assert not hasattr(torch.ops.kvplan, "swap_in_spec")
    with pytest.raises(AttributeError, match="swap_in_spec"):
        torch.ops.kvplan.swap_in_spec  # noqa: B018


def _api_args(engine: Engine, call: SwapInCall) -> tuple[tuple, dict]:
    """The same call as the positional and keyword arguments of ``kernels``/``ops.swap_in``."""
    args = (
        engine.state,
        call.top_k_tokens,
        call.top_k_device_locs,
        call.req_pool_indices,
        call.seq_lens,
        call.host_cache,
        call.device_buffer,
    )
    kwargs = dict(num_real_reqs=call.num_real_reqs, plan=call.plan, workspace=call.workspace, counters=call.counters)
    return args, kwargs


@pytest.mark.parametrize("speculative", [False, True], ids=["single", "spec"])
def test_swap_in_op_writes_every_declared_argument_and_nothing_else(speculative, device):
    engine = make_engine(device, SMALL, seed=3)
    inp = step_inputs(engine, torch.Generator().manual_seed(4), 3, SMALL.steps if speculative else 0)
    call = swap_in_call_for(engine, inp, speculative)
    assert (call.scratch_locs is not None) == speculative  # the single-step call leaves the state's scratch out
    fields = {name: t for name, t in call.flat_dict().items() if isinstance(t, Tensor)}
    fields["state.scratch_locs"] = engine.state.scratch_locs  # read-only on both paths
    before = {name: t.clone() for name, t in fields.items()}
    args, kwargs = _api_args(engine, call)
    assert ops.swap_in(*args, **kwargs) is kwargs["plan"]
    changed = {name for name, t in before.items() if not torch.equal(fields[name], t)}
    assert changed == SWAP_IN_WRITES  # this step has misses, admissions and copies: every declared write happens


def test_copy_and_materialize_ops_write_only_their_outputs(device):
    engine = make_engine(device, SMALL, seed=5)
    plan = MissPlan(
        torch.tensor([[3, 9], [4, -1]], device=device),
        torch.tensor([[0, 7], [2, 0]], dtype=I32, device=device),
        torch.tensor([2, 1], dtype=I32, device=device),
    )
    num_real_reqs = torch.tensor([2], dtype=I32, device=device)
    device_buffer = engine.device_buffers[1].clone()
    args = dict(
        miss_src=plan.src,
        miss_dst=plan.dst,
        miss_count=plan.count,
        num_real_reqs=num_real_reqs,
        host_cache=engine.host_caches[1],
        device_buffer=device_buffer,
    )
    before = {name: t.clone() for name, t in args.items()}
    counters = new_counters(device)
    assert (
        ops.copy_planned(plan, engine.host_caches[1], device_buffer, num_real_reqs=num_real_reqs, counters=counters)
        is None
    )
    assert {name for name, t in before.items() if not torch.equal(args[name], t)} == {"device_buffer"}
    # the Python function adds to the replay counters; the op takes the base (the swap-in's own copy counters here)
    assert counters[REPLAY_COPY_BASE : REPLAY_COPY_BASE + 2].tolist() == [3, 3 * 2 * SMALL.row]
    assert counters[SWAP_IN_COPY_BASE : SWAP_IN_COPY_BASE + 2].tolist() == [0, 0]
    device_buffer.copy_(before["device_buffer"])
    counters = new_counters(device)
    torch.ops.kvplan.copy_planned.default(**args, counters=counters, counter_base=SWAP_IN_COPY_BASE)
    assert {name for name, t in before.items() if not torch.equal(args[name], t)} == {"device_buffer"}
    assert counters[SWAP_IN_COPY_BASE : SWAP_IN_COPY_BASE + 2].tolist() == [3, 3 * 2 * SMALL.row]
    assert counters[REPLAY_COPY_BASE : REPLAY_COPY_BASE + 2].tolist() == [0, 0]
    with pytest.raises(TypeError, match="plan must be a kvplan.MissPlan, got tuple"):
        ops.copy_planned((plan.src, plan.dst, plan.count), engine.host_caches[1], device_buffer)

    inp = step_inputs(engine, torch.Generator().manual_seed(6), 2, SMALL.steps)
    rope = engine.rope
    reads = (inp["kv"], rope["k_norm_weight"], rope["eps"], rope["cos_sin_cache"], inp["positions"])
    dims = dict(num_kv_heads=GEOMETRY.num_kv_heads, head_dim=GEOMETRY.head_dim, rotary_dim=SMALL.rotary_dim)
    before = [t.clone() for t in reads]
    k_out, v_out = ops.materialize(*reads, **dims)
    assert all(torch.equal(a, b) for a, b in zip(reads, before))
    k_ref, v_ref = kernels.materialize(*reads, **dims)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


# ---------------------------------------------------------------------------------------------------------------------
# opcheck: schema (declared mutations), fake tensors, aot dispatch with dynamic shapes


@pytest.mark.parametrize(
    "speculative,with_plan", [(False, True), (True, True), (True, False)], ids=["single", "spec", "spec_no_plan"]
)
def test_opcheck_swap_in(speculative, with_plan, device):
    engine = make_engine(device, SMALL, seed=7)
    inp = step_inputs(engine, torch.Generator().manual_seed(8), 2, SMALL.steps if speculative else 0, num_real=1)
    # without a plan the kernel allocates plan and workspace itself: still no aliasing, nothing else written
    call = swap_in_call_for(engine, inp, speculative, with_plan=with_plan)
    assert call.speculative is speculative and (call.plan is None) is (not with_plan)
    torch.library.opcheck(torch.ops.kvplan.swap_in.default, (), call.flat_dict())


def test_opcheck_copy_planned_and_materialize(device):
    engine = make_engine(device, SMALL, seed=9)
    copy_args = dict(
        miss_src=torch.tensor([[3, 9, 0], [4, 2, 0]], device=device),
        miss_dst=torch.tensor([[0, 7, 0], [2, 5, 0]], dtype=I32, device=device),
        miss_count=torch.tensor([2, 2], dtype=I32, device=device),
        num_real_reqs=torch.tensor([1], dtype=I32, device=device),
        host_cache=engine.host_caches[0],
        device_buffer=engine.device_buffers[0],
        counters=new_counters(device),
        counter_base=REPLAY_COPY_BASE,
    )
    torch.library.opcheck(torch.ops.kvplan.copy_planned.default, (), copy_args)
    torch.library.opcheck(torch.ops.kvplan.copy_planned.default, (), dict(copy_args, counters=None, counter_base=0))

    inp = step_inputs(engine, torch.Generator().manual_seed(10), 2, SMALL.steps)
    torch.library.opcheck(torch.ops.kvplan.materialize.default, materialize_op_args(engine, inp))


# ---------------------------------------------------------------------------------------------------------------------
# The Python-level functions: the kernels' API and behaviour


def test_python_api_matches_the_kernels_and_keeps_their_errors(device):
    engine = make_engine(device, SMALL, seed=11)
    inp = step_inputs(engine, torch.Generator().manual_seed(12), 3, SMALL.steps, num_real=2)
    results = []
    for impl in (kernels, ops):
        e = engine.clone()
        call = swap_in_call_for(e, {**inp, "top_k_device_locs": inp["top_k_device_locs"].clone()}, True)
        args, kwargs = _api_args(e, call)
        returned = impl.swap_in(*args, **kwargs)
        if impl is ops:
            assert returned is kwargs["plan"]  # the op cannot return an alias: the function returns the plan given
        else:
            assert isinstance(returned, MissPlan)
            assert (returned.src, returned.dst, returned.count) == (call.plan.src, call.plan.dst, call.plan.count)
        fields = call.flat_dict()
        results.append({name: fields[name] for name in sorted(SWAP_IN_WRITES - {"workspace"})})
    assert all(torch.equal(results[0][name], results[1][name]) for name in results[0])
    assert int(results[0]["miss_count"][:2].sum()) > 0  # the real rows copied something

    rope = engine.rope
    reads = (inp["kv"], rope["k_norm_weight"], rope["eps"], rope["cos_sin_cache"], inp["positions"])
    dims = dict(num_kv_heads=GEOMETRY.num_kv_heads, head_dim=GEOMETRY.head_dim, rotary_dim=SMALL.rotary_dim)
    k_out = torch.empty(GEOMETRY.n_layers, inp["kv"].shape[0], GEOMETRY.num_kv_heads, GEOMETRY.head_dim,
                        dtype=torch.bfloat16, device=device)  # fmt: skip
    k, v = ops.materialize(*reads, **dims, k_out=k_out)
    assert k is k_out and v.shape == k_out.shape and v.dtype == torch.bfloat16  # given outputs are returned as is
    empty_k, empty_v = ops.materialize(inp["kv"][:0], *reads[1:4], inp["positions"][:0], **dims)
    assert empty_k.shape == empty_v.shape == (GEOMETRY.n_layers, 0, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    bad_tokens = dict(inp, top_k_tokens=inp["top_k_tokens"][:, 0])
    for impl in (kernels, ops):  # the same validator messages
        with pytest.raises(ValueError, match=r"Invalid stacked fused KV projection shape: got \(6, 32\)"):
            impl.materialize(inp["kv"][:, 0], *reads[1:], **dims)
        by_position = impl.materialize(*reads, *dims.values())  # docs/kernels.md §5's order, positionally
        assert all(torch.equal(a, b) for a, b in zip(by_position, impl.materialize(*reads, **dims)))
        with pytest.raises(TypeError, match="takes from 8 to 10 positional arguments but 11 were given"):
            impl.materialize(*reads, *dims.values(), None, None, False)  # check_positions is keyword-only
        args, kwargs = _api_args(engine, swap_in_call_for(engine, bad_tokens, True))
        with pytest.raises(ValueError, match="speculative top_k_tokens must have shape"):
            impl.swap_in(*args, **kwargs, speculative=True)
        args, kwargs = _api_args(engine, swap_in_call_for(engine, inp, True))
        plan = kwargs["plan"]
        with pytest.raises(TypeError, match="state must be a kvplan.HotBufferState .*got dict"):
            impl.swap_in({f.name: getattr(engine.state, f.name) for f in attrs.fields(HotBufferState)},
                         *args[1:], **kwargs)  # fmt: skip
        with pytest.raises(TypeError, match="plan must be a kvplan.MissPlan or None, got tuple"):
            impl.swap_in(*args, **dict(kwargs, plan=(plan.src, plan.dst, plan.count)))
        with pytest.raises(TypeError, match="unexpected keyword argument 'miss_src'"):
            impl.swap_in(*args, **dict(kwargs, plan=None), miss_src=plan.src)


def test_plans_built_field_by_field_have_every_missplan_field():
    fields = dict(src=torch.zeros(2, 3, dtype=I64), dst=torch.zeros(2, 3, dtype=I32), count=torch.zeros(2, dtype=I32))
    plan = traceable_plan(**fields, generation=4)
    assert type(plan) is MissPlan and [f.name for f in attrs.fields(MissPlan)] == ["src", "dst", "count", "generation"]
    assert all(getattr(plan, name) is t for name, t in fields.items()) and plan.generation == 4
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.generation = 5
    assert MissPlan(**fields).generation is None  # a caller-owned plan
    owned = MissPlan.allocate(2, 6, "cpu")
    assert (owned.src.shape, owned.dst.shape, owned.count.shape) == ((2, 6), (2, 6), (2,))
    assert (owned.src.dtype, owned.dst.dtype, owned.count.dtype, owned.generation) == (I64, I32, I32, None)


@pytest.mark.slow  # a subprocess importing torch and compiling
def test_import_kvplan_stays_light_and_the_ops_load_on_the_first_launch():
    """``import kvplan`` and sizing a pool import neither Triton nor the ops; the first pool launch imports kvplan.ops,
    the one route down to the kernels (the plain launch eagerly), and a launch dynamo traces goes through it whole."""
    code = """
import sys, torch, kvplan
assert 'triton' not in sys.modules and 'kvplan.ops' not in sys.modules
pool = kvplan.PlanBufferPool('cpu')
pool.ensure_capacity(batch=2, top_k=4)
plan = pool.miss_plan(2, 1, 4)
assert 'triton' not in sys.modules and 'kvplan.ops' not in sys.modules
plan.count.copy_(torch.tensor([1, 2], dtype=torch.int32))
plan.src.copy_(torch.tensor([[3, 0, 0, 0], [5, 6, 0, 0]]))
plan.dst.copy_(torch.tensor([[0, 0, 0, 0], [1, 2, 0, 0]], dtype=torch.int32))
host, dev = torch.randn(8, 4), torch.zeros(3, 4)
pool.replay(plan, host_cache=host, device_buffer=dev)
assert 'kvplan.ops' in sys.modules and torch.equal(dev, host[[3, 5, 6]])
dev.zero_()
step = torch.compile(lambda p, h, d: pool.replay(p, host_cache=h, device_buffer=d), fullgraph=True, backend='eager')
step(plan, host, dev)
assert torch.equal(dev, host[[3, 5, 6]])
"""
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})  # CPU tensors


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile of an engine step through the pool


def test_compiled_speculative_step_matches_eager_without_graph_breaks(device):
    backend = CountingBackend()
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)  # fullgraph: a graph break is an error
    compare_steps(device, SMALL, compiled, [(3, 3), (3, 2), (3, 3)])
    assert backend.graphs == 1  # same shapes, state carried over: one compile
    kernels = {"kvplan.swap_in.default", "kvplan.copy_planned.default", "kvplan.materialize.default"}
    assert backend.ops == kernels | {"kvplan.check_memory.default"}  # each kernel op after its memory check
    assert backend.speculative == {True}  # the one swap-in op, on its speculative path


def test_compiled_single_step_swap_in_matches_eager(device):
    backend = CountingBackend()
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)
    compare_steps(device, SMALL, compiled, [(2, 2), (2, 1)], speculative=False, seed=20)
    assert "kvplan.swap_in.default" in backend.ops and backend.speculative == {False}


@pytest.mark.slow  # an inductor compile
def test_compiled_step_with_inductor_matches_eager(device):
    compiled = torch.compile(engine_step, fullgraph=True)  # the default backend: inductor
    compare_steps(device, SMALL, compiled, [(2, 2), (2, 2)], seed=30)


@pytest.mark.slow  # two compiles, five steps
def test_batch_changes_within_the_reservation_compile_once_then_once_dynamic(device):
    """Default dynamic-shape settings (automatic dynamic): batch 2 compiles a static graph, the first other batch
    recompiles once with a symbolic batch, every later batch >= 2 within the reservation reuses that graph."""
    backend = CountingBackend()
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)
    compare_steps(device, SMALL, compiled, [(2, 2), (3, 3), (4, 3), (2, 1), (4, 4)], seed=40)
    assert backend.graphs == 2


@pytest.mark.slow  # a dynamic-shape compile, three steps
def test_batch_marked_dynamic_compiles_once(device):
    """With the batch dimensions marked dynamic up front (as an engine does for its step inputs), one graph serves
    every batch >= 2 within the reservation. mark_dynamic also fails the compile if anything on the pool path
    pinned the batch to a constant."""
    backend = CountingBackend()
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)
    compare_steps(device, SMALL, mark_batch_dynamic(compiled), [(4, 4), (2, 2), (3, 1)], seed=50)
    assert backend.graphs == 1


@pytest.mark.slow  # two compiles
def test_unsized_batch_is_refused_when_compiled_and_runs_after_growth(device):
    """A batch beyond the reservation fails the graph's capacity guard; the re-trace refuses it (fullgraph: dynamo's
    Unsupported carrying the PoolCapacityError), and after ensure_capacity one recompile serves it and every
    smaller batch."""
    backend = CountingBackend()
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)
    engine, pool = make_engine(device, SMALL), make_pool(device, SMALL)
    gen = torch.Generator().manual_seed(60)
    run_step(compiled, pool, engine, step_inputs(engine, gen, 2, SMALL.steps), True)
    big = step_inputs(engine, gen, SMALL.max_batch + 1, SMALL.steps)
    refusal = r"PoolCapacityError.*Call pool.ensure_capacity\(batch=5, num_steps=2, top_k=4"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=refusal):
        compiled(pool, engine, big, True)
    generation = pool.generation
    got = run_step(compiled, pool, engine, big, True)  # run_step grows the pool first
    assert pool.generation > generation
    assert tuple(got["plan_shape"][:2].tolist()) == (SMALL.max_batch + 1, SMALL.steps * SMALL.top_k)
    run_step(compiled, pool, engine, step_inputs(engine, gen, 3, SMALL.steps), True)
    assert backend.graphs == 2


def test_unsized_batch_raises_the_pools_error_without_fullgraph(device):
    compiled = torch.compile(engine_step, backend="aot_eager")  # dynamo re-runs the frame eagerly: the pool raises
    engine, pool = make_engine(device, SMALL), make_pool(device, SMALL)
    big = step_inputs(engine, torch.Generator().manual_seed(61), SMALL.max_batch + 1, SMALL.steps)
    with pytest.raises(PoolCapacityError, match=r"Call pool.ensure_capacity\(batch=5, num_steps=2, top_k=4"):
        compiled(pool, engine, big, True)


def test_bad_arguments_in_a_compiled_step_raise_the_kernels_errors_when_it_runs(device):
    """The fake implementations check nothing: the real launch validates, so the compiled step raises the same
    error, with the same text, as the eager one."""
    compiled = torch.compile(engine_step, fullgraph=True, backend="aot_eager")
    engine, pool = make_engine(device, SMALL), make_pool(device, SMALL)
    inp = step_inputs(engine, torch.Generator().manual_seed(70), 2, SMALL.steps)
    inp["seq_lens"] = inp["seq_lens"].float()
    pool.ensure_capacity(batch=2, num_steps=SMALL.steps, top_k=SMALL.top_k, total_ctx=inp["kv"].shape[0])
    for step in (engine_step, compiled):
        with pytest.raises(ValueError, match=r"seq_lens must be torch\.int32 or torch\.int64, got torch\.float32"):
            step(pool, engine, inp, True)


# ---------------------------------------------------------------------------------------------------------------------
# A compiled step refuses what the eager one refuses: an output sharing memory with another argument. Functionalization
# hands the kernel op copies of what it writes, so the op's own checks cannot see it (aot_eager: the copy written back
# at the end of the graph landed device rows in top_k_tokens); kvplan.check_memory checks it when traced and each time
# the step runs.

SHARED = r"top_k_device_locs must not share memory with top_k_tokens \(the kernel writes top_k_device_locs\)"


def _swap_in_step(pool, engine, inp):
    return pool.swap_in(
        engine.state,
        top_k_tokens=inp["top_k_tokens"],
        top_k_device_locs=inp["top_k_device_locs"],
        req_pool_indices=inp["req_pool_indices"],
        seq_lens=inp["seq_lens"],
        num_real_reqs=inp["num_real_reqs"],
        host_cache=engine.host_caches[0],
        device_buffer=engine.device_buffers[0],
        speculative=False,
    )


def _outputs_over_tokens(inp: dict, how: str) -> dict:
    """The step's inputs with ``top_k_device_locs`` laid over ``top_k_tokens``: the same tensor, or a view one
    column further along one buffer (overlapping all but one element)."""
    tokens = inp["top_k_tokens"]
    if how == "same":
        return {**inp, "top_k_device_locs": tokens}
    buffer = torch.zeros(tokens.numel() + 1, dtype=I32, device=tokens.device)
    buffer[: tokens.numel()] = tokens.flatten()
    return {**inp, "top_k_tokens": buffer[:-1].view(tokens.shape), "top_k_device_locs": buffer[1:].view(tokens.shape)}


def _single_step(device, seed: int):
    engine, pool = make_engine(device, SMALL, seed=seed), make_pool(device, SMALL)
    inp = step_inputs(engine, torch.Generator().manual_seed(seed), 2, 0)
    pool.ensure_capacity(batch=2, num_steps=1, top_k=SMALL.top_k, total_ctx=2)
    return engine, pool, inp


@pytest.mark.parametrize("how", ["same", "overlap"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_refuses_outputs_over_the_tokens_when_traced(device, backend, how):
    engine, pool, inp = _single_step(device, 80)
    inp = _outputs_over_tokens(inp, how)
    tokens, state = inp["top_k_tokens"].clone(), engine.state.clone()
    with pytest.raises(ValueError, match=SHARED):
        _swap_in_step(pool, engine, inp)  # eager
    counting = CountingBackend(backend)
    compiled = torch.compile(_swap_in_step, fullgraph=True, backend=counting)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=SHARED):
        compiled(pool, engine, inp)
    assert counting.graphs == 0  # refused while dynamo traced, before any graph was made
    assert torch.equal(inp["top_k_tokens"], tokens)  # nothing written
    assert torch.equal(engine.state.device_buffer_tokens, state.device_buffer_tokens)


@pytest.mark.parametrize("how", ["same", "overlap"])
def test_compiled_step_traced_on_separate_tensors_refuses_overlapping_ones_when_it_runs(device, how):
    """The graph traced with separate tensors is reused for overlapping views of the same shapes (dynamo does not
    guard on storage overlap): the check runs each time the step does, and nothing is written. (The same tensor
    object twice fails dynamo's identity guards: that re-trace refuses it.)"""
    backend = CountingBackend()
    compiled = torch.compile(_swap_in_step, fullgraph=True, backend=backend)
    engine, pool, inp = _single_step(device, 81)
    compiled(pool, engine, inp)
    inp = _outputs_over_tokens({**inp, "top_k_device_locs": inp["top_k_device_locs"].clone()}, how)
    tokens, state = inp["top_k_tokens"].clone(), engine.state.clone()
    with pytest.raises((ValueError, torch._dynamo.exc.TorchRuntimeError), match=SHARED):
        compiled(pool, engine, inp)
    assert "kvplan.check_memory.default" in backend.ops
    assert backend.graphs == 1  # (the re-trace of the same object is refused before a graph is made)
    assert torch.equal(inp["top_k_tokens"], tokens)
    assert torch.equal(engine.state.device_buffer_tokens, state.device_buffer_tokens)


def test_compiled_replay_and_materialize_refuse_outputs_over_their_inputs_when_they_run(device):
    engine, pool, inp = _single_step(device, 82)
    plan = _swap_in_step(pool, engine, inp)
    host = engine.host_caches[1]
    replay = torch.compile(lambda p, h, d: pool.replay(p, host_cache=h, device_buffer=d), fullgraph=True,
                           backend="aot_eager")  # fmt: skip
    replay(plan, host, engine.device_buffers[1])
    before = host.clone()
    with pytest.raises(ValueError, match=r"device_buffer must not share memory with host_cache"):
        replay(plan, host, host[: engine.device_buffers[1].shape[0]])
    assert torch.equal(host, before)
    args = list(materialize_op_args(engine, inp))
    kv, k_out = args[0], args[8]
    materialize = torch.compile(lambda *a: ops.materialize(*a[:10], check_positions=a[10]), fullgraph=True,
                                backend="aot_eager")  # fmt: skip
    materialize(*args)
    args[8] = kv.view(-1)[: k_out.numel()].view(k_out.shape)
    kv_before = kv.clone()
    with pytest.raises(ValueError, match=r"k_out must not share memory with kv"):
        materialize(*args)
    assert torch.equal(kv, kv_before)


# The block front end and the K+V plan copy: kvplan.check_memory guards their ops (kvplan::swap_in_blocks,
# kvplan::copy_planned_kv) as it guards swap_in's and copy_planned's.

BLOCKS_SHARED = r"top_k_device_locs must not share memory with top_k_blocks \(the kernel writes top_k_device_locs\)"


def _blocks_scenario(device, seed: int):
    from helpers.block_scenarios import build_blocks

    return build_blocks(seed=seed, batch=2, num_blocks=2, block=2, hot=8, tail=2, lens=[20, 30], max_len=40,
                        requests=4, device=device)  # fmt: skip


def _blocks_step(state, blocks, out, rids, lens, host_k, host_v, dev_k, dev_v, block: int):
    return ops.swap_in_blocks(state, blocks, out, rids, lens, host_k, host_v, dev_k, dev_v, sparse_block_size=block)


def _blocks_args(scn, how: str | None) -> tuple:
    """The block call's arguments; ``how``: ``top_k_device_locs`` laid over ``top_k_blocks`` (``"overlap"``: both
    views of one buffer, one element apart) or apart (``None``)."""
    base, blocks = scn.base, scn.top_k_blocks
    out = torch.full((scn.batch, scn.tokens), -7, dtype=I32, device=blocks.device)
    if how == "overlap":
        buffer = torch.zeros(out.numel() + 1, dtype=I32, device=blocks.device)
        buffer[1 : 1 + blocks.numel()] = blocks.flatten()
        out, blocks = buffer[: out.numel()].view(out.shape), buffer[1 : 1 + blocks.numel()].view(blocks.shape)
    return (base.state, blocks, out, base.req_pool_indices, base.seq_lens, base.host_cache, scn.host_cache_v,
            base.device_buffer.clone(), scn.device_buffer_v.clone(), scn.block)  # fmt: skip


def test_swap_in_blocks_op_schema_is_the_block_flat_fields():
    from kvplan.calls import BLOCK_FLAT_FIELDS

    for name, fields in (("swap_in", FLAT_FIELDS), ("swap_in_blocks", BLOCK_FLAT_FIELDS)):
        schema = getattr(torch.ops.kvplan, name).default._schema
        assert [a.name for a in schema.arguments] == list(fields)
        newest = next(a for a in schema.arguments if a.name == "check_newest")
        assert str(newest.type) == "bool"
    assert BLOCK_FLAT_FIELDS[: len(FLAT_FIELDS)] == FLAT_FIELDS


def test_copy_and_materialize_op_schemas_are_their_records_flat_fields():
    """``CopyCall.flat()``/``flat_kv()`` lay a copy's record out as ``kvplan::copy_planned``/``copy_planned_kv`` take
    it, and ``MaterializeCall``'s fields are ``kvplan::materialize``'s arguments in order (each field holds its
    name)."""
    import types

    plan = types.SimpleNamespace(src="miss_src", dst="miss_dst", count="miss_count")
    copy = CopyCall(plan, *CopyCall._fields[1:])
    for name, flat in (("copy_planned", copy.flat()), ("copy_planned_kv", copy.flat_kv())):
        assert tuple(a.name for a in getattr(torch.ops.kvplan, name).default._schema.arguments) == flat, name
    schema = torch.ops.kvplan.materialize.default._schema
    assert tuple(a.name for a in schema.arguments) == MaterializeCall._fields


def test_the_ops_hand_one_record_to_their_route_never_through_the_kernels_public_functions(monkeypatch, device):
    """Eagerly ``ops.swap_in``, ``copy_planned`` and ``materialize`` build their call's record once and hand it to
    ``run_swap_in``, ``run_copy`` and ``run_materialize`` (the pool's route), not to ``kvplan.kernels``' public
    functions (frames that only forwarded). (The swap-in's launch is stubbed: its results are
    ``test_python_api_matches_the_kernels_and_keeps_their_errors``'.)"""
    from kvplan.kernels import copy, fused_kv, hisparse

    for module, name in ((hisparse, "swap_in"), (copy, "copy_planned"), (fused_kv, "materialize")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"kvplan.kernels.{_name} called"))
    handed = []
    real = {name: getattr(ops, name) for name in ("run_copy", "run_materialize")}
    monkeypatch.setattr(ops, "run_swap_in", lambda call, **kwargs: handed.append(call) or call.plan)
    for name, run in real.items():
        monkeypatch.setattr(ops, name, lambda call, _run=run, **kwargs: handed.append(call) or _run(call, **kwargs))
    engine = make_engine(device, SMALL, seed=13)
    inp = step_inputs(engine, torch.Generator().manual_seed(14), 2, SMALL.steps)
    args, kwargs = _api_args(engine, swap_in_call_for(engine, inp, True))
    assert ops.swap_in(*args, **kwargs) is kwargs["plan"]
    plan = MissPlan(torch.tensor([[3, 9]], device=device), torch.tensor([[0, 7]], dtype=I32, device=device),
                    torch.tensor([2], dtype=I32, device=device))  # fmt: skip
    dev, counters = torch.zeros_like(engine.device_buffers[1]), new_counters(device)
    assert ops.copy_planned(plan, engine.host_caches[1], dev, counters=counters) is None
    reads = materialize_op_args(engine, inp)[:8]
    k, v = ops.materialize(*reads)
    assert [type(call) for call in handed] == [SwapInCall, CopyCall, MaterializeCall]
    swap, copied, mat = handed
    assert swap.plan is kwargs["plan"] and swap.speculative and swap.lru_slots is engine.state.lru_slots
    assert copied.plan is plan and copied.device_buffer is dev and copied.counter_base == REPLAY_COPY_BASE
    assert torch.equal(dev[[0, 7]], engine.host_caches[1][[3, 9]])  # the record's copy ran
    assert counters[REPLAY_COPY_BASE] == 2
    assert mat.kv is reads[0] and (mat.k_out, mat.v_out) == (None, None)
    assert k.shape == v.shape == (GEOMETRY.n_layers, reads[0].shape[0], GEOMETRY.num_kv_heads, GEOMETRY.head_dim)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_swap_in_blocks_refuses_outputs_over_the_blocks_when_traced(device, backend):
    scn = _blocks_scenario(device, 90)
    args = _blocks_args(scn, "overlap")
    blocks, state = args[1].clone(), scn.base.state.clone()
    with pytest.raises(ValueError, match=BLOCKS_SHARED):
        _blocks_step(*args)  # eager
    counting = CountingBackend(backend)
    compiled = torch.compile(_blocks_step, fullgraph=True, backend=counting)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=BLOCKS_SHARED):
        compiled(*args)
    assert counting.graphs == 0  # refused while dynamo traced
    assert torch.equal(args[1], blocks)  # nothing written
    assert torch.equal(scn.base.state.device_buffer_tokens, state.device_buffer_tokens)


def test_compiled_swap_in_blocks_traced_apart_refuses_overlapping_ones_when_it_runs(device):
    backend = CountingBackend()
    compiled = torch.compile(_blocks_step, fullgraph=True, backend=backend)
    scn = _blocks_scenario(device, 91)
    compiled(*_blocks_args(scn, None))
    assert {"kvplan.check_memory.default", "kvplan.swap_in_blocks.default"} <= backend.ops
    args = _blocks_args(scn, "overlap")
    blocks, state = args[1].clone(), scn.base.state.clone()
    with pytest.raises((ValueError, torch._dynamo.exc.TorchRuntimeError), match=BLOCKS_SHARED):
        compiled(*args)
    assert torch.equal(args[1], blocks)
    assert torch.equal(scn.base.state.device_buffer_tokens, state.device_buffer_tokens)


def test_compiled_kv_replay_refuses_v_rows_over_the_host_v_rows_when_it_runs(device):
    scn = _blocks_scenario(device, 92)
    args = _blocks_args(scn, None)
    plan = _blocks_step(*args)
    assert int(plan.count.clamp(min=0).sum()) > 0
    host_k, host_v = scn.base.host_cache.flip(0).contiguous(), scn.host_cache_v.flip(0).contiguous()
    dev_k, dev_v = torch.zeros_like(args[7]), torch.zeros_like(args[8])
    replay = torch.compile(lambda p, hk, dk, hv, dv: ops.copy_planned(p, hk, dk, host_cache_v=hv, device_buffer_v=dv),
                           fullgraph=True, backend="aot_eager")  # fmt: skip
    replay(plan, host_k, dev_k, host_v, dev_v)
    before = host_v.clone()
    with pytest.raises(ValueError, match=r"device_buffer_v must not share memory with host_cache_v"):
        replay(plan, host_k, dev_k, host_v, host_v[: dev_v.shape[0]])
    assert torch.equal(host_v, before)
