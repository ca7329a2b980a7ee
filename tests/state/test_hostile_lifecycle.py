"""Hostile inputs, fourth pass (issue 27 items 1-4; issue 28 item 4): the request lifecycle of a ``HotBufferState``
(tables given views of themselves, a live slot re-admitted, plans replayed after their requests left, the rules
``state.check`` names) and the checked mode (no dependence on what an earlier call left, a dropped token after the
step ran)."""

from __future__ import annotations

import pytest
import torch
from helpers.pool_steps import _run, _setup

from kvplan import (
    HotBufferState,
    MissPlan,
    PlanBufferPool,
    PoolCapacityError,
    PoolConfig,
    StateCheckError,
    TokensDroppedError,
)

I32 = torch.int32


# ---------------------------------------------------------------------------------------------------------------------
# 1. inputs that are views of the tables are read before anything is written


def test_admit_with_the_slots_own_rows_stores_them():
    s = HotBufferState.allocate(2, 4, 2, 12)
    s.admit(1, torch.arange(100, 106))
    s.admit(1, s.host_cache_locs[1, :6], replace=True)  # a re-admit with the same rows: finish clears them first
    assert s.host_cache_locs[1].tolist() == list(range(100, 106)) + [-1] * 6
    assert s.device_buffer_tokens[1].tolist() == [0, 1, 2, 3, -1, -1]


def test_every_helper_reads_a_view_of_the_tables_before_writing():
    s = HotBufferState.allocate(2, 4, 2, 12)
    s.admit(1, torch.arange(100, 106))
    s.append(1, 2, s.host_cache_locs[1, :4])  # overlapping source and destination
    assert s.host_cache_locs[1, :6].tolist() == [100, 101, 100, 101, 102, 103]
    s.set_hot(1, s.device_buffer_tokens[1, 1:5])  # the hot region shifted by one, read from itself
    assert s.device_buffer_tokens[1, :4].tolist() == [1, 2, 3, -1]
    s.write_tail(1, s.device_buffer_tokens[1, :2])
    assert s.device_buffer_tokens[1].tolist() == [1, 2, 3, -1, 1, 2]
    s.set_host_rows(1, s.host_cache_locs[1, 2:8])
    assert s.host_cache_locs[1].tolist() == [100, 101, 102, 103, -1, -1] + [-1] * 6
    s.set_hot(1, [0, 1, 2, 3], lru=s.lru_slots[1].flip(0))
    s.set_hot(1, [0, 1, 2, 3], lru=s.lru_slots[1, :])  # the LRU row given as a view of itself
    assert s.lru_slots[1].tolist() == [3, 2, 1, 0]
    s.fill_short(0, 3, s.host_cache_locs[1, :3])
    assert s.host_cache_locs[0, :4].tolist() == [100, 101, 102, -1]


# ---------------------------------------------------------------------------------------------------------------------
# admit into a live slot (issue 28.4)


def test_admit_refuses_a_live_slot_unless_told_to_replace_it():
    s = HotBufferState.allocate(2, 4, 2, 12)
    s.admit(0, torch.arange(5))
    assert s.live(0) and not s.live(1)
    before, epoch = s.host_cache_locs.clone(), s.epoch
    with pytest.raises(ValueError, match=r"^rid 0 holds a live request \(admitted, not finished\).*replace=True"):
        s.admit(0, torch.arange(50, 53))
    assert torch.equal(s.host_cache_locs, before) and s.epoch == epoch  # refused before anything changed
    with pytest.raises(TypeError, match="replace must be a bool, got str 'yes'"):
        s.admit(0, torch.arange(3), replace="yes")
    s.admit(0, torch.arange(50, 53), replace=True)
    assert s.host_cache_locs[0, :4].tolist() == [50, 51, 52, -1] and s.live(0)
    s.finish(0)
    assert not s.live(0)
    s.admit(0, torch.arange(7))  # a finished slot is free
    assert s.clone().live(0) and s.clone().epoch == s.epoch


# ---------------------------------------------------------------------------------------------------------------------
# 2. a plan is tied to the requests it was made for


