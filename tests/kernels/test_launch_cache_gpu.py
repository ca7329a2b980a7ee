"""The launch cache on the GPU (kvplan.runtime.launch_replay.LaunchCache): a swap-in handed launch records, laid out
like a checked one, is launched again from its recorded Triton launches and still equals the reference; a call with an
argument at another address is checked again (a bad one raises, and is never remembered). Under TRITON_INTERPRET
nothing is recorded, so this runs only on a GPU. Small shapes: one compiled variant of its own."""

from __future__ import annotations

import pytest
import torch
from helpers.plans import assert_same_plan_rows
from helpers.swap_in_scenarios import build

import kvplan.kernels.hisparse as hisparse
from kvplan import MissPlan, PlanBufferPool, kernels, reference
from kvplan.counters import new_counters, read_counters
from kvplan.runtime.launch_replay import LaunchCache
from kvplan.runtime.triton_adapter import _Address
from kvplan.state import HotBufferState

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
B, S, K, HOT, TAIL, SCRATCH, MAX_LEN = 4, 2, 32, 64, 4, 8, 2048
TABLES = ("device_buffer_tokens", "device_buffer_locs", "lru_slots", "host_cache_locs", "scratch_locs")


def test_identical_speculative_swap_in_on_pool_buffers_is_replayed_and_a_moved_argument_is_checked_again(monkeypatch):
    scn = build(
        seed=7,
        speculative=True,
        batch=B,
        steps=S,
        top_k=K,
        hot=HOT,
        tail=TAIL,
        lens=[1500, 900, 40, 1900],
        max_len=MAX_LEN,
        requests=6,
        scratch=SCRATCH,
        miss_rate=0.4,
        index_dtype=torch.int32,
        num_real=B,
        device=DEV,
        pin=True,
    )
    assert scn.host_cache.is_pinned() and scn.state.device.type == "cuda"
    state, ref_state = scn.state, scn.state.clone()
    dev, ref_dev = scn.device_buffer, scn.device_buffer.clone()
    ref_counters = new_counters(DEV)

    pool = PlanBufferPool(DEV)
    pool.ensure_capacity(batch=B, num_steps=S, top_k=K)
    plan, workspace = pool.miss_plan(B, S, K), pool.workspace(B, S, K)  # the pool's buffers

    checks = []
    check_swap_in = hisparse.check_swap_in

    def counting_check(call, **kwargs):
        checks.append(call.top_k_device_locs.data_ptr())
        return check_swap_in(call, **kwargs)

    monkeypatch.setattr(hisparse, "check_swap_in", counting_check)
    records = LaunchCache()  # the kernel calls' records (the pool keeps its own): the first call below is checked
    replays = records.relaunches

    def kernel_call(out, launch=kernels.swap_in):
        args = (state, scn.top_k_tokens, out, scn.req_pool_indices, scn.seq_lens, scn.host_cache, dev)
        if launch == pool.swap_in:  # the pool passes its own plan, workspace and counters
            return launch(*args, num_real_reqs=scn.num_real_reqs)
        return launch(
            *args, num_real_reqs=scn.num_real_reqs, plan=plan, workspace=workspace, counters=pool.counters,
            launch_records=records,
        )  # fmt: skip

    def equals_reference(out, written):
        """The reference's call on its clones, then everything the kernel wrote compared exactly."""
        ref_out = torch.full_like(out, -7)
        ref_plan = MissPlan(
            torch.full((B, S * K), -9, dtype=torch.int64, device=DEV),
            torch.full((B, S * K), -9, dtype=torch.int32, device=DEV),
            torch.full((B,), -9, dtype=torch.int32, device=DEV),
        )
        reference.swap_in(
            ref_state,
            scn.top_k_tokens,
            ref_out,
            scn.req_pool_indices,
            scn.seq_lens,
            scn.host_cache,
            ref_dev,
            num_real_reqs=scn.num_real_reqs,
            plan=ref_plan,
            counters=ref_counters,
        )
        torch.cuda.synchronize()
        assert (written.src.data_ptr(), written.dst.data_ptr(), written.count.data_ptr()) == (
            plan.src.data_ptr(),
            plan.dst.data_ptr(),
            plan.count.data_ptr(),
        )
        assert torch.equal(out, ref_out)
        for name in TABLES:
            assert torch.equal(getattr(state, name), getattr(ref_state, name)), name
        assert torch.equal(dev.view(torch.uint8), ref_dev.view(torch.uint8))
        assert torch.equal(plan.count[:B], ref_plan.count)
        assert_same_plan_rows(plan.src, plan.dst, ref_plan.src, ref_plan.dst, ref_plan.count)
        assert read_counters(pool.counters) == read_counters(ref_counters)
        return int(ref_plan.count.sum())

    out = torch.full(scn.top_k_tokens.shape, -7, dtype=torch.int32, device=DEV)
    # 1. first call: checked and launched (and recorded)
    assert equals_reference(out, kernel_call(out)) > 0
    assert len(checks) == 1 and records.relaunches == replays
    # what is kept: addresses only, device pointers as plain ints, the pinned host cache as an address Triton translates
    (launches,) = records._entries.values()
    # (an on-chip resolve's record is a callable holding its arguments packed as plain ints: no tensor either)
    kept = [v for entry in launches if not callable(entry) for v in entry[2]]
    assert not any(isinstance(v, torch.Tensor) for v in kept)
    assert {v.data_ptr() for v in kept if isinstance(v, _Address)} == {scn.host_cache.data_ptr()}
    assert plan.src.data_ptr() in kept and pool.counters.data_ptr() in kept
    # 2. the identical call (same tensors, the pool's plan and workspace): replayed, not checked, still exact
    out.fill_(-7)
    equals_reference(out, kernel_call(out))
    assert len(checks) == 1 and records.relaunches == replays + 1
    # 3. the pool's own launch records into the pool's records (its stats count them), not the test's: checked once
    out.fill_(-7)
    equals_reference(out, kernel_call(out, pool.swap_in))
    assert len(checks) == 2 and records.relaunches == replays + 1
    assert (pool.stats().launch_records, pool.stats().relaunches) == (1, 0)
    # 4. relaunched from the pool's record, its second relaunch captured as one CUDA graph; still exact
    for _ in range(2):
        out.fill_(-7)
        equals_reference(out, kernel_call(out, pool.swap_in))
    assert len(checks) == 2 and (pool.stats().relaunches, pool.stats().launch_graphs) == (2, 1)
    # and the test's record: its second relaunch captured as well
    out.fill_(-7)
    equals_reference(out, kernel_call(out))
    assert launches.graph, "a call of several launches relaunched twice is captured as a CUDA graph"
    assert len(checks) == 2 and records.relaunches == replays + 2

    # 5. one argument moved to another address (a good tensor): checked again, launched, then replayed in turn
    moved = torch.full_like(out, -7)
    assert moved.data_ptr() != out.data_ptr()
    equals_reference(moved, kernel_call(moved))
    assert checks[2:] == [moved.data_ptr()] and records.relaunches == replays + 2
    moved.fill_(-7)
    equals_reference(moved, kernel_call(moved))
    assert len(checks) == 3 and records.relaunches == replays + 3

    # 6. a bad tensor at another address: checked again and refused before anything is written, never remembered
    bad = torch.full(out.shape, -7, dtype=torch.int64, device=DEV)
    before = {name: getattr(state, name).clone() for name in TABLES}
    dev_before, count_before, counters_before = dev.clone(), plan.count.clone(), pool.counters.clone()
    for attempt in (1, 2):
        with pytest.raises(ValueError, match="top_k_device_locs must be torch.int32, got torch.int64"):
            kernel_call(bad)
        assert len(checks) == 3 + attempt and records.relaunches == replays + 3
    torch.cuda.synchronize()
    assert all(torch.equal(getattr(state, name), t) for name, t in before.items())
    assert torch.equal(dev, dev_before) and torch.equal(plan.count, count_before)
    assert torch.equal(pool.counters, counters_before) and bool((bad == -7).all())

    # 7. a state table of the wrong dtype is refused when the state is built, before any kernel check
    with pytest.raises(ValueError, match="lru_slots must be torch.int16, got torch.int32"):
        HotBufferState(**{name: getattr(state, name) for name in TABLES} | {"lru_slots": state.lru_slots.int()})

    # 8. the first layout is still cached: replayed, and still exact
    out.fill_(-7)
    equals_reference(out, kernel_call(out))
    assert len(checks) == 5 and records.relaunches == replays + 4
