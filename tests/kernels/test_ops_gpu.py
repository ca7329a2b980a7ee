"""The custom ops on the H200: opcheck at production shapes, and compiled engine steps through the pool (inductor,
dynamic batch, ``mode="reduce-overhead"``) compared bit for bit with the eager step.

The engine (hot-buffer state, a pinned host cache per layer, device buffers, rope tables), its steps and the
eager/compiled comparison are tests/helpers/ops_scenarios.py's, shared with the CPU file (tests/kernels/test_ops.py),
which runs them at tiny shapes under the interpreter. Here: the HiSparse / DFlash shapes, and what only a GPU runs
(pinned host caches, inductor on CUDA, CUDA graphs).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.ops_scenarios import (
    CountingBackend,
    Shapes,
    compare_steps,
    engine_step,
    fresh_dynamo,  # noqa: F401  (autouse: a fresh dynamo around every test)
    make_engine,
    mark_batch_dynamic,
    materialize_op_args,
    step_inputs,
    swap_in_call_for,
)

import kvplan.ops  # noqa: F401  (registers torch.ops.kvplan.*; the pool imports it on its first traced launch)
from kvplan import MaterializeGeometry
from kvplan.counters import REPLAY_COPY_BASE, new_counters

pytestmark = pytest.mark.gpu

I32 = torch.int32
PRODUCTION = Shapes(
    requests=8,
    hot=4096,  # HiSparse: hot slots, tail, scratch rows, K, draft steps
    tail=64,
    max_len=16384,
    scratch=64,
    row=288,  # bf16 elements per KV row (576 bytes)
    layers=3,  # the anchor layer swaps in, the others replay its plan
    geometry=MaterializeGeometry(n_layers=5, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),  # DFlash
    rotary_dim=128,
    max_pos=32768,
    max_batch=8,
    steps=4,
    top_k=2048,
    min_extra=64,
    pinned_host=True,  # read zero-copy by the kernels
    frozen_pool=True,  # as before capture: every step below fits the reservation
)


@pytest.fixture
def shapes() -> Shapes:
    """The shapes every test here runs at. One value, not a parametrization, so the node ids scripts/sanitize.sh
    names stay as they are; give this fixture ``params`` to run the suite at more shapes."""
    return PRODUCTION


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculative", [False, True], ids=["single", "spec"])
def test_opcheck_swap_in_at_production_shapes(speculative, device, shapes):
    engine = make_engine(device, shapes, seed=1)
    inp = step_inputs(engine, torch.Generator().manual_seed(2), 3, shapes.steps if speculative else 0, num_real=2)
    # opcheck clones every tensor argument and a clone of pinned memory is not pinned (the kernels refuse
    # unpinned host caches), so the host cache is handed over device-resident here
    call = swap_in_call_for(engine, inp, speculative, fill=0, host_cache=engine.host_caches[0].to(device))
    assert call.speculative is speculative and (call.scratch_locs is not None) == speculative
    # one op for both paths: the flat fields of SwapInCall, ``speculative`` first
    torch.library.opcheck(torch.ops.kvplan.swap_in.default, (), call.flat_dict())


def test_opcheck_copy_planned_and_materialize_at_production_shapes(device, shapes):
    engine = make_engine(device, shapes, seed=3)
    gen = torch.Generator().manual_seed(4)
    batch, columns = 4, shapes.steps * shapes.top_k
    host_rows, dev_rows = engine.host_caches[1].shape[0], engine.device_buffers[1].shape[0]
    count = torch.randint(0, columns + 1, (batch,), generator=gen, dtype=I32)
    copy_args = dict(
        miss_src=torch.randint(0, host_rows, (batch, columns), generator=gen).to(device),
        miss_dst=torch.randperm(dev_rows, generator=gen)[: batch * columns].reshape(batch, columns).to(I32).to(device),
        miss_count=count.to(device),
        num_real_reqs=torch.tensor([3], dtype=I32, device=device),
        host_cache=engine.host_caches[1].to(device),  # device-resident: opcheck's clones are not pinned
        device_buffer=engine.device_buffers[1],
        counters=new_counters(device),
        counter_base=REPLAY_COPY_BASE,
    )
    torch.library.opcheck(torch.ops.kvplan.copy_planned.default, (), copy_args)

    inp = step_inputs(engine, gen, shapes.max_batch, shapes.steps)
    torch.library.opcheck(torch.ops.kvplan.materialize.default, materialize_op_args(engine, inp))


def test_inductor_step_with_dynamic_batch_matches_eager_and_compiles_once(device, shapes):
    backend = CountingBackend("inductor")
    compiled = torch.compile(engine_step, fullgraph=True, backend=backend)
    b = shapes.max_batch  # production: batches 8, 4, 6 (5 real), 8 (7 real)
    schedule = [(b, b), (b // 2, b // 2), (3 * b // 4, 3 * b // 4 - 1), (b, b - 1)]
    compare_steps(device, shapes, mark_batch_dynamic(compiled), schedule, seed=10)
    assert backend.graphs == 1


def test_inductor_single_step_swap_in_matches_eager(device, shapes):
    compiled = torch.compile(engine_step, fullgraph=True)
    half = shapes.max_batch // 2  # production: batch 4, then 3 real rows
    compare_steps(device, shapes, compiled, [(half, half), (half, half - 1)], speculative=False, seed=20)


def test_reduce_overhead_step_matches_eager(device, shapes):
    """mode="reduce-overhead" (CUDA graphs through inductor's cudagraph trees): warm-up, recording and replays over
    several steps and batch sizes within the reservation, each step equal to the eager one. Where inductor declines
    to capture (it skips graphs with CPU inputs, such as the pinned host caches, or mutated non-static inputs; see
    docs/compile.md) the step still runs compiled; the skips are reported as a warning."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(engine_step, fullgraph=True, mode="reduce-overhead")
    b, half = shapes.max_batch, shapes.max_batch // 2  # production: 8, 8 (6 real), 8, 4, 4 (3 real), 4, 8
    schedule = [(b, b), (b, b - 2), (b, b), (half, half), (half, half - 1), (half, half), (b, b)]
    compare_steps(device, shapes, compiled, schedule, seed=30)
    skips = counters["inductor"]["cudagraph_skips"]
    if skips:
        warnings.warn(f"reduce-overhead: inductor skipped CUDA graphs {skips} time(s) for the pool step", stacklevel=1)
