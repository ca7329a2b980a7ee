"""Hostile inputs, fifth pass: the checked mode and ``state.check`` (a non-finite K is no false alarm; two real rows
on one request slot, a device row two slots share, decreasing step lengths are named before anything is written),
and the lesser refusals (devices without usable memory, a NumPy eps, a non-bool ``speculative``, a float8 kv)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pool_steps import _run, _setup

from kvplan import (
    HotBufferState,
    MaterializeGeometry,
    PlanBufferPool,
    PoolConfig,
    StateCheckError,
    kernels,
)

I32 = torch.int32


def _materialize_inputs(device, dtype=torch.float32):
    kv = torch.randn(3, 2, 2 * 2 * 8, device=device).to(dtype)
    w, eps = torch.ones(2, 8, device=device), torch.full((2,), 1e-6, device=device)
    cos_sin = torch.randn(16, 8, device=device)
    return kv, w, eps, cos_sin, torch.tensor([1, 2, 3], device=device)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_checked_materialize_takes_a_non_finite_k_without_a_false_alarm(device, value):
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(2, 2, 8, torch.float32), config=PoolConfig(check=True))
    pool.ensure_capacity(batch=1, total_ctx=3)
    kv, w, eps, cos_sin, positions = _materialize_inputs(device)
    kv[1, 0, 3] = value
    k, _ = pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)
    assert not bool(torch.isfinite(k[0, 1, 0]).all())  # the non-finite head stays non-finite, as the reference's


def _checked_step(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device, config=PoolConfig(check=True))
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    return pool, state, dev, kwargs


def _refused_unchanged(pool, state, dev, kwargs, pattern):
    before = [t.clone() for t in (state.device_buffer_tokens, state.lru_slots, dev, kwargs["top_k_device_locs"])]
    with pytest.raises(StateCheckError, match=pattern):
        pool.swap_in(**kwargs)
    after = (state.device_buffer_tokens, state.lru_slots, dev, kwargs["top_k_device_locs"])
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing launched


def test_checked_mode_refuses_two_real_rows_on_one_request_slot(device):
    pool, state, dev, kwargs = _checked_step(device)
    kwargs["req_pool_indices"] = torch.tensor([3, 3], device=device)
    _refused_unchanged(pool, state, dev, kwargs, r"batch rows 0 and 1 both name request slot 3")
    kwargs["num_real_reqs"] = torch.tensor([1], dtype=I32, device=device)  # the second one padding: runs
    pool.swap_in(**kwargs)


def test_checked_mode_refuses_a_device_row_two_request_slots_share(device):
    pool, state, dev, kwargs = _checked_step(device)
    state.device_buffer_locs[1, 2] = state.device_buffer_locs[3, 5]  # rids are (3, 1)
    _refused_unchanged(pool, state, dev, kwargs, r"device row \d+ belongs to request slots 1 and 3")


def test_checked_mode_refuses_a_scratch_row_that_is_another_slots_hot_row(device):
    pool, state, dev, kwargs = _checked_step(device)
    state.scratch_locs[3, 0] = state.device_buffer_locs[1, 0]
    _refused_unchanged(pool, state, dev, kwargs, r"device row \d+ belongs to request slots 1 and 3")


def test_state_check_names_step_lengths_that_decrease():
    state = HotBufferState.allocate(2, 8, 3, 32)
    state.admit(0, torch.arange(20))
    with pytest.raises(StateCheckError, match=r"the lengths \[20, 3\], which decrease"):
        state.check(torch.tensor([0]), torch.tensor([20, 3]), steps=2)


# ---------------------------------------------------------------------------------------------------------------------
# lesser


@pytest.mark.parametrize("name", ["cpu:1", "meta", torch.device("meta"), "xpu"])
def test_a_pool_on_a_device_without_usable_memory_is_refused(name):
    with pytest.raises(ValueError, match=r"^PlanBufferPool: device=.* holds no memory the kernels can use"):
        PlanBufferPool(name)


def test_pool_materialize_takes_eps_as_a_numpy_array(device):
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(2, 2, 8, torch.float32))
    pool.ensure_capacity(batch=1, total_ctx=3)
    kv, w, eps, cos_sin, positions = _materialize_inputs(device)
    want = [t.clone() for t in pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)]
    got = pool.materialize(kv, w, np.full(2, 1e-6), cos_sin, positions, rotary_dim=8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_speculative_must_be_a_bool(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, False)
    before = out.clone()
    for call in (pool.swap_in, kernels.swap_in):
        with pytest.raises(TypeError, match=r"speculative must be a bool or None, got str 'False'"):
            call(**kwargs, speculative="False")
    assert torch.equal(out, before)


def test_a_float8_kv_is_refused(device):
    kv, w, eps, cos_sin, positions = _materialize_inputs(device)
    with pytest.raises(ValueError, match=r"kv must be float16, bfloat16 or float32, got torch.float8_e4m3fn"):
        kernels.materialize(kv.to(torch.float8_e4m3fn), w, eps, cos_sin, positions, 2, 8, 8)
