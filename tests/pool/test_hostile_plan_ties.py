"""Hostile inputs, fifth pass: a pool plan stays tied to its requests through every path. A refused swap-in or a
``miss_plan`` view does not make a stale plan replayable again; a compiled swap-in (which skips the pool's host
bookkeeping) makes eager replays refused; a second ``HotBufferState`` over the same tables changes requests in view
of the pool."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers.pool_steps import _run, _setup

from kvplan import HotBufferState, PlanBufferPool, PoolCapacityError, PoolConfig, StateCheckError

STALE = r"^pool\.replay: the plan's requests changed since its swap-in"


def _swapped(device, config=None):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device, config=config)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    assert int(plan.count.sum()) > 0
    return pool, state, host, dev, plan, kwargs


def _refused_stale(pool, plan, host, dev, pattern=STALE):
    layer = torch.zeros_like(dev)
    with pytest.raises(PoolCapacityError, match=pattern):
        pool.replay(plan, host_cache=host, device_buffer=layer)
    assert not layer.any()


def _new_request(state):
    state.finish(3)
    state.admit(3, torch.arange(40) + 500)


def test_a_refused_swap_in_leaves_a_stale_plan_refused(device):
    pool, state, host, dev, plan, kwargs = _swapped(device)
    _new_request(state)
    _refused_stale(pool, plan, host, dev)
    with pytest.raises(ValueError):  # the argument checks refuse it: nothing launched
        pool.swap_in(**dict(kwargs, seq_lens=kwargs["seq_lens"][:1]))
    _refused_stale(pool, plan, host, dev)


def test_a_swap_in_the_checked_mode_refuses_leaves_a_stale_plan_refused(device):
    pool, state, host, dev, plan, kwargs = _swapped(device, PoolConfig(check=True))
    _new_request(state)
    state.lru_slots[3, 0] = state.lru_slots[3, 1]  # breaks a rule: the checked mode refuses before launching
    with pytest.raises(StateCheckError):
        pool.swap_in(**dict(kwargs, req_pool_indices=torch.tensor([3, 1], device=device)))
    _refused_stale(pool, plan, host, dev)


def test_a_miss_plan_view_leaves_a_stale_plan_refused(device):
    pool, state, host, dev, plan, _ = _swapped(device)
    _new_request(state)
    view = pool.miss_plan(2, 2, 4)
    _refused_stale(pool, plan, host, dev)
    _refused_stale(pool, view, host, dev)


def test_a_second_wrapper_over_the_same_tables_changes_requests_in_view_of_the_pool(device):
    pool, state, host, dev, plan, _ = _swapped(device)
    other = HotBufferState(**{f.name: getattr(state, f.name) for f in attrs.fields(HotBufferState)})
    _new_request(other)
    _refused_stale(pool, plan, host, dev)
    assert other.lifecycle is state.lifecycle  # one record per tables
    # a copy of the tables is other tables: its requests are its own
    copy = state.clone()
    assert copy.lifecycle is not state.lifecycle and copy.epoch == state.epoch
    copy.finish(0)
    assert copy.epoch == state.epoch + 1


def test_an_eager_replay_after_a_compiled_swap_in_is_refused(device):
    """The compiled swap-in (another shape) overwrote the plan storage without the pool's bookkeeping: the eager
    plan's views would cover the compiled step's rows."""
    torch._dynamo.reset()
    pool, state, host, dev, plan, kwargs = _swapped(device)
    pool.ensure_capacity(batch=1, num_steps=2, top_k=4)
    batched = ("top_k_tokens", "top_k_device_locs", "req_pool_indices")
    one = {k: (v[:1] if k in batched else v) for k, v in kwargs.items()}
    one["seq_lens"] = kwargs["seq_lens"][:2]
    compiled = torch.compile(lambda kw: pool.swap_in(**kw), fullgraph=True, backend="eager")
    compiled(one)
    _refused_stale(pool, plan, host, dev, r"^pool\.replay: this pool's swap-ins also run compiled")
