"""Fused KV materialization (docs/kernels.md §5): the Triton kernel against the fp32 reference, the reference against
the contract.

Runs under the Triton interpreter on CPU: tiny shapes, few programs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan import NotAnIntError, check_materialize, kernels, ops, reference
from kvplan.kernels.fused_kv import MaterializeLaunch, run_materialize

IMPLS = {"kernel": kernels.materialize, "reference": reference.materialize}


def dims(H, D, rotary_dim):
    """The sizes of ``materialize``, by keyword."""
    return dict(num_kv_heads=H, head_dim=D, rotary_dim=rotary_dim)


TOL = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def make_inputs(T, L, H, D, rotary_dim, dtype, device, *, max_pos=32, seed=0, pos_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(T, L, 2 * H * D, generator=g).to(dtype)
    w = torch.rand(L, D, generator=g) + 0.5
    eps = torch.rand(L, generator=g) * 1e-3 + 1e-6
    angles = torch.rand(max_pos, rotary_dim // 2, generator=g) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype)
    return [x.to(device) for x in (kv, w, eps, cos_sin, positions)]


def fp32_reference(kv, w, eps, cos_sin, positions, H, D, rotary_dim):
    """The spec's math on the same inputs, outputs left in float32 (no final rounding)."""
    return reference.materialize(kv.float(), w, eps, cos_sin, positions, **dims(H, D, rotary_dim))


def naive(kv, w, eps, cos_sin, positions, H, D, rotary_dim):
    """docs/kernels.md §5 written out per (t, l, h) in float64, independently of the reference's vectorized form."""
    T, L = kv.shape[:2]
    r = rotary_dim // 2
    k = torch.empty(L, T, H, D, dtype=torch.float64)
    for t in range(T):
        p = min(max(int(positions[t]), 0), cos_sin.shape[0] - 1)
        c, s = cos_sin[p, :r].double(), cos_sin[p, r : 2 * r].double()
        for layer in range(L):
            for h in range(H):
                x = kv[t, layer, h * D : (h + 1) * D].double()
                n = x / torch.sqrt((x * x).sum() / D + float(eps[layer])) * w[layer].double()
                out = n.clone()
                out[:r] = n[:r] * c - n[r : 2 * r] * s
                out[r : 2 * r] = n[r : 2 * r] * c + n[:r] * s
                k[layer, t, h] = out
    v = kv[:, :, H * D :].unflatten(-1, (H, D)).transpose(0, 1)
    return k, v