@pytest.mark.parametrize(
    "change",
    [
        lambda s: (s.finish(3), s.admit(3, torch.arange(30) + 500)),  # the case: a new request in the slot
        lambda s: s.finish(1),
        lambda s: s.fill_short(0, 4, torch.arange(4)),
        lambda s: s.set_hot(3, [9, 8, 7]),
    ],
    ids=["finish-admit", "finish", "fill_short", "set_hot"],
)
def test_replay_refuses_a_plan_whose_requests_changed(device, change):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    assert int(plan.count.sum()) > 0
    layer = torch.zeros_like(dev)
    pool.replay(plan, host_cache=host + 1, device_buffer=layer)  # before any change: accepted
    change(state)
    layer.zero_()
    with pytest.raises(PoolCapacityError, match=r"^pool\.replay: the plan's requests changed since its swap-in"):
        pool.replay(plan, host_cache=host + 1, device_buffer=layer)
    assert not layer.any()  # nothing copied
    plan = pool.swap_in(**kwargs)  # the next step's swap-in ties the plan to the requests now
    pool.replay(plan, host_cache=host + 1, device_buffer=layer)


def test_growth_and_drafts_keep_the_plan_replayable(device):
    """append, write_tail and set_host_rows change no slot's request: a plan made before them still replays."""
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    state.append(3, 40, torch.arange(2) + 900)
    state.write_tail(3, [41, 42])
    state.set_host_rows(0, torch.arange(41))
    layer = torch.zeros_like(dev)
    pool.replay(plan, host_cache=host, device_buffer=layer)
    rows = int(plan.count[0])
    assert torch.equal(layer[plan.dst[0, :rows].long()], host[plan.src[0, :rows]])


# ---------------------------------------------------------------------------------------------------------------------
# state.check: the rules the docs state (issue 28.4)


def _step_state():
    """Two requests: slot 0 long (10 tokens, HOT 8) with its tail written, slot 1 short (3 tokens)."""
    s = HotBufferState.allocate(3, 8, 3, 32, steps=2, top_k=8)
    s.admit(0, torch.arange(10))
    s.write_tail(0, [9, 10])
    s.admit(1, torch.arange(3) + 100)
    return s, torch.tensor([0, 1]), torch.tensor([10, 11, 3, 4])


def test_state_check_passes_a_state_kept_as_the_docs_say():
    s, rids, lens = _step_state()
    s.check()
    s.check(rids, lens, steps=2, top_k=8)
    s.check(rids[:1], lens[:1], steps=1)  # single-step: slot HOT holds the newest token


def test_state_check_names_a_tail_not_written_after_growth():
    s, rids, lens = _step_state()
    s.append(0, 10, [10])  # the request grew by one token; write_tail forgotten
    with pytest.raises(
        StateCheckError,
        match=r"batch row 0 \(request slot 0, length 11\): a long request's tail "
        r"holds \[9, 10, -1\], expected its newest token 10 .*write_tail",
    ):  # noqa
        s.check(rids, torch.tensor([11, 12, 3, 4]), steps=2)


def test_state_check_names_a_short_request_whose_tokens_are_not_in_their_hot_slots():
    s, rids, lens = _step_state()
    with pytest.raises(StateCheckError, match=r"batch row 1 .*a short request holds token -1 at hot slot 3, expected "
                                              r"3: token t < HOT sits at hot slot t"):  # fmt: skip
        s.check(rids, torch.tensor([10, 11, 5, 6]), steps=2)  # grew by two tokens without append
    s.set_hot(1, [2, 1, 0])
    with pytest.raises(StateCheckError, match="holds token 2 at hot slot 0, expected 0"):
        s.check(rids, lens, steps=2)


def test_state_check_names_too_few_scratch_rows_a_broken_lru_row_and_a_token_in_two_slots():
    with pytest.raises(StateCheckError, match=r"the state has 0 scratch rows per request; kvplan.sizing.scratch_rows"
                                              r"\(hot=8, steps=2, top_k=8\) = 8"):  # fmt: skip
        HotBufferState.allocate(2, 8, 3, 32).check(steps=2, top_k=8)  # allocate without steps=/top_k=
    HotBufferState.allocate(2, 8, 3, 32, steps=2, top_k=8).check(steps=2, top_k=8)
    s, rids, lens = _step_state()
    s.lru_slots[2, 0] = 5
    with pytest.raises(StateCheckError, match=r"lru_slots\[2\] must be a permutation of 0..7"):
        s.check()
    s.check(rids, lens, steps=2)  # slot 2 is not in the step
    s.set_hot(0, [4, 5, 4])
    with pytest.raises(StateCheckError, match=r"request slot 0 holds token 4 in hot slots \[0, 2\]"):
        s.check(rids, lens, steps=2)


