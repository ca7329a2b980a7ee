"""Hostile inputs, fourth pass (issue 27 item 5): tensors whose data is not what their bits say. A negative view
(``torch._neg_view``, the ``imag`` of a conjugate) or a conjugate one shares its base's memory with a flag torch
applies on read; a kernel reads the stored words. Every entry point refuses them by name before launching, and the
launch key tells them from their base, so a relaunch never serves them a plain tensor's launches."""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_calls import (
    _call_swap_in,
    _materialize,
    copy_args,
    materialize_args,
    per_call,
    plan_of,
    swap_in_args,
)
from helpers.pool_steps import _run, _setup

from kvplan import HotBufferState, PlanBufferPool, kernels, reference
from kvplan.runtime.launch_replay import LaunchCache, argument_key


def _neg(t: torch.Tensor) -> torch.Tensor:
    return torch._neg_view(t)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("name", ["host_cache", "miss_src", "miss_count", "device_buffer"])
def test_copy_planned_refuses_a_negative_view(impl, name, device):
    args = copy_args(device)
    args["host_cache"] = args["host_cache"].view(torch.uint8)  # uint8 words, as the issue's
    args["device_buffer"] = args["device_buffer"].view(torch.uint8)
    args[name] = _neg(args[name])
    before = args["device_buffer"].clone()
    with pytest.raises(ValueError, match=rf"^{name} must hold its values as stored, got a negative view"):
        impl.copy_planned(plan_of(args), **per_call(args))
    assert torch.equal(args["device_buffer"]._neg_view() if name == "device_buffer" else args["device_buffer"],
                       before if name != "device_buffer" else before._neg_view())  # fmt: skip


def test_copy_planned_refuses_a_conjugate_view(device):
    args = copy_args(device)
    host = torch.randn(args["host_cache"].shape[0], 3, dtype=torch.complex64, device=device)
    args["host_cache"], args["device_buffer"] = (
        host.conj(),
        torch.zeros(args["device_buffer"].shape[0], 3, dtype=torch.complex64, device=device),
    )
    with pytest.raises(ValueError, match="^host_cache must hold its values as stored, got a conjugate view.*"
                                         r"host_cache.resolve_conj\(\)"):  # fmt: skip
        kernels.copy_planned(plan_of(args), **per_call(args))
    assert not args["device_buffer"].any()


def test_pool_replay_and_the_swap_in_copy_refuse_a_negative_host_cache(device):
    state, host, dev, tokens, rids, seq_lens = _setup(device)
    host = host.long()
    dev = torch.zeros(dev.shape, dtype=torch.int64, device=device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    out, kwargs = _run(pool, state, host, dev, tokens, rids, seq_lens, True)
    plan = pool.swap_in(**kwargs)
    layer = torch.zeros_like(dev)
    with pytest.raises(ValueError, match="^host_cache must hold its values as stored, got a negative view"):
        pool.replay(plan, host_cache=_neg(host), device_buffer=layer)
    assert not layer.any()
    tables = state.clone()
    with pytest.raises(ValueError, match="^host_cache must hold its values as stored, got a negative view"):
        pool.swap_in(**(kwargs | {"host_cache": _neg(host)}))
    assert torch.equal(state.lru_slots, tables.lru_slots)


@pytest.mark.parametrize("speculative", [False, True])
def test_swap_in_refuses_a_negative_view_of_any_tensor(speculative, device):
    for name in ("top_k_tokens", "req_pool_indices", "seq_lens", "num_real_reqs", "workspace", "miss_dst"):
        args = swap_in_args(speculative, device)
        args[name] = _neg(args[name])
        with pytest.raises(ValueError, match=rf"^{name} must hold its values as stored"):
            _call_swap_in(kernels, speculative, args)


def test_materialize_refuses_negative_views(device):
    for name in ("kv", "cos_sin_cache", "k_norm_weight", "k_out"):
        args = materialize_args(device)
        args[name] = _neg(args[name])
        with pytest.raises(ValueError, match=rf"^{name} must hold its values as stored, got a negative view"):
            _materialize(kernels, args)
        assert bool((args["v_out"] == -4.0).all())  # nothing written
    assert torch.complex(args["kv"], args["kv"]).conj().imag.is_neg()  # (public torch makes such views too)


def test_a_state_table_cannot_be_a_negative_view():
    s = HotBufferState.allocate(2, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^host_cache_locs must hold its values as stored, got a negative view"):
        HotBufferState(s.device_buffer_tokens, s.device_buffer_locs, s.lru_slots, _neg(s.host_cache_locs))
    s.admit(0, _neg(torch.arange(1, 4)) + 0)  # a value computed from one is plain (torch resolved the bit)
    s.admit(1, _neg(torch.arange(-4, -1)))  # and a view given as values is read through torch: its values are stored
    assert s.host_cache_locs[1, :3].tolist() == [4, 3, 2]


def test_a_negative_or_conjugate_view_keys_apart_from_its_base():
    """A relaunch skips the checks, so the key must tell a view that the checks refuse from its base."""
    x = torch.arange(12).view(3, 4)
    z = torch.randn(3, 4, dtype=torch.complex64)
    assert argument_key(_neg(x)) != argument_key(x) and argument_key(z.conj()) != argument_key(z)
    assert LaunchCache.key((_neg(x),)) != LaunchCache.key((x,))
    assert LaunchCache.key((z.conj(),)) != LaunchCache.key((z,))
    assert LaunchCache.key((x,))[1][0] == argument_key(x)  # the inline key is argument_key
