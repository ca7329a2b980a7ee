"""Hostile inputs, fifth pass: a single-step padding row (``req_pool_indices`` outside ``[0, R)``, or a row at or past
``num_real_reqs``) copies nothing, whatever its plan row still holds from an earlier step, in the swap-in's own copy
(flat, sorted and one-program-per-row paths) and in every replay of the plan (docs/kernels.md §2, rule 1)."""

from __future__ import annotations

import pytest
import torch
from helpers.swap_in_scenarios import small_launch

from kvplan import HotBufferState, MissPlan, PlanBufferPool, kernels, reference, swap_in_workspace_columns
from kvplan.counters import NUM_COUNTERS
from kvplan.kernels import hisparse

I32, I64 = torch.int32, torch.int64
R, HOT, TAIL, LEN, TOP_K, ITEM = 2, 4, 2, 40, 4, 3


def _state(device) -> HotBufferState:
    state = HotBufferState.allocate(R, HOT, TAIL, 64, device)
    for rid in range(R):
        state.admit(rid, torch.arange(LEN) + rid * 64)
        state.write_tail(rid, [LEN - 1])
    return state


def _steps(device):
    """The issue's three steps: requests (0, 1); request 1 alone; (0, R): row 1 is padding, its plan row stale."""
    lens = torch.tensor([LEN, LEN], dtype=I64, device=device)
    return [
        (torch.tensor([[10, 11, 12, 13], [10, 11, 12, 13]], dtype=I32, device=device), torch.tensor([0, 1]), lens),
        (torch.tensor([[14, 15, 16, 17]], dtype=I32, device=device), torch.tensor([1]), lens[:1]),
        (torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]], dtype=I32, device=device), torch.tensor([0, R]), lens),
    ]


def _run_steps(device, swap_in, steps=None):
    """Run the steps through ``swap_in(state, tokens, rids, lens, out, host, dev)`` and the reference side by side;
    assert each step equal (outputs, tables, device rows, counters); return the last plan and both sides."""
    gen = torch.Generator().manual_seed(1)
    host = torch.randint(0, 1 << 30, (R * 64, ITEM), dtype=I32, generator=gen).to(device)
    k_state, r_state = _state(device), _state(device)
    k_dev = torch.zeros(k_state.device_rows, ITEM, dtype=I32, device=device)
    r_dev = k_dev.clone()
    k_counters = torch.zeros(NUM_COUNTERS, dtype=I64, device=device)
    r_counters = k_counters.clone()
    plan = None
    for tokens, rids, lens in steps or _steps(device):
        rids = rids.to(device)
        k_out = torch.full(tokens.shape, -9, dtype=I32, device=device)
        r_out = k_out.clone()
        plan = swap_in(k_state, tokens, rids, lens, k_out, host, k_dev, k_counters)
        reference.swap_in(r_state, tokens, r_out, rids, lens, host, r_dev, counters=r_counters)
        assert torch.equal(k_out, r_out)
        assert torch.equal(k_state.device_buffer_tokens, r_state.device_buffer_tokens)
        assert torch.equal(k_state.lru_slots, r_state.lru_slots)
        assert torch.equal(k_dev, r_dev), "a padding row copied its stale plan row"
        assert torch.equal(k_counters[:2], r_counters[:2]), "a padding row's stale copies were counted"
    return plan, host, k_dev


@pytest.mark.parametrize("path", ["flat", "sorted", "per_row"])
def test_a_padding_rid_copies_nothing_on_every_path(device, path, monkeypatch):
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
    pool = PlanBufferPool(device)

    def swap_in(state, tokens, rids, lens, out, host, dev, counters):
        pool.ensure_capacity(batch=tokens.shape[0], top_k=TOP_K)
        before = pool.counters.clone()
        plan = pool.swap_in(state, tokens, out, rids, lens, host, dev)
        counters += pool.counters - before
        return plan

    plan, host, _ = _run_steps(device, swap_in)
    # the replay of the last plan (row 1 was padding in its swap-in) copies row 0's entries only
    layer = torch.zeros(R * (HOT + TAIL), ITEM, dtype=I32, device=device)
    pool.replay(plan, host_cache=host, device_buffer=layer)
    rows = int(plan.count[0])
    want = torch.zeros_like(layer)
    want[plan.dst[0, :rows].long()] = host[plan.src[0, :rows]]
    assert torch.equal(layer, want)
    assert int(pool.stats().counters.replayed_rows) == rows


