"""The checked mode (PoolConfig(check=True) / KVPLAN_CHECK=1): pool launches beside the reference; a corrupted kernel
result is caught, a correct one passes."""

from __future__ import annotations

import pytest
import torch
from helpers.pool_steps import _run, _setup

import kvplan.kernels as kernels
import kvplan.ops as ops
from kvplan import CheckMismatchError, MaterializeGeometry, PlanBufferPool, PoolConfig


def _copying_row(plan) -> int:
    """A plan row with copies (rows with none hold whatever the pool's buffer held)."""
    return int((plan.count > 0).nonzero()[0])


def _pool(device, **geometry):
    return PlanBufferPool(device, config=PoolConfig(check=True), **geometry)


@pytest.mark.parametrize("spec", [True, False])
def test_correct_launches_pass_the_checked_mode(device, spec):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = _pool(device)
    pool.ensure_capacity(batch=2, num_steps=2 if spec else 1, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, spec)
    plan = pool.swap_in(**kwargs)
    assert int(plan.count.sum()) > 0
    pool.replay(plan, host_cache=host + 3, device_buffer=torch.zeros_like(dev))


@pytest.mark.parametrize(
    ("corrupt", "names"),
    [
        (lambda kw, plan: kw["top_k_device_locs"].view(-1)[0].add_(1), "top_k_device_locs"),
        (
            lambda kw, plan: kw["lru_slots"][kw["req_pool_indices"][0]].copy_(
                kw["lru_slots"][kw["req_pool_indices"][0]].roll(1)
            ),
            "lru_slots",
        ),
        (lambda kw, plan: kw["device_buffer"][int(plan.dst[_copying_row(plan), 0])].add_(1), "device_buffer"),
        (lambda kw, plan: plan.src[_copying_row(plan), 0].add_(1), "plan row"),
    ],
    ids=["output", "lru", "device row", "plan"],
)
def test_a_corrupted_kernel_result_is_caught(device, monkeypatch, corrupt, names):
    real = ops.run_swap_in

    def corrupting(call, **kwargs):
        plan = real(call, **kwargs)
        corrupt(call._asdict(), plan)  # (the record's fields by name: the state's tables among them)
        return plan

    monkeypatch.setattr(ops, "run_swap_in", corrupting)  # the one route from the pool to the kernels: one record
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = _pool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    with pytest.raises(CheckMismatchError, match=names):
        pool.swap_in(**kwargs)
    state, host, dev, tokens, rids, seq_lens = _setup(device)  # the same call again, from the same state
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    unchecked = PlanBufferPool(device)  # the same corruption passes unnoticed without the checked mode
    unchecked.ensure_capacity(batch=2, num_steps=2, top_k=4)
    unchecked.swap_in(**kwargs)


def test_a_corrupted_replay_and_materialize_are_caught(device, monkeypatch):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    pool = _pool(device, geometry=MaterializeGeometry(2, 2, 8, torch.float32))
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4, total_ctx=3)
    _, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    real_copy = kernels.copy_planned
    real_run = ops.run_copy

    def corrupting_copy(call, **kw):
        real_run(call, **kw)
        call.device_buffer[call.plan.dst[0, 0]] += 1  # (the record's fields: the plan and rows the pool handed down)

    monkeypatch.setattr(ops, "run_copy", corrupting_copy)  # the one route from the pool to the kernels: one record
    with pytest.raises(CheckMismatchError, match="replay's device_buffer"):
        pool.replay(plan, host_cache=host, device_buffer=torch.zeros_like(dev))
    assert real_copy is kernels.copy_planned
    kv = torch.randn(3, 2, 2 * 2 * 8, device=device)
    w, eps = torch.ones(2, 8, device=device), torch.full((2,), 1e-6, device=device)
    cos_sin = torch.randn(16, 8, device=device)
    positions = torch.tensor([1, 2, 3], device=device)
    pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)  # correct: passes
    real_mat = ops.run_materialize

    def corrupting_materialize(call, **kw):
        k, v = real_mat(call, **kw)
        assert k is call.k_out and v is call.v_out  # the pool's slabs, in its record
        k[0, 0, 0, 0] += 1.0
        return k, v

    monkeypatch.setattr(ops, "run_materialize", corrupting_materialize)
    with pytest.raises(CheckMismatchError, match="k_out differs"):
        pool.materialize(kv, w, eps, cos_sin, positions, rotary_dim=8)


def test_the_environment_turns_it_on(monkeypatch):
    monkeypatch.setenv("KVPLAN_CHECK", "1")
    assert PoolConfig().check is True
    monkeypatch.setenv("KVPLAN_CHECK", "0")
    assert PoolConfig().check is False
    with pytest.raises(TypeError, match="check"):
        PoolConfig(check="yes")


def test_dropped_tokens_raise_in_the_checked_mode_and_show_in_pool_overflow(device):
    """Issue 22.1: overflow is visible without a synchronisation (``pool.overflow``, a device counter) and the checked
    mode raises on it, naming the sizing rule."""
    from helpers.pool_steps import _worst_case

    from kvplan import TokensDroppedError

    state, tokens, lens = _worst_case(8, 2, 8, scratch=0, seed=1, device=device, hits=0)
    args = (state, tokens.to(device), torch.empty_like(tokens).to(device), torch.tensor([0], device=device),
            lens.to(device), torch.randn(state.max_len + 2000, 4, device=device),
            torch.zeros(state.device_rows, 4, device=device))  # fmt: skip
    plain = PlanBufferPool(device)
    plain.ensure_capacity(batch=1, num_steps=2, top_k=8)
    seen = plain.overflow.clone()
    plain.swap_in(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
    assert plain.overflow.device == plain.device and int(plain.overflow - seen) == 8  # 16 misses, 8 evictable slots
    checked = _pool(device)
    checked.ensure_capacity(batch=1, num_steps=2, top_k=8)
    with pytest.raises(TokensDroppedError, match=r"dropped 8 token\(s\).*scratch_rows\(hot=8, steps=2, top_k=8\)"):
        checked.swap_in(*args)
