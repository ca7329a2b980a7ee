"""Engine steps through the pool and the custom ops, shared by the CPU tests (tests/kernels/test_ops.py: tiny shapes
under the Triton interpreter) and the GPU suite (tests/kernels/test_ops_gpu.py: HiSparse / DFlash production shapes,
pinned host caches, CUDA graphs). Every builder takes the device and a ``Shapes``; each test file defines its
own shapes.

An engine in miniature: hot-buffer state, per-layer host caches and device buffers, rope tables, one step's inputs;
``engine_step`` is what an engine's decode step does with kvplan (the function torch.compile traces), ``compare_steps``
runs it eagerly and compiled side by side and compares everything written bit for bit.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import Tensor

from kvplan import MaterializeGeometry, PlanBufferPool
from kvplan.calls import SwapInCall, swap_in_call
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.workspace import swap_in_workspace_columns

I32, I64 = torch.int32, torch.int64


@attrs.frozen
class Shapes:
    """An engine's sizes, its pool's reservation, and where the engine keeps its host caches."""

    requests: int
    hot: int
    tail: int
    max_len: int
    scratch: int
    row: int  # bf16 elements per KV row
    layers: int  # KV caches the step swaps into: layer 0 by swap-in, the others by plan replay
    geometry: MaterializeGeometry
    rotary_dim: int
    max_pos: int
    max_batch: int  # the pool's reservation: batch, steps, top_k
    steps: int
    top_k: int
    min_extra: int  # every request is longer than ``hot`` by at least this many tokens
    pinned_host: bool = False  # host caches in pinned CPU memory (read zero-copy by the kernels), else on the device
    frozen_pool: bool = False  # the pool frozen after its reservation, as before CUDA-graph capture


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Autouse in the files that import it: every test starts and ends with a fresh dynamo."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@attrs.define(eq=False)
class Engine:
    shapes: Shapes
    state: HotBufferState
    host_caches: list[Tensor]  # read-only
    device_buffers: list[Tensor]
    rope: dict[str, Tensor]
    lengths: list[int]  # per request: tokens before this step's drafts

    def clone(self) -> Engine:
        return Engine(
            shapes=self.shapes,
            state=self.state.clone(),
            host_caches=self.host_caches,  # read-only
            device_buffers=[b.clone() for b in self.device_buffers],
            rope=self.rope,
            lengths=list(self.lengths),
        )


def make_engine(device: torch.device, shapes: Shapes, seed: int = 0) -> Engine:
    """Long requests (length > hot) with a random hot region, LRU order and host rows; the tail holds the newest
    token and the drafts. Every device row starts random, so a copy shows up as a change."""
    device, s = torch.device(device), shapes
    gen = torch.Generator().manual_seed(seed)
    state = HotBufferState.allocate(s.requests, s.hot, s.tail, s.max_len, scratch=s.scratch)
    host_rows = s.requests * s.max_len
    lengths = []
    for rid in range(s.requests):
        length = int(torch.randint(s.hot + s.min_extra, s.max_len - s.tail, (1,), generator=gen))
        lengths.append(length)
        state.set_host_rows(rid, torch.randperm(host_rows, generator=gen)[: s.max_len])
        held = torch.randperm(length - 1, generator=gen)[: s.hot]
        state.set_hot(rid, held, torch.randperm(s.hot, generator=gen))
        state.write_tail(rid, [length - 1])
    state = attrs.evolve(state, **{f.name: getattr(state, f.name).to(device) for f in attrs.fields(HotBufferState)})
    assert state.scratch_locs is not None and state.device.type == device.type
    rows = state.device_rows

    def kv_rows(n: int, *, host: bool = False) -> Tensor:
        t = torch.randn(n, s.row, generator=gen).to(torch.bfloat16)
        return t.pin_memory() if host and s.pinned_host else t.to(device)

    angles = torch.rand(s.max_pos, s.rotary_dim // 2, generator=gen) * 6.3
    rope = {
        "k_norm_weight": (torch.rand(s.geometry.n_layers, s.geometry.head_dim, generator=gen) + 0.5).to(device),
        "eps": torch.full((s.geometry.n_layers,), 1e-6, device=device),
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1).to(device),
    }
    return Engine(
        shapes=s,
        state=state,
        host_caches=[kv_rows(host_rows, host=True) for _ in range(s.layers)],
        device_buffers=[kv_rows(rows) for _ in range(s.layers)],
        rope=rope,
        lengths=lengths,
    )


def step_inputs(engine: Engine, gen: torch.Generator, batch: int, steps: int, *, num_real: int | None = None) -> dict:
    """One step's inputs: ``batch`` rows (the first ``num_real`` real, distinct requests), top-k tokens mixing
    hits, misses, duplicates and invalid tokens, the drafts' fused KV projection and positions. ``steps == 0`` means
    the single-step path (``top_k_tokens [B, K]``)."""
    device, shapes = engine.state.device, engine.shapes
    top_k, geometry = shapes.top_k, shapes.geometry
    num_real = batch if num_real is None else num_real
    s = max(steps, 1)
    rids = torch.randperm(shapes.requests, generator=gen)[:batch]
    lens = torch.tensor([engine.lengths[r] + i for r in rids.tolist() for i in range(s)], dtype=I64)
    high = lens.reshape(batch, s)[:, -1:].expand(batch, s * top_k).reshape(batch, s, top_k)
    tokens = (torch.rand(batch, s, top_k, generator=gen) * (high + 3)).to(I32) - 2
    for rid in rids.tolist():  # drafts in the tail: newest token, then the step's new tokens
        engine.state.write_tail(rid, list(range(engine.lengths[rid] - 1, engine.lengths[rid] + s - 1)))
    total = batch * s
    kv = torch.randn(total, geometry.n_layers, 2 * geometry.num_kv_heads * geometry.head_dim, generator=gen)
    return {
        "top_k_tokens": (tokens if steps else tokens[:, 0]).to(device),
        "top_k_device_locs": torch.full(tokens.shape if steps else (batch, top_k), -7, dtype=I32, device=device),
        "req_pool_indices": rids.to(device),
        "seq_lens": lens.to(device),
        "num_real_reqs": torch.tensor([num_real], dtype=I32, device=device),
        "kv": kv.to(torch.bfloat16).to(device),
        "positions": (lens % shapes.max_pos).to(device),
    }


def engine_step(pool: PlanBufferPool, engine: Engine, inp: dict, speculative: bool):
    """What an engine's decode step does with kvplan: swap-in on the anchor layer, replay its plan into the layers
    sharing its top-k, materialize the drafts' KV. The function torch.compile traces."""
    plan = pool.swap_in(
        engine.state,  # the whole state, scratch rows included, on both paths
        top_k_tokens=inp["top_k_tokens"],
        top_k_device_locs=inp["top_k_device_locs"],
        req_pool_indices=inp["req_pool_indices"],
        seq_lens=inp["seq_lens"],
        num_real_reqs=inp["num_real_reqs"],
        host_cache=engine.host_caches[0],
        device_buffer=engine.device_buffers[0],
        speculative=speculative,
    )
    for layer in range(1, len(engine.host_caches)):
        pool.replay(
            plan,
            host_cache=engine.host_caches[layer],
            device_buffer=engine.device_buffers[layer],
            num_real_reqs=inp["num_real_reqs"],
        )
    rope = engine.rope
    k_out, v_out = pool.materialize(
        inp["kv"],
        rope["k_norm_weight"],
        rope["eps"],
        rope["cos_sin_cache"],
        inp["positions"],
        rotary_dim=engine.shapes.rotary_dim,
    )
    return plan, k_out, v_out


