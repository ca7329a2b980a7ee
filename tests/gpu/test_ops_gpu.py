"""The custom ops on the H200: opcheck at production shapes, and compiled engine steps through the pool (inductor,
dynamic batch, ``mode="reduce-overhead"``) compared bit for bit with the eager step.

Self-contained: builds its own engine (hot-buffer state, a pinned host cache per layer, device buffers, rope tables)
at HiSparse / DFlash shapes. The CPU file (tests/test_ops.py) covers the same ground at tiny shapes.
"""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch
from torch import Tensor

import kvplan.ops  # noqa: F401  (registers torch.ops.kvplan.*; the pool imports it on its first traced launch)
from kvplan import MaterializeGeometry, PlanBufferPool
from kvplan.calls import swap_in_call
from kvplan.counters import REPLAY_COPY_BASE, new_counters
from kvplan.kernels.layout import swap_in_workspace_columns
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState

pytestmark = pytest.mark.gpu

I32, I64 = torch.int32, torch.int64
DEV = torch.device("cuda")
TOP_K, HOT, TAIL, STEPS, SCRATCH = 2048, 4096, 64, 4, 64  # HiSparse: K, hot slots, tail, draft steps, scratch rows
REQUESTS, MAX_LEN, ITEM = 8, 16384, 288  # ITEM: bf16 elements per KV row (576 bytes)
LAYERS = 3  # the anchor layer swaps in, the others replay its plan
DFLASH = MaterializeGeometry(n_layers=5, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
ROTARY_DIM, MAX_POS = 128, 32768
MAX_BATCH = 8


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@attrs.define(eq=False)
class Engine:
    state: HotBufferState
    host_caches: list[Tensor]  # pinned CPU, read zero-copy by the kernels
    device_buffers: list[Tensor]
    rope: dict[str, Tensor]
    lengths: list[int]

    def clone(self) -> Engine:
        return Engine(
            state=self.state.clone(),
            host_caches=self.host_caches,
            device_buffers=[b.clone() for b in self.device_buffers],
            rope=self.rope,
            lengths=list(self.lengths),
        )


def make_engine(seed: int = 0) -> Engine:
    gen = torch.Generator().manual_seed(seed)
    state = HotBufferState.allocate(REQUESTS, HOT, TAIL, MAX_LEN, scratch=SCRATCH)
    host_rows = REQUESTS * MAX_LEN
    lengths = []
    for rid in range(REQUESTS):
        length = int(torch.randint(HOT + 64, MAX_LEN - TAIL, (1,), generator=gen))
        lengths.append(length)
        state.set_host_rows(rid, torch.randperm(host_rows, generator=gen)[:MAX_LEN])
        state.set_hot(rid, torch.randperm(length - 1, generator=gen)[:HOT], torch.randperm(HOT, generator=gen))
        state.write_tail(rid, [length - 1])
    state = attrs.evolve(state, **{f.name: getattr(state, f.name).to(DEV) for f in attrs.fields(HotBufferState)})

    def rows(n: int) -> Tensor:
        return torch.randn(n, ITEM, generator=gen).to(torch.bfloat16)

    angles = torch.rand(MAX_POS, ROTARY_DIM // 2, generator=gen) * 6.3
    rope = {
        "k_norm_weight": (torch.rand(DFLASH.n_layers, DFLASH.head_dim, generator=gen) + 0.5).to(DEV),
        "eps": torch.full((DFLASH.n_layers,), 1e-6, device=DEV),
        "cos_sin_cache": torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEV),
    }
    return Engine(
        state=state,
        host_caches=[rows(host_rows).pin_memory() for _ in range(LAYERS)],
        device_buffers=[rows(state.device_rows).to(DEV) for _ in range(LAYERS)],
        rope=rope,
        lengths=lengths,
    )


def step_inputs(engine: Engine, gen: torch.Generator, batch: int, steps: int, *, num_real: int | None = None) -> dict:
    """``steps == 0``: the single-step path (``top_k_tokens [B, K]``)."""
    num_real = batch if num_real is None else num_real
    s = max(steps, 1)
    rids = torch.randperm(REQUESTS, generator=gen)[:batch]
    lens = torch.tensor([engine.lengths[r] + i for r in rids.tolist() for i in range(s)], dtype=I64)
    high = lens.reshape(batch, s)[:, -1:].expand(batch, s * TOP_K).reshape(batch, s, TOP_K)
    tokens = (torch.rand(batch, s, TOP_K, generator=gen) * (high + 3)).to(I32) - 2
    for rid in rids.tolist():
        engine.state.write_tail(rid, list(range(engine.lengths[rid] - 1, engine.lengths[rid] + s - 1)))
    kv = torch.randn(batch * s, DFLASH.n_layers, 2 * DFLASH.num_kv_heads * DFLASH.head_dim, generator=gen)
    return {
        "top_k_tokens": (tokens if steps else tokens[:, 0]).to(DEV),
        "top_k_device_locs": torch.full(tokens.shape if steps else (batch, TOP_K), -7, dtype=I32, device=DEV),
        "req_pool_indices": rids.to(DEV),
        "seq_lens": lens.to(DEV),
        "num_real_reqs": torch.tensor([num_real], dtype=I32, device=DEV),
        "kv": kv.to(torch.bfloat16).to(DEV),
        "positions": (lens % MAX_POS).to(DEV),
    }


def engine_step(pool: PlanBufferPool, engine: Engine, inp: dict, speculative: bool):
    launch = pool.swap_in_spec if speculative else pool.swap_in
    plan = launch(
        engine.state,  # the whole state, scratch rows included, on both paths
        top_k_tokens=inp["top_k_tokens"],
        top_k_device_locs=inp["top_k_device_locs"],
        req_pool_indices=inp["req_pool_indices"],
        seq_lens=inp["seq_lens"],
        num_real_reqs=inp["num_real_reqs"],
        host_cache=engine.host_caches[0],
        device_buffer=engine.device_buffers[0],
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
        inp["kv"], rope["k_norm_weight"], rope["eps"], rope["cos_sin_cache"], inp["positions"], rotary_dim=ROTARY_DIM
    )
    return plan, k_out, v_out


def make_pool() -> PlanBufferPool:
    pool = PlanBufferPool(DEV, geometry=DFLASH)
    pool.reserve(batch=MAX_BATCH, num_steps=STEPS, top_k=TOP_K, total_ctx=MAX_BATCH * STEPS)
    pool.freeze()  # as before capture: every step below fits the reservation
    return pool


def run_step(step, pool: PlanBufferPool, engine: Engine, inp: dict, speculative: bool) -> dict[str, Tensor]:
    """Run ``step`` on a private output tensor; what it wrote, copied to the host right away (a CUDA-graph replay
    may reuse its memory on the next call)."""
    inp = {**inp, "top_k_device_locs": inp["top_k_device_locs"].clone()}
    batch, steps = inp["top_k_tokens"].shape[0], inp["top_k_tokens"].shape[1] if speculative else 1
    pool.ensure_capacity(batch=batch, num_steps=steps, top_k=TOP_K, total_ctx=inp["kv"].shape[0])
    torch.compiler.cudagraph_mark_step_begin()
    plan, k_out, v_out = step(pool, engine, inp, speculative)
    real = int(inp["num_real_reqs"][0])
    counts = plan.count[:real].cpu()
    written = {
        "top_k_device_locs": inp["top_k_device_locs"],
        "device_buffer_tokens": engine.state.device_buffer_tokens,
        "lru_slots": engine.state.lru_slots,
        "miss_count": counts,
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
        if a.is_floating_point():  # bit-exact
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            a, b = a.view(bits), b.view(bits)
        assert a.shape == b.shape and torch.equal(a, b), f"{name} differs between the compiled and the eager step"


def compare_steps(compiled_step, schedule, *, speculative: bool = True, seed: int = 0) -> None:
    """Eager and compiled steps side by side on identical engines and pools; state carries over between steps."""
    eager_engine = make_engine(seed)
    compiled_engine = eager_engine.clone()
    eager_pool, compiled_pool = make_pool(), make_pool()
    gen = torch.Generator().manual_seed(seed + 1)
    for batch, num_real in schedule:
        inp = step_inputs(eager_engine, gen, batch, STEPS if speculative else 0, num_real=num_real)
        compiled_engine.state.device_buffer_tokens.copy_(eager_engine.state.device_buffer_tokens)  # new tails
        want = run_step(engine_step, eager_pool, eager_engine, inp, speculative)
        got = run_step(compiled_step, compiled_pool, compiled_engine, inp, speculative)
        assert_identical(got, want)
        assert int(want["miss_count"].sum()) > 0


class CountingBackend:
    def __init__(self, inner: str) -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True], ids=["swap_in", "swap_in_spec"])
