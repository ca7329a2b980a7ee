"""Fused KV materialization on the GPU: production shapes, offsets past 2^31, CUDA-graph capture with weight refresh."""

from __future__ import annotations

import pytest
import torch

from kvplan import FusedKVMaterializer, kernels, reference

pytestmark = pytest.mark.gpu

L, H, D = 5, 8, 128
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def rope_cache(max_pos, rotary_dim, device):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def inputs(T, layers, heads, dim, rotary_dim, dtype, *, max_pos=40_000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(T, layers, 2 * heads * dim, generator=g, device="cuda").to(dtype)
    w = (torch.rand(layers, dim, generator=g, device="cuda") + 0.5).to(dtype)
    eps = torch.full((layers,), 1e-6, device="cuda")
    positions = torch.randint(0, max_pos, (T,), generator=g, device="cuda")
    return kv, w, eps, rope_cache(max_pos, rotary_dim, "cuda"), positions


def check(k, v, kv, w, eps, cs, positions, heads, dim, rotary_dim, token_slice=slice(None)):
    """K against the fp32 reference and V bit-exact, on ``token_slice`` of the tokens."""
    sub = kv[token_slice]
    k_ref, _ = reference.materialize(
        sub.float(), w, eps, cs, positions[token_slice], num_kv_heads=heads, head_dim=dim, rotary_dim=rotary_dim
    )
    tol = TOL[kv.dtype]
    torch.testing.assert_close(k[:, token_slice].float(), k_ref, atol=tol, rtol=tol)
    v_ref = sub[:, :, heads * dim :].unflatten(-1, (heads, dim)).transpose(0, 1)
    assert torch.equal(bits(v[:, token_slice]), bits(v_ref))


def bits(t):
    """The raw bits of ``t``: V must match bit for bit, NaN payloads and signed zeros included."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("T", [1, 7, 8192])
def test_production_shapes_with_int32_positions_on_the_cpu(T):
    kv, w, eps, cs, positions = inputs(T, L, H, D, D, torch.bfloat16, seed=T)
    host_positions = positions.to("cpu", torch.int32)
    k, v = kernels.materialize(kv, w, eps, cs, host_positions, num_kv_heads=H, head_dim=D, rotary_dim=D)
    torch.cuda.synchronize()
    check(k, v, kv, w, eps, cs, positions, H, D, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 64), (256, 256), (96, 96), (80, 48)])
def test_head_dims_dtypes_and_partial_rotary(dtype, head_dim, rotary_dim):
    kv, w, eps, cs, positions = inputs(333, 2, 4, head_dim, rotary_dim, dtype, seed=head_dim)
    k, v = kernels.materialize(kv, w, eps, cs, positions, num_kv_heads=4, head_dim=head_dim, rotary_dim=rotary_dim)
    check(k, v, kv, w, eps, cs, positions, 4, head_dim, rotary_dim)


def test_pool_slab_views_with_offsets_past_2_31():
    capacity, T = 440_000, 4096  # L * capacity * H * D = 2.25e9 elements per slab (4.2 GiB in bf16)
    assert L * capacity * H * D > 2**31
    k_slab = torch.zeros(L, capacity, H, D, dtype=torch.bfloat16, device="cuda")
    v_slab = torch.zeros(L, capacity, H, D, dtype=torch.bfloat16, device="cuda")
    kv, w, eps, cs, positions = inputs(T, L, H, D, D, torch.bfloat16, seed=11)
    k_out, v_out = k_slab[:, capacity - T :], v_slab[:, capacity - T :]  # the last rows of every layer
    k, v = kernels.materialize(
        kv, w, eps, cs, positions, num_kv_heads=H, head_dim=D, rotary_dim=D, k_out=k_out, v_out=v_out
    )
    assert k is k_out and v is v_out
    check(k, v, kv, w, eps, cs, positions, H, D, D)
    assert not bool(k_slab[:, : capacity - T].any()) and not bool(v_slab[:, : capacity - T].any())
    del k_slab, v_slab, k, v, k_out, v_out
    torch.cuda.empty_cache()


def test_input_and_outputs_past_2_31_elements():
    T = 220_000  # kv [T, 5, 2048] = 2.25e9 elements, and so are both allocated outputs
    kv, w, eps, cs, positions = inputs(T, L, H, D, D, torch.bfloat16, seed=12)
    assert kv.numel() > 2**31
    k, v = kernels.materialize(kv, w, eps, cs, positions, num_kv_heads=H, head_dim=D, rotary_dim=D)
    check(k, v, kv, w, eps, cs, positions, H, D, D, token_slice=slice(T - 96, None))
    check(k, v, kv, w, eps, cs, positions, H, D, D, token_slice=slice(0, 32))
    del kv, k, v
    torch.cuda.empty_cache()


def unfused(ctx, weights, norms, eps, cs, positions, rotary_dim):
    """Per-layer projection, K RMSNorm and neox RoPE in plain PyTorch (fp32 math)."""
    r = rotary_dim // 2
    c, s = cs[positions, :r][:, None].float(), cs[positions, r : 2 * r][:, None].float()
    ks, vs = [], []
    for w, norm, e in zip(weights, norms, eps):
        kv = (ctx @ w.T).float()
        k, v = kv[:, : H * D].view(-1, H, D), kv[:, H * D :].view(-1, H, D)
        n = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + e) * norm.float()
        n1, n2 = n[..., :r], n[..., r : 2 * r]
        ks.append(torch.cat((n1 * c - n2 * s, n2 * c + n1 * s, n[..., 2 * r :]), -1))
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def draft_weights(hidden, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights = [torch.randn(2 * H * D, hidden, generator=g, device="cuda").div(hidden**0.5).bfloat16() for _ in range(L)]
    norms = [(torch.rand(D, generator=g, device="cuda") + 0.5).bfloat16() for _ in range(L)]
    eps = [1e-6 * (i + 1) for i in range(L)]
    return weights, norms, eps


def test_cuda_graph_replays_new_inputs_and_refreshed_weights():
    hidden, T, max_pos = 1024, 512, 40_000
    cs = rope_cache(max_pos, D, "cuda")
    weights, norms, eps = draft_weights(hidden, seed=1)
    mat = FusedKVMaterializer(
        weights, norms, eps, cs, num_kv_heads=H, head_dim=D, rotary_dim=D, max_position_hint=max_pos
    )
    mat.reserve(T)
    ctx = torch.randn(T, hidden, device="cuda").bfloat16()
    positions = torch.randint(0, max_pos, (T,), device="cuda")
    cache = torch.zeros(L, 2, T, H, D, dtype=torch.bfloat16, device="cuda")  # the engine's per-layer KV cache

    def write_layer_kv(layer, k, v):
        cache[layer, 0].copy_(k)
        cache[layer, 1].copy_(v)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: Triton compile and cuBLAS handles before capture
            mat.materialize(ctx, positions, write_layer_kv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mat.materialize(ctx, positions, write_layer_kv)

    tol = TOL[torch.bfloat16]
    ctx.copy_(torch.randn(T, hidden, device="cuda"))
    positions.copy_(torch.randint(0, max_pos, (T,), device="cuda"))
    cache.zero_()
    graph.replay()
    k_ref, v_ref = unfused(ctx, weights, norms, eps, cs, positions, D)
    torch.testing.assert_close(cache[:, 0].float(), k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache[:, 1].float(), v_ref, atol=tol, rtol=tol)

    new_weights, new_norms, new_eps = draft_weights(hidden, seed=2)
    pointer = mat.weight.data_ptr()
    mat.refresh_weights(new_weights, new_norms, new_eps)
    assert mat.weight.data_ptr() == pointer
    graph.replay()
    k_ref, v_ref = unfused(ctx, new_weights, new_norms, new_eps, cs, positions, D)
    torch.testing.assert_close(cache[:, 0].float(), k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(cache[:, 1].float(), v_ref, atol=tol, rtol=tol)