def make_pool(device: torch.device, shapes: Shapes) -> PlanBufferPool:
    s = shapes
    pool = PlanBufferPool(device, geometry=s.geometry)
    pool.reserve(batch=s.max_batch, num_steps=s.steps, top_k=s.top_k, total_ctx=s.max_batch * s.steps)
    if s.frozen_pool:
        pool.freeze()  # as before capture: every step must fit the reservation
    return pool


def run_step(step, pool: PlanBufferPool, engine: Engine, inp: dict, speculative: bool) -> dict[str, Tensor]:
    """Run ``step`` on private copies of the step's outputs; everything it wrote, copied to the host right away (a
    CUDA-graph replay may reuse its memory on the next call)."""
    inp = {**inp, "top_k_device_locs": inp["top_k_device_locs"].clone()}
    batch, steps = inp["top_k_tokens"].shape[0], inp["top_k_tokens"].shape[1] if speculative else 1
    pool.ensure_capacity(batch=batch, num_steps=steps, top_k=engine.shapes.top_k, total_ctx=inp["kv"].shape[0])
    if engine.state.device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
    plan, k_out, v_out = step(pool, engine, inp, speculative)
    real = int(inp["num_real_reqs"][0])
    counts = plan.count[:real].cpu()
    written = {
        "top_k_device_locs": inp["top_k_device_locs"],
        "device_buffer_tokens": engine.state.device_buffer_tokens,
        "lru_slots": engine.state.lru_slots,
        "miss_count": counts,  # single-step padding rows leave theirs untouched (pool memory): real rows only
        "counters": pool.counters,
        "k_out": k_out,
        "v_out": v_out,
        "plan_shape": torch.tensor([*plan.src.shape, *plan.dst.shape, *plan.count.shape]),
    }
    for layer, rows in enumerate(engine.device_buffers):
        written[f"device_buffer[{layer}]"] = rows
    for b, n in enumerate(counts.tolist()):
        written[f"miss_src[{b}]"] = plan.src[b, :n]
        written[f"miss_dst[{b}]"] = plan.dst[b, :n]
    return {name: t.detach().cpu().clone() for name, t in written.items()}