def assert_k_close(k, k_ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(k.float().cpu(), k_ref.float().cpu(), atol=tol, rtol=tol)


def assert_bits_equal(a, b):
    """Bit-exact comparison (NaN payloads and signed zeros included)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(ints).cpu(), b.contiguous().view(ints).cpu())


def v_of(kv, H, D):
    return kv[:, :, H * D :].unflatten(-1, (H, D)).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full_rotary", "partial_rotary"])
def test_kernel_matches_fp32_reference(device, dtype, rotary_dim):
    T, L, H, D = 5, 2, 2, 32
    args = make_inputs(T, L, H, D, rotary_dim, dtype, device, seed=rotary_dim)
    kv = args[0]
    kv[0, 1, H * D] = float("nan")  # V is copied bit-exactly, whatever it holds
    kv[1, 0, H * D + 1] = -0.0
    k, v = kernels.materialize(*args, **dims(H, D, rotary_dim))
    k_ref, _ = fp32_reference(*args, H, D, rotary_dim)
    assert k.shape == v.shape == (L, T, H, D) and k.dtype == v.dtype == dtype
    assert_k_close(k, k_ref, dtype)
    assert_bits_equal(v, v_of(kv, H, D))


def test_reference_matches_naive_float64_definition(device):
    T, L, H, D, rotary_dim = 3, 2, 2, 16, 8
    args = make_inputs(T, L, H, D, rotary_dim, torch.float32, device, max_pos=8, seed=3)
    args[4] = torch.tensor([0, 7, 3], device=device)
    k_naive, v_naive = naive(*[a.cpu() for a in args], H, D, rotary_dim)
    for impl in IMPLS.values():
        k, v = impl(*args, **dims(H, D, rotary_dim))
        torch.testing.assert_close(k.double().cpu(), k_naive, atol=1e-5, rtol=1e-5)
        assert_bits_equal(v.cpu(), v_naive)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_zero_tokens_returns_empty_outputs_before_other_checks(device, impl):
    L, H, D = 3, 2, 16
    kv = torch.empty(0, L, 7, device=device)  # wrong trailing dim: not checked when T == 0
    bad = torch.empty(0, device=device)
    k, v = impl(kv, bad, bad, bad, bad, **dims(H, D, 3))
    assert k.shape == v.shape == (L, 0, H, D) and k.dtype == kv.dtype
    k_given, v_given = torch.empty(L, 0, H, D, device=device), torch.empty(L, 0, H, D, device=device)
    k2, v2 = impl(kv, bad, bad, bad, bad, **dims(H, D, 3), k_out=k_given, v_out=v_given)
    assert k2 is k_given and v2 is v_given
    # given outputs of any shape, dtype or layout (even one tensor twice): nothing is checked, read or written
    odd = torch.full((5, 3), 7.0, device=device)
    k3, v3 = impl(kv, bad, bad, bad, bad, **dims(H, D, 3), k_out=odd, v_out=odd)
    assert k3 is odd and v3 is odd and bool((odd == 7).all())
    assert check_materialize(kv, bad, bad, bad, bad, H, D, 3, odd, odd) is None


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_sizes_and_outputs_may_be_passed_by_position_in_the_contracts_order(device, impl):
    T, L, H, D = 3, 2, 2, 16
    args = make_inputs(T, L, H, D, 8, torch.float32, device)
    k_kw, v_kw = impl(*args, **dims(H, D, 8))
    k_out, v_out = torch.empty(L, T, H, D, device=device), torch.empty(L, T, H, D, device=device)
    k, v = impl(*args, H, D, 8, k_out, v_out)  # docs/kernels.md §5's signature, positionally
    assert k is k_out and v is v_out
    assert torch.equal(k, k_kw) and torch.equal(v, v_kw)


@pytest.mark.parametrize("impl", [*IMPLS.values(), ops.materialize], ids=[*IMPLS.keys(), "ops"])
def test_numpy_integer_sizes_are_ints_and_a_float_is_not(device, impl):
    T, L, H, D = 2, 1, 2, 16
    args = make_inputs(T, L, H, D, 16, torch.float32, device)
    k, v = impl(*args, **dims(np.int64(H), np.int32(D), np.int16(16)))
    k_int, v_int = impl(*args, **dims(H, D, 16))
    assert torch.equal(k, k_int) and torch.equal(v, v_int)
    for name in ("num_kv_heads", "head_dim", "rotary_dim"):
        sizes = dims(H, D, 16) | {name: 16.0}
        with pytest.raises(NotAnIntError, match=f"^{name} must be an int, got float 16.0"):
            impl(*args, **sizes)


def test_single_token_and_multiple_token_blocks(device):
    L, H, D, rotary_dim = 2, 1, 16, 16
    for T, block_t in ((1, None), (5, 2)):  # T = 5 in blocks of 2: three programs per layer, a masked tail
        args = make_inputs(T, L, H, D, rotary_dim, torch.bfloat16, device, seed=T)
        k, v = run_materialize(*args, H, D, rotary_dim, None, None, False, launch=MaterializeLaunch(block_t=block_t))
        assert_k_close(k, fp32_reference(*args, H, D, rotary_dim)[0], torch.bfloat16)
        assert_bits_equal(v, v_of(args[0], H, D))


@pytest.mark.parametrize(
    ("T", "H", "block_t", "block_h"), [(1, 3, None, None), (8, 5, None, None), (3, 3, 2, 2), (9, 6, 4, 4)]
)
def test_head_tiles_cover_every_head(T, H, block_t, block_h, device):
    """Programs of a few heads each (one at decode sizes, the default up to SMALL_T tokens): head counts that are not
    a multiple of the tile leave a masked tail of heads."""
    L, D, rotary_dim = 2, 16, 12
    args = make_inputs(T, L, H, D, rotary_dim, torch.float32, device, seed=T + H)
    launch = MaterializeLaunch(block_t=block_t, block_h=block_h)
    k, v = run_materialize(*args, H, D, rotary_dim, None, None, False, launch=launch)
    assert_k_close(k, fp32_reference(*args, H, D, rotary_dim)[0], torch.float32)
    assert_bits_equal(v, v_of(args[0], H, D))


def test_strided_outputs_like_pool_views_are_written_in_place(device):
    T, L, H, D, rotary_dim, cap = 3, 2, 2, 16, 16, 6
    args = make_inputs(T, L, H, D, rotary_dim, torch.float16, device, seed=5)
    k_slab = torch.full((L, cap, H, D), 7.0, dtype=torch.float16, device=device)
    v_slab = torch.full((cap, L, H, D), 7.0, dtype=torch.float16, device=device).transpose(0, 1)  # layer stride < T's
    k_out, v_out = k_slab[:, 2 : 2 + T], v_slab[:, 1 : 1 + T]
    k, v = kernels.materialize(*args, **dims(H, D, rotary_dim), k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out
    assert_k_close(k_slab[:, 2 : 2 + T], fp32_reference(*args, H, D, rotary_dim)[0], torch.float16)
    assert_bits_equal(v_slab[:, 1 : 1 + T], v_of(args[0], H, D))
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[2 : 2 + T] = False
    assert bool((k_slab[:, untouched] == 7).all())
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[1 : 1 + T] = False
    assert bool((v_slab[:, untouched] == 7).all())


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_given_outputs_are_returned_as_the_same_objects(device, impl):
    T, L, H, D = 2, 1, 1, 16
    args = make_inputs(T, L, H, D, 16, torch.float32, device)
    k_out = torch.full((L, T, H, D), float("nan"), device=device)
    v_out = torch.full((L, T, H, D), float("nan"), device=device)
    k, v = impl(*args, **dims(H, D, 16), k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out
    assert not bool(k.isnan().any()) and not bool(v.isnan().any())  # every element written


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int16])
def test_narrow_integer_positions_match_int64(device, pos_dtype):
    T, L, H, D = 3, 1, 1, 16
    args = make_inputs(T, L, H, D, 16, torch.float32, device, seed=9)
    expected, _ = kernels.materialize(*args, **dims(H, D, 16))
    args[4] = args[4].to(pos_dtype)
    got, _ = kernels.materialize(*args, **dims(H, D, 16))
    assert_bits_equal(got, expected)


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"),
    [(64, 64), (128, 128), (256, 256), (96, 96), (96, 64), (80, 48)],
)
def test_head_dims_including_non_powers_of_two(device, head_dim, rotary_dim):
    args = make_inputs(1, 1, 1, head_dim, rotary_dim, torch.bfloat16, device, seed=head_dim + rotary_dim)
    k, v = kernels.materialize(*args, **dims(1, head_dim, rotary_dim))
    assert_k_close(k, fp32_reference(*args, 1, head_dim, rotary_dim)[0], torch.bfloat16)
    assert_bits_equal(v, v_of(args[0], 1, head_dim))


def test_out_of_range_positions_are_clamped_never_read_out_of_bounds(device):
    T, L, H, D, rotary_dim, max_pos = 4, 1, 1, 16, 16, 5
    kv, w, eps, cos_sin, _ = make_inputs(T, L, H, D, rotary_dim, torch.float32, device, max_pos=max_pos)
    # the cache is a window of a bigger tensor whose rows around it are NaN: reading outside it would show
    fenced = torch.full((max_pos + 4, rotary_dim), float("nan"), device=device)
    fenced[2 : 2 + max_pos] = cos_sin
    window = fenced[2 : 2 + max_pos]
    positions = torch.tensor([-3, 0, max_pos, 1 << 40], device=device)
    clamped = torch.tensor([0, 0, max_pos - 1, max_pos - 1], device=device)
    for impl in IMPLS.values():
        k, _ = impl(kv, w, eps, window, positions, **dims(H, D, rotary_dim))
        assert not bool(k.isnan().any())
        k_clamped, _ = impl(kv, w, eps, window, clamped, **dims(H, D, rotary_dim))
        assert_bits_equal(k, k_clamped)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_opt_in_position_check_names_bad_positions_and_writes_nothing(device, impl):
    T, L, H, D, max_pos = 4, 1, 1, 16, 5
    kv, w, eps, cos_sin, _ = make_inputs(T, L, H, D, 16, torch.float32, device, max_pos=max_pos)
    positions = torch.tensor([0, 9, 4, -1], dtype=torch.int32, device=device)
    k_out = torch.zeros(L, T, H, D, device=device)
    v_out = torch.zeros(L, T, H, D, device=device)
    with pytest.raises(ValueError, match=r"positions \[9, -1\] at token indices \[1, 3\]"):
        impl(kv, w, eps, cos_sin, positions, **dims(H, D, 16), k_out=k_out, v_out=v_out, check_positions=True)
    assert not bool(k_out.any()) and not bool(v_out.any())
    impl(
        kv, w, eps, cos_sin, positions.clamp(0, max_pos - 1), **dims(H, D, 16), check_positions=True
    )  # in range: passes


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_validator_texts_reach_the_caller(device, impl):
    T, L, H, D = 2, 2, 1, 16
    kv, w, eps, cos_sin, positions = make_inputs(T, L, H, D, 16, torch.float32, device)
    with pytest.raises(ValueError, match=r"^Invalid fused KV projection shape: got \(2, 2, 32\), expected trailing"):
        impl(kv, w, eps, cos_sin, positions, **dims(H, 8, 8))
    with pytest.raises(ValueError, match=r"^Invalid fused KV rotary/head dim pair: rotary_dim=15, head_dim=16\."):
        impl(kv, w, eps, cos_sin, positions, **dims(H, D, 15))
    with pytest.raises(ValueError, match=r"^Invalid stacked eps shape .*: got \(1,\), expected \(2,\)\."):
        impl(kv, w, eps[:1], cos_sin, positions, **dims(H, D, 16))
    bad_k = torch.empty(L, T + 1, H, D, device=device)
    with pytest.raises(ValueError, match=r"^Invalid k_out shape .*: got \(2, 3, 1, 16\), expected \(2, 2, 1, 16\)\."):
        impl(kv, w, eps, cos_sin, positions, **dims(H, D, 16), k_out=bad_k)
    with pytest.raises(TypeError, match="kv"):
        impl(kv.tolist(), w, eps, cos_sin, positions, **dims(H, D, 16))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    T=st.integers(0, 9),
    L=st.integers(1, 3),
    H=st.integers(1, 2),
    half_rotary=st.integers(1, 8),
    extra=st.sampled_from([0, 2, 8]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_property_kernel_equals_reference(T, L, H, half_rotary, extra, dtype, seed):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rotary_dim = 2 * half_rotary
    D = rotary_dim + extra
    args = make_inputs(T, L, H, D, rotary_dim, dtype, device, seed=seed)
    k, v = kernels.materialize(*args, **dims(H, D, rotary_dim))
    assert k.shape == v.shape == (L, T, H, D)
    assert_k_close(k, fp32_reference(*args, H, D, rotary_dim)[0], dtype)
    assert_bits_equal(v, v_of(args[0], H, D))
