"""Hostile values for HotBufferState and FusedKVMaterializer: values that do not fit a table's dtype, model weights
that are nn.Parameters, updates that are half wrong, an empty context. Either the right result or a clear error that
changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan import FusedKVMaterializer, HotBufferState

INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]


def _tables(state: HotBufferState) -> list[torch.Tensor]:
    return [t.clone() for t in (state.device_buffer_tokens, state.lru_slots, state.host_cache_locs)]


def _same(state: HotBufferState, before: list[torch.Tensor]) -> bool:
    now = (state.device_buffer_tokens, state.lru_slots, state.host_cache_locs)
    return all(torch.equal(a, b) for a, b in zip(now, before))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.set_hot(0, torch.tensor([2**40, 1])), r"slot_tokens must fit torch.int32 .* got values in \[1, "),
        (lambda s: s.set_hot(0, [1, 2], torch.tensor([40000, 1, 2, 3])), r"lru must fit torch.int16"),
        (lambda s: s.set_hot(0, [1, 2], torch.tensor([0, 1, 2, -40000])), r"lru must fit torch.int16"),
        (lambda s: s.write_tail(1, torch.tensor([-(2**31) - 1])), r"tokens must fit torch.int32"),
        (lambda s: s.set_host_rows(1, torch.tensor([2**63 + 5], dtype=torch.uint64)), r"host_rows must fit .*int64"),
        (lambda s: s.set_hot(0, torch.tensor([2**32 - 1], dtype=torch.uint32)), r"slot_tokens must fit torch.int32"),
        (lambda s: s.fill_short(0, 2.0, [0, 1]), r"seq_len must be in \[0, hot = 4\]"),
    ],
    ids=["token-2^40", "lru-40000", "lru-negative", "tail-int32-min", "host-uint64", "token-uint32", "float-seq_len"],
)
def test_values_that_do_not_fit_are_refused_and_change_nothing(call, message):
    state = HotBufferState.allocate(num_reqs=2, hot=4, tail=2, max_len=8)
    state.set_hot(0, [3, 1, 0], [2, 0, 1, 3])
    before = _tables(state)
    with pytest.raises(ValueError, match=message):
        call(state)
    assert _same(state, before)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(INT_DTYPES),
    values=st.lists(st.integers(-(2**64), 2**64), min_size=1, max_size=4),
    table=st.sampled_from(["slot_tokens", "lru", "host_rows", "tokens"]),
)
def test_integer_tensors_are_stored_exactly_or_refused(dtype, values, table):
    """Any integer tensor: its values land in the table unchanged, or a ValueError naming it changes nothing."""
    info = torch.iinfo(dtype)
    values = [min(max(v, info.min), info.max) for v in values]  # what a tensor of this dtype can hold
    tensor = torch.tensor(values, dtype=dtype)
    state = HotBufferState.allocate(num_reqs=1, hot=4, tail=4, max_len=8)
    before = _tables(state)
    call, stored = {
        "slot_tokens": (lambda: state.set_hot(0, tensor), lambda: state.device_buffer_tokens[0, : len(values)]),
        "lru": (lambda: state.set_hot(0, [], torch.cat([tensor, tensor])[:4]), lambda: state.lru_slots[0, :1]),
        "host_rows": (lambda: state.set_host_rows(0, tensor), lambda: state.host_cache_locs[0, : len(values)]),
        "tokens": (lambda: state.write_tail(0, tensor), lambda: state.device_buffer_tokens[0, 4 : 4 + len(values)]),
    }[table]
    target = {"slot_tokens": torch.int32, "lru": torch.int16, "host_rows": torch.int64, "tokens": torch.int32}[table]
    fits = all(torch.iinfo(target).min <= v <= torch.iinfo(target).max for v in values)
    if table == "lru" and len(values) * 2 < 4:
        fits = False  # too few entries for a full LRU row: a ValueError of its own
    if fits:
        call()
        assert stored().tolist() == values[: stored().numel()]
    else:
        with pytest.raises(ValueError, match=table):
            call()
        assert _same(state, before)


# ---------------------------------------------------------------------------------------------------------------------
# FusedKVMaterializer

L, H, D, HIDDEN = 2, 1, 8, 12


def _model(requires_grad: bool = True, device: torch.device | str = "cpu"):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(HIDDEN, 2 * H * D, bias=False).to(device) for _ in range(L)]
    norms = [torch.nn.Parameter(torch.rand(D, device=device) + 0.5) for _ in range(L)]
    for p in [*(layer.weight for layer in layers), *norms]:
        p.requires_grad_(requires_grad)
    angles = torch.rand(16, D // 2) * 6.3
    return [layer.weight for layer in layers], norms, torch.cat((angles.cos(), angles.sin()), -1).to(device)


def _unfused(ctx, weights, norms, eps, cos_sin, positions):
    with torch.no_grad():
        ks, vs = [], []
        cs = cos_sin[positions]
        c, s = cs[:, None, : D // 2], cs[:, None, D // 2 :]
        for w, n in zip(weights, norms):
            kv = ctx @ w.T
            k, v = kv[:, : H * D].view(-1, H, D), kv[:, H * D :].view(-1, H, D)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * n
            k1, k2 = k[..., : D // 2], k[..., D // 2 :]
            ks.append(torch.cat((k1 * c - k2 * s, k2 * c + k1 * s), -1))
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)


def test_built_from_parameters_outside_no_grad_materializes(device):
    weights, norms, cos_sin = _model(requires_grad=True, device=device)
    mat = FusedKVMaterializer(weights, norms, 1e-6, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=D)
    assert not mat.weight.requires_grad and not mat.k_norm_weight.requires_grad
    ctx = torch.randn(3, HIDDEN, device=device, requires_grad=True)  # straight out of a model run with grad
    positions = torch.tensor([0, 5, 9], device=device)
    k, v = mat.materialize(ctx, positions)
    k_ref, v_ref = _unfused(ctx, weights, norms, 1e-6, cos_sin, positions)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
    mat.refresh_weights([w * 2 for w in weights], norms)  # Parameters again, and results of grad-mode math
    assert not mat.weight.requires_grad


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k_norm_weights=[torch.ones(D, device="meta")] * L), "k_norm_weights must have the dtype and device"),
        (dict(k_norm_weights=[torch.ones(D, dtype=torch.int64)] * L), "k_norm_weights must have the dtype and device"),
        (dict(kv_proj_weights=[torch.ones(2 * H * D, HIDDEN, dtype=torch.int64)] * L), "kv_proj_weights must have"),
        (dict(kv_proj_weights=[torch.ones(2 * H * D, HIDDEN, dtype=torch.float64)] * L), "kv_proj_weights must have"),
        (dict(eps=float("inf")), r"eps must be > 0 and finite"),
        (dict(eps=[1e-6, float("nan")]), r"eps must be > 0 and finite"),
    ],
    ids=["norm-meta", "norm-int", "weights-int", "weights-fp64", "eps-inf", "eps-nan"],
)
def test_refresh_weights_is_all_or_nothing(change, message):
    weights, norms, cos_sin = _model(requires_grad=False)
    mat = FusedKVMaterializer(weights, norms, 1e-6, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=D)
    before = (mat.weight.clone(), mat.k_norm_weight.clone(), mat.eps.clone())
    update = dict(kv_proj_weights=[w + 1 for w in weights], k_norm_weights=[n + 1 for n in norms], eps=1e-3)
    update.update(change)
    with pytest.raises(ValueError, match=message):
        mat.refresh_weights(**update)
    assert all(torch.equal(a, b) for a, b in zip((mat.weight, mat.k_norm_weight, mat.eps), before))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k_norm_weights=[torch.ones(D, dtype=torch.int64)] * L), "k_norm_weights must be floating"),
        (dict(cos_sin_cache=torch.ones(16, D, dtype=torch.int64)), "cos_sin_cache must be floating"),
        (dict(eps=float("inf")), "eps must be > 0 and finite"),
    ],
)
def test_constructor_refuses_what_the_first_call_would(change, message):
    weights, norms, cos_sin = _model(requires_grad=False)
    kwargs = dict(kv_proj_weights=weights, k_norm_weights=norms, eps=1e-6, cos_sin_cache=cos_sin)
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        FusedKVMaterializer(**kwargs, num_kv_heads=H, head_dim=D, rotary_dim=D)


def test_empty_context_writes_nothing_through_the_callback(device):
    weights, norms, cos_sin = _model(requires_grad=False, device=device)
    mat = FusedKVMaterializer(weights, norms, 1e-6, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=D)
    calls = []
    empty, none = torch.zeros(0, HIDDEN, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    k, v = mat.materialize(empty, none, lambda *a: calls.append(a))
    assert calls == [] and k.shape == v.shape == (L, 0, H, D)
    one, zero = torch.zeros(1, HIDDEN, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    mat.materialize(one, zero, lambda *a: calls.append(a))
    assert [layer for layer, _, _ in calls] == list(range(L))