def assert_identical(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if a.is_floating_point():  # bit-exact, whatever the values
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            a, b = a.view(bits), b.view(bits)
        assert a.shape == b.shape and torch.equal(a, b), f"{name} differs between the compiled and the eager step"


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it (one per compile or recompile)."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs = 0
        self.ops: set[str] = set()  # the kvplan ops the graphs call
        self.speculative: set[bool] = set()  # the path flag of their kvplan.swap_in nodes

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.ops |= {str(n.target) for n in gm.graph.nodes if str(n.target).startswith("kvplan.")}
        for n in gm.graph.nodes:
            if str(n.target) == "kvplan.swap_in.default":
                self.speculative.add(n.args[0] if n.args else n.kwargs["speculative"])
        return self.inner(gm, example_inputs)


def compare_steps(
    device: torch.device, shapes: Shapes, compiled_step, schedule, *, speculative: bool = True, seed: int = 0
) -> None:
    """Run the eager step and ``compiled_step`` side by side on identical engines and pools over ``schedule``
    (``(batch, num_real)`` per step); the state carries over from step to step, so every step must match."""
    eager_engine = make_engine(device, shapes, seed)
    compiled_engine = eager_engine.clone()
    eager_pool, compiled_pool = make_pool(device, shapes), make_pool(device, shapes)
    gen = torch.Generator().manual_seed(seed + 1)
    for batch, num_real in schedule:
        inp = step_inputs(eager_engine, gen, batch, shapes.steps if speculative else 0, num_real=num_real)
        compiled_engine.state.device_buffer_tokens.copy_(eager_engine.state.device_buffer_tokens)  # new tails
        want = run_step(engine_step, eager_pool, eager_engine, inp, speculative)
        got = run_step(compiled_step, compiled_pool, compiled_engine, inp, speculative)
        assert_identical(got, want)
        assert int(want["miss_count"].sum()) > 0  # the step really copied rows


def mark_batch_dynamic(step):
    """``step`` with the batch dimension of every step input marked dynamic first, as an engine does."""

    def marked(pool, engine, inp, speculative):
        for name in ("top_k_tokens", "top_k_device_locs", "req_pool_indices", "seq_lens", "kv", "positions"):
            torch._dynamo.mark_dynamic(inp[name], 0)
        return step(pool, engine, inp, speculative)

    return marked


# ---------------------------------------------------------------------------------------------------------------------
# The ops' flat arguments for opcheck


def swap_in_call_for(
    engine: Engine,
    inp: dict,
    speculative: bool,
    *,
    with_plan: bool = True,
    fill: int = -9,
    host_cache: Tensor | None = None,
) -> SwapInCall:
    """The swap-in op's flat arguments for this step: a plan and workspace filled with ``fill`` (none without
    ``with_plan``), fresh counters, ``host_cache`` in place of the engine's anchor-layer cache when given."""
    batch, n = inp["top_k_tokens"].shape[0], inp["top_k_tokens"][0].numel()
    steps = inp["top_k_tokens"].shape[1] if speculative else 1
    plan = workspace = None
    device = engine.state.device
    if with_plan:
        plan = MissPlan(
            torch.full((batch, n), fill, dtype=I64, device=device),
            torch.full((batch, n), fill, dtype=I32, device=device),
            torch.full((batch,), fill, dtype=I32, device=device),
        )
        columns = swap_in_workspace_columns(steps, engine.shapes.top_k)
        workspace = torch.full((batch, columns), fill, dtype=I64, device=device)
    return swap_in_call(
        speculative,
        engine.state,
        inp["top_k_tokens"],
        inp["top_k_device_locs"],
        inp["req_pool_indices"],
        inp["seq_lens"],
        engine.host_caches[0] if host_cache is None else host_cache,
        engine.device_buffers[0],
        inp["num_real_reqs"],
        plan,
        workspace,
        new_counters(device),
    )


def materialize_op_args(engine: Engine, inp: dict) -> tuple:
    """The materialize op's positional arguments for this step's drafts (fresh outputs, no positions check)."""
    g, rope, device = engine.shapes.geometry, engine.rope, engine.state.device
    shape = (g.n_layers, inp["kv"].shape[0], g.num_kv_heads, g.head_dim)
    return (
        inp["kv"],
        rope["k_norm_weight"],
        rope["eps"],
        rope["cos_sin_cache"],
        inp["positions"],
        g.num_kv_heads,
        g.head_dim,
        engine.shapes.rotary_dim,
        torch.empty(shape, dtype=torch.bfloat16, device=device),
        torch.empty(shape, dtype=torch.bfloat16, device=device),
        False,  # check_positions
    )