def test_state_check_skips_padding_rows():
    s, rids, lens = _step_state()
    s.append(0, 10, [10])  # row 0 breaks the tail rule ...
    bad = torch.tensor([11, 12, 3, 4])
    s.check(rids.flip(0), bad.view(2, 2).flip(0).reshape(-1), steps=2, num_real_reqs=torch.tensor([1], dtype=I32))
    s.check(torch.tensor([7, 1]), bad, steps=2)  # ... and as a request outside the pool it is a padding row too


# ---------------------------------------------------------------------------------------------------------------------
# 3, 4. the checked mode


@pytest.mark.parametrize("spec", [False, True])
def test_checked_mode_does_not_depend_on_what_an_earlier_call_left(device, spec):
    """A full step, then the same batch with graph padding: the padding row's miss_count keeps the full step's value
    (the single-step contract), and the check compares it with a reference that starts from the same buffers."""
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device, config=PoolConfig(check=True))
    pool.ensure_capacity(batch=2, num_steps=2 if spec else 1, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, spec)
    plan = pool.swap_in(**kwargs)
    left = int(plan.count[1])
    assert left > 0  # the padding row below holds what this step wrote there
    kwargs["num_real_reqs"] = torch.tensor([1], dtype=I32, device=device)
    plan = pool.swap_in(**kwargs)
    assert int(plan.count[1]) == (0 if spec else left)  # spec writes 0 for padding rows; single-step leaves them


def test_checked_mode_refuses_a_state_that_breaks_the_rules_before_launching(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device, config=PoolConfig(check=True))
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    state.host_cache_locs[:, 30:] = -1  # the newest token and the drafts are not on the host: the tail serves them
    tokens[:, 1, 0] = 31  # the last step's newest token
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    kwargs["seq_lens"] = seq_lens + 1  # the requests grew; write_tail was not called
    tables, dev_before, counters = state.clone(), dev.clone(), pool.counters.clone()
    with pytest.raises(StateCheckError, match=r"a long request's tail holds \[29, 30, -1\], expected .* 30"):
        pool.swap_in(**kwargs)
    assert torch.equal(state.lru_slots, tables.lru_slots) and torch.equal(state.device_buffer_tokens,
                                                                        tables.device_buffer_tokens)  # fmt: skip
    assert torch.equal(dev, dev_before) and torch.equal(pool.counters, counters) and bool((out == -9).all())
    unchecked = PlanBufferPool(device)  # without the checked mode the drafts silently come back as -1
    unchecked.ensure_capacity(batch=2, num_steps=2, top_k=4)
    unchecked.swap_in(**kwargs)
    assert out[:, 1, 0].tolist() == [-1, -1]


def test_tokens_dropped_carries_the_plan_of_the_step_that_ran(device):
    from helpers.pool_steps import _worst_case

    state, tokens, lens = _worst_case(8, 2, 8, scratch=0, seed=1, device=device, hits=0)
    out = torch.empty_like(tokens).to(device)
    host = torch.randn(state.max_len + 2000, 4, device=device)
    dev = torch.zeros(state.device_rows, 4, device=device)
    held = state.device_buffer_tokens.clone()
    pool = PlanBufferPool(device, config=PoolConfig(check=True))
    pool.ensure_capacity(batch=1, num_steps=2, top_k=8)
    with pytest.raises(TokensDroppedError, match=r"dropped 8 token\(s\).*The step ran.*\.plan is its Miss") as info:
        pool.swap_in(state, tokens.to(device), out, torch.tensor([0], device=device), lens.to(device), host, dev)
    error = info.value
    assert error.dropped == 8 and isinstance(error.plan, MissPlan) and int(error.plan.count[0]) == 8
    assert int((out == -1).sum()) == 8 and not torch.equal(state.device_buffer_tokens, held)  # applied
    layer = torch.zeros_like(dev)
    pool.replay(error.plan, host_cache=host, device_buffer=layer)  # the live plan: replayable
    assert torch.equal(layer[error.plan.dst[0, :8].long()], host[error.plan.src[0, :8]])
    import pickle

    again = pickle.loads(pickle.dumps(TokensDroppedError("m", plan=None, dropped=3)))
    assert again.dropped == 3 and str(again) == "m"