@pytest.mark.parametrize("path", ["flat", "sorted", "per_row"])
def test_a_row_past_num_real_reqs_copies_nothing_in_a_replay_without_it(device, path, monkeypatch):
    """The swap-in saw ``num_real_reqs = 1``; a replay given none still skips row 1 (the swap-in's record says it
    was padding), with the pool's plan and with the kernels' own plan and workspace."""
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
    pool = PlanBufferPool(device)
    one = torch.ones(1, dtype=I32, device=device)
    steps = _steps(device)
    steps[2] = (steps[2][0], torch.tensor([0, 1]), steps[2][2])  # a real rid, past num_real_reqs in the last step

    def swap_in(state, tokens, rids, lens, out, host, dev, counters):
        pool.ensure_capacity(batch=tokens.shape[0], top_k=TOP_K)
        before = pool.counters.clone()
        real = one if tokens.shape[0] == 2 and rids.tolist() == [0, 1] and tokens[0, 0] == 20 else None
        plan = pool.swap_in(state, tokens, out, rids, lens, host, dev, num_real_reqs=real)
        counters += pool.counters - before
        return plan

    gen = torch.Generator().manual_seed(1)
    host = torch.randint(0, 1 << 30, (R * 64, ITEM), dtype=I32, generator=gen).to(device)
    state = _state(device)
    dev = torch.zeros(state.device_rows, ITEM, dtype=I32, device=device)
    counters = torch.zeros(NUM_COUNTERS, dtype=I64, device=device)
    for tokens, rids, lens in steps:
        out = torch.empty(tokens.shape, dtype=I32, device=device)
        plan = swap_in(state, tokens, rids.to(device), lens, out, host, dev, counters)
    assert int(plan.count[1]) > 0  # row 1 still holds the second step's count: the contract leaves it alone
    layer = torch.zeros_like(dev)
    pool.replay(plan, host_cache=host, device_buffer=layer)  # no num_real_reqs
    rows = int(plan.count[0])
    want = torch.zeros_like(layer)
    want[plan.dst[0, :rows].long()] = host[plan.src[0, :rows]]
    assert torch.equal(layer, want)
    ref = torch.zeros_like(dev)  # the reference, given the same workspace, agrees
    reference.copy_planned(plan, host, ref, workspace=pool.workspace(2, 1, TOP_K))
    assert torch.equal(ref, want)
    kern = torch.zeros_like(dev)  # and so does the kernels' copy given the swap-in's workspace
    kernels.copy_planned(plan, host, kern, workspace=pool.workspace(2, 1, TOP_K))
    assert torch.equal(kern, want)


def test_a_padding_rid_copies_nothing_with_the_kernels_own_plan(device):
    """The kernels' entry point with a plan kept by the caller across steps (SGLang's persistent ``miss_*``)."""
    plan = MissPlan.allocate(2, TOP_K, device)
    workspace = torch.empty(2, swap_in_workspace_columns(1, TOP_K), dtype=I64, device=device)

    def swap_in(state, tokens, rids, lens, out, host, dev, counters):
        b = tokens.shape[0]
        view = MissPlan(plan.src[:b], plan.dst[:b], plan.count[:b])
        return kernels.swap_in(state, tokens, out, rids, lens, host, dev, plan=view, workspace=workspace[:b],
                               counters=counters)  # fmt: skip

    _run_steps(device, swap_in)