def test_opcheck_swap_in_at_production_shapes(speculative):
    engine = make_engine(seed=1)
    inp = step_inputs(engine, torch.Generator().manual_seed(2), 3, STEPS if speculative else 0, num_real=2)
    batch, n = inp["top_k_tokens"].shape[0], inp["top_k_tokens"][0].numel()
    call = swap_in_call(
        speculative,
        engine.state,
        inp["top_k_tokens"],
        inp["top_k_device_locs"],
        inp["req_pool_indices"],
        inp["seq_lens"],
        # opcheck clones every tensor argument and a clone of pinned memory is not pinned (the kernels refuse
        # unpinned host caches), so the host cache is handed over device-resident here
        engine.host_caches[0].to(DEV),
        engine.device_buffers[0],
        inp["num_real_reqs"],
        MissPlan(
            torch.zeros(batch, n, dtype=I64, device=DEV),
            torch.zeros(batch, n, dtype=I32, device=DEV),
            torch.zeros(batch, dtype=I32, device=DEV),
        ),
        torch.zeros(batch, swap_in_workspace_columns(STEPS if speculative else 1, TOP_K), dtype=I64, device=DEV),
        new_counters(DEV),
    )
    assert call.speculative is speculative and (call.scratch_locs is not None) == speculative
    # one op for both paths: the flat fields of SwapInCall, ``speculative`` first
    torch.library.opcheck(torch.ops.kvplan.swap_in.default, (), call._asdict())


