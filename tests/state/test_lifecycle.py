"""A request's lifecycle in the hot-buffer state (admit, append, finish) and the scratch sizing rule that keeps
speculative swap-ins from dropping tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.pool_steps import _worst_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan import HotBufferState, PlanBufferPool, reference
from kvplan.counters import OVERFLOW, new_counters
from kvplan.sizing import scratch_rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hot=st.integers(1, 24), steps=st.integers(1, 4), top_k=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_scratch_rows_prevents_overflow_and_is_the_least_that_does(hot, steps, top_k, seed):
    if top_k > hot:
        top_k = hot  # HOT >= K is required
    need = scratch_rows(hot, steps, top_k)
    assert need == max(0, steps * top_k - hot)
    for scratch, hits in ((need, None), (need - 1, 0)):  # enough for any hits; one row fewer, the most misses
        if scratch < 0:
            continue
        state, tokens, lens = _worst_case(hot, steps, top_k, scratch, seed, hits=hits)
        counters = new_counters("cpu")
        out = torch.empty_like(tokens)
        dev = torch.zeros(state.device_rows, 4)
        reference.swap_in(state, tokens, out, torch.tensor([0]), lens, torch.randn(state.max_len + 2000, 4), dev,
                          counters=counters)  # fmt: skip
        dropped = int(counters[OVERFLOW])
        if hits == 0:  # one row fewer: the worst case drops a token (the rule is tight)
            assert dropped == 1
        else:
            assert dropped == 0 and bool((out >= 0).all())


@pytest.mark.parametrize(("hot", "steps", "top_k"), [(16, 4, 16), (8, 3, 8), (32, 2, 8)])
def test_a_state_sized_for_the_engine_never_overflows_through_the_pool(hot, steps, top_k, device):
    """``HotBufferState.allocate(..., steps=S, top_k=K)`` chooses the scratch rows: the kernels drop nothing."""
    state, tokens, lens = _worst_case(hot, steps, top_k, 0, seed=hot + steps)
    sized = HotBufferState.allocate(1, hot, steps + 1, state.max_len, device, steps=steps, top_k=top_k)
    assert sized.scratch == scratch_rows(hot, steps, top_k)
    for name in ("device_buffer_tokens", "lru_slots", "host_cache_locs"):
        getattr(sized, name).copy_(getattr(state, name))
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=1, num_steps=steps, top_k=top_k)
    out = torch.empty_like(tokens).to(device)
    host = torch.randn(state.max_len + 2000, 4)
    plan = pool.swap_in(sized, tokens.to(device), out, torch.tensor([0], device=device), lens.to(device),
                        host.to(device), torch.zeros(sized.device_rows, 4, device=device))  # fmt: skip
    assert int(pool.counters[OVERFLOW]) == 0 and bool((out >= 0).all())
    assert int(plan.count[0]) == len(set(tokens[0][tokens[0] >= hot].tolist()))  # every distinct miss copied


def test_admit_append_finish():
    state = HotBufferState.allocate(2, 8, 2, 32)
    state.admit(1, [5, 6, 7])  # a short prompt: token t at hot slot t
    assert state.device_buffer_tokens[1].tolist() == [0, 1, 2] + [-1] * 7
    assert state.host_cache_locs[1, :4].tolist() == [5, 6, 7, -1]
    state.append(1, 3, [8, 9, 10, 11, 12, 13])  # grows past HOT = 8: tokens 8 and 9 stay host-only
    assert state.device_buffer_tokens[1, :8].tolist() == list(range(8))
    assert state.host_cache_locs[1, :10].tolist() == list(range(5, 14)) + [-1]
    state.admit(0, list(range(100, 120)))  # a long prompt: the first HOT tokens in the hot slots
    assert state.device_buffer_tokens[0, :8].tolist() == list(range(8)) and state.host_cache_locs[0, 19] == 119
    state.finish(1)
    assert (state.device_buffer_tokens[1] == -1).all() and (state.host_cache_locs[1] == -1).all()
    assert state.lru_slots[1].tolist() == list(range(8))
    state.admit(1, [1])  # the slot is reused
    assert state.device_buffer_tokens[1, :2].tolist() == [0, -1]
    with pytest.raises(ValueError, match=r"start must be an int in \[0, max_len = 32\]"):
        state.append(0, 33, [1])
    before = [getattr(state, name).clone() for name in ("device_buffer_tokens", "lru_slots", "host_cache_locs")]
    with pytest.raises(ValueError, match="host_rows must be 1-D with at most 32 entries"):
        state.admit(0, list(range(33)))  # refused: request 0 keeps its slot as it was
    after = [getattr(state, name) for name in ("device_buffer_tokens", "lru_slots", "host_cache_locs")]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="steps and top_k size the scratch rows together"):
        HotBufferState.allocate(1, 8, 2, 32, steps=4)
    with pytest.raises(TypeError, match="scratch_rows: top_k must be an int"):
        HotBufferState.allocate(1, 8, 2, 32, steps=4, top_k=2.5)