def test_opcheck_copy_planned_and_materialize_at_production_shapes():
    engine = make_engine(seed=3)
    gen = torch.Generator().manual_seed(4)
    batch, columns = 4, STEPS * TOP_K
    host_rows, dev_rows = engine.host_caches[1].shape[0], engine.device_buffers[1].shape[0]
    count = torch.randint(0, columns + 1, (batch,), generator=gen, dtype=I32)
    copy_args = dict(
        miss_src=torch.randint(0, host_rows, (batch, columns), generator=gen).to(DEV),
        miss_dst=torch.randperm(dev_rows, generator=gen)[: batch * columns].reshape(batch, columns).to(I32).to(DEV),
        miss_count=count.to(DEV),
        num_real_reqs=torch.tensor([3], dtype=I32, device=DEV),
        host_cache=engine.host_caches[1].to(DEV),  # device-resident: opcheck's clones are not pinned
        device_buffer=engine.device_buffers[1],
        counters=new_counters(DEV),
        counter_base=REPLAY_COPY_BASE,
    )
    torch.library.opcheck(torch.ops.kvplan.copy_planned.default, (), copy_args)

    inp = step_inputs(engine, gen, MAX_BATCH, STEPS)
    rope = engine.rope
    shape = (DFLASH.n_layers, inp["kv"].shape[0], DFLASH.num_kv_heads, DFLASH.head_dim)
    args = (
        inp["kv"],
        rope["k_norm_weight"],
        rope["eps"],
        rope["cos_sin_cache"],
        inp["positions"],
        DFLASH.num_kv_heads,
        DFLASH.head_dim,
        ROTARY_DIM,
        torch.empty(shape, dtype=torch.bfloat16, device=DEV),
        torch.empty(shape, dtype=torch.bfloat16, device=DEV),
        False,  # check_positions
    )
    torch.library.opcheck(torch.ops.kvplan.materialize.default, args)


def test_inductor_step_with_dynamic_batch_matches_eager_and_compiles_once():
    backend = CountingBackend("inductor")
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)

    def marked(pool, engine, inp, speculative):
        for name in ("top_k_tokens", "top_k_device_locs", "req_pool_indices", "seq_lens", "kv", "positions"):
            torch._dynamo.mark_dynamic(inp[name], 0)
        return compiled(pool, engine, inp, speculative)

    compare_steps(marked, [(8, 8), (4, 4), (6, 5), (8, 7)], seed=10)
    assert backend.graphs == 1


def test_inductor_single_step_swap_in_matches_eager():
    compiled = torch.compile(engine_step, fullgraph=True)
    compare_steps(compiled, [(4, 4), (4, 3)], speculative=False, seed=20)


def test_reduce_overhead_step_matches_eager():
    """mode="reduce-overhead" (CUDA graphs through inductor's cudagraph trees): warm-up, recording and replays over
    several steps and batch sizes within the reservation, each step equal to the eager one. Where inductor declines
    to capture (it skips graphs with CPU inputs, such as the pinned host caches, or mutated non-static inputs; see
    docs/compile.md) the step still runs compiled; the skips are reported as a warning."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(engine_step, fullgraph=True, mode="reduce-overhead")
    compare_steps(compiled, [(8, 8), (8, 6), (8, 8), (4, 4), (4, 3), (4, 4), (8, 8)], seed=30)
    skips = counters["inductor"]["cudagraph_skips"]
    if skips:
        warnings.warn(f"reduce-overhead: inductor skipped CUDA graphs {skips} time(s) for the pool step", stacklevel=1)
