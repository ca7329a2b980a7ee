"""FusedKVMaterializer: one GEMM + one fused kernel equals the per-layer unfused path; weights refresh in place."""

from __future__ import annotations

import pytest
import torch

from kvplan import FusedKVMaterializer, MaterializeGeometry, PlanBufferPool, PoolCapacityError, PoolFrozenError

L, H, D, HIDDEN, ROTARY, MAX_POS = 3, 2, 16, 24, 8, 32


def make_model(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(2 * H * D, HIDDEN, generator=g) / HIDDEN**0.5).to(device, dtype) for _ in range(L)]
    norms = [(torch.rand(D, generator=g) + 0.5).to(device, dtype) for _ in range(L)]
    eps = [1e-6, 1e-5, 1e-4]
    angles = torch.rand(MAX_POS, ROTARY // 2, generator=g) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
    return weights, norms, eps, cos_sin


def unfused(ctx, weights, norms, eps, cos_sin, positions):
    """What a draft model does layer by layer: projection, K RMSNorm, neox RoPE, in plain PyTorch (fp32 math)."""
    r = ROTARY // 2
    cs = cos_sin[positions.long().clamp(0, MAX_POS - 1)].float()
    c, s = cs[:, None, :r], cs[:, None, r:]
    ks, vs = [], []
    for w, norm, e in zip(weights, norms, eps):
        kv = (ctx @ w.T).float()
        k, v = kv[:, : H * D].view(-1, H, D), kv[:, H * D :].view(-1, H, D)
        n = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + e) * norm.float()
        k = torch.cat(
            (n[..., :r] * c - n[..., r:ROTARY] * s, n[..., r:ROTARY] * c + n[..., :r] * s, n[..., ROTARY:]), -1
        )
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)


def make_ctx(T, device, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(T, HIDDEN, generator=g).to(device, dtype)
    positions = torch.randint(0, MAX_POS, (T,), generator=g).to(device)
    return ctx, positions


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 1.5e-2)])
def test_equals_unfused_path_and_hands_each_layer_to_the_engine(device, dtype, tol):
    weights, norms, eps, cos_sin = make_model(device, dtype)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    ctx, positions = make_ctx(5, device, dtype)
    seen = []
    k, v = mat.materialize(ctx, positions, lambda layer, k_l, v_l: seen.append((layer, k_l, v_l)))
    k_ref, v_ref = unfused(ctx, weights, norms, eps, cos_sin, positions)
    torch.testing.assert_close(k.float(), k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(v.float(), v_ref, atol=tol, rtol=tol)
    assert [layer for layer, _, _ in seen] == list(range(L))
    for layer, k_l, v_l in seen:
        assert k_l.shape == v_l.shape == (5, H, D)
        assert k_l.data_ptr() == k[layer].data_ptr() and v_l.data_ptr() == v[layer].data_ptr()


def test_stacked_weight_forms_give_the_same_result(device):
    weights, norms, eps, cos_sin = make_model(device)
    ctx, positions = make_ctx(3, device)
    geometry = dict(num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    results = [
        FusedKVMaterializer(w, n, e, cos_sin, **geometry).materialize(ctx, positions)[0]
        for w, n, e in (
            (weights, norms, eps),
            (torch.stack(weights), torch.stack(norms), torch.tensor(eps)),
            (torch.cat(weights), torch.stack(norms), torch.tensor(eps)),
        )
    ]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_refresh_weights_keeps_storage_and_uses_new_weights(device):
    weights, norms, eps, cos_sin = make_model(device)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    ctx, positions = make_ctx(4, device)
    mat.materialize(ctx, positions)
    pointers = (mat.weight.data_ptr(), mat.k_norm_weight.data_ptr(), mat.eps.data_ptr(), mat.pool.kv_proj(4).data_ptr())
    new_weights, new_norms, _, _ = make_model(device, seed=7)
    new_eps = [1e-3, 2e-3, 3e-3]
    mat.refresh_weights(new_weights, new_norms, new_eps)
    k, v = mat.materialize(ctx, positions)
    assert pointers == (
        mat.weight.data_ptr(),
        mat.k_norm_weight.data_ptr(),
        mat.eps.data_ptr(),
        mat.pool.kv_proj(4).data_ptr(),
    )
    k_ref, v_ref = unfused(ctx, new_weights, new_norms, new_eps, cos_sin, positions)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


def test_refresh_checks_everything_before_copying(device):
    weights, norms, eps, cos_sin = make_model(device)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    before = mat.weight.clone()
    new_weights, _, _, _ = make_model(device, seed=3)
    with pytest.raises(ValueError, match=r"k_norm_weights must hold 3 layers, got 2"):
        mat.refresh_weights(new_weights, norms[:2])
    assert torch.equal(mat.weight, before)


def test_workspace_grows_only_and_steady_state_keeps_pointers(device):
    """Without a pool the materializer builds one holding the projection and the slabs, and sizes it itself."""
    weights, norms, eps, cos_sin = make_model(device)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    assert isinstance(mat.pool, PlanBufferPool)
    assert mat.pool.geometry == MaterializeGeometry(L, H, D, torch.float32, projection=True)
    mat.reserve(6)
    assert mat.capacity_tokens == 6
    ptrs = (mat.pool.kv_proj(6).data_ptr(), *(t.data_ptr() for t in mat.pool.kv_out(6)))
    generation = mat.pool.generation
    for T in (6, 1, 0, 4):
        ctx, positions = make_ctx(T, device)
        k, v = mat.materialize(ctx, positions)
        assert k.shape == (L, T, H, D)
        assert (mat.pool.kv_proj(6).data_ptr(), *(t.data_ptr() for t in mat.pool.kv_out(6))) == ptrs
        if T:  # (an empty view has no address)
            assert (mat.pool.kv_proj(T).data_ptr(), k.data_ptr(), v.data_ptr()) == ptrs
    assert mat.pool.generation == generation
    assert mat.pool.stats().buffer("kv_proj").grow_events == 1  # the reservation only
    ctx, positions = make_ctx(7, device)
    mat.materialize(ctx, positions)
    assert mat.capacity_tokens >= 7
    stats = mat.pool.stats()
    assert stats.buffer("kv_proj").grow_events == 2 and stats.grow_causes.context == 1
    assert stats.generation == generation + 1


class _SlabPool:
    """A duck-typed slab provider (``kv_out(T)`` views of fixed slabs): no longer taken as a pool."""

    def __init__(self, device, capacity, dtype=torch.float32):
        self.k = torch.full((L, capacity, H, D), 9.0, dtype=dtype, device=device)
        self.v = torch.full((L, capacity, H, D), 9.0, dtype=dtype, device=device)

    def kv_out(self, total_ctx):
        return self.k[:, :total_ctx], self.v[:, :total_ctx]


def test_writes_into_the_pool_slabs(device):
    weights, norms, eps, cos_sin = make_model(device)
    with pytest.raises(TypeError, match=r"pool must be a PlanBufferPool built with geometry=MaterializeGeometry\(.*"
                                        r"projection=True\).*got _SlabPool"):  # fmt: skip
        FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY,
                            pool=_SlabPool(device, 8))  # fmt: skip
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(L, H, D, torch.float32, projection=True))
    pool.reserve(batch=0, total_ctx=8)
    for slab in pool.kv_out(8):
        slab.fill_(9.0)
    mat = FusedKVMaterializer(
        weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY, pool=pool, max_position_hint=32
    )
    ctx, positions = make_ctx(3, device)
    k, v = mat.materialize(ctx, positions)
    pool_k, pool_v = pool.kv_out(3)  # contiguous [L, 3, H, D] views at the slabs' start
    assert k.data_ptr() == pool_k.data_ptr() and v.data_ptr() == pool_v.data_ptr()
    k_ref, _ = unfused(ctx, weights, norms, eps, cos_sin, positions)
    torch.testing.assert_close(pool_k, k_ref, atol=1e-4, rtol=1e-4)
    written = k.numel()  # nothing past the step's tokens is touched
    assert all(bool((slab.reshape(-1)[written:] == 9).all()) for slab in pool.kv_out(8))


def test_writes_into_a_plan_buffer_pool_sized_by_the_engine(device):
    weights, norms, eps, cos_sin = make_model(device)
    without = PlanBufferPool(device, geometry=MaterializeGeometry(L, H, D, torch.float32))
    build = r"build it with geometry=MaterializeGeometry\(3, 2, 16, torch.float32, projection=True\)"
    with pytest.raises(ValueError, match=rf"pool holds no fused KV projection.*{build}"):
        FusedKVMaterializer(weights, norms, eps, cos_sin, rotary_dim=ROTARY, pool=without)
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(L, H, D, torch.float32, projection=True))
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY, pool=pool)
    ctx, positions = make_ctx(3, device)
    with pytest.raises(PoolCapacityError, match="ensure_capacity"):
        mat.materialize(ctx, positions)
    pool.ensure_capacity(batch=1, total_ctx=3)
    k, v = mat.materialize(ctx, positions)
    pool_k, pool_v = pool.kv_out(3)
    assert k.data_ptr() == pool_k.data_ptr() and v.data_ptr() == pool_v.data_ptr()
    k_ref, v_ref = unfused(ctx, weights, norms, eps, cos_sin, positions)
    torch.testing.assert_close(pool_k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool_v, v_ref, atol=1e-4, rtol=1e-4)
    other = PlanBufferPool(device, geometry=MaterializeGeometry(L, H, D, torch.bfloat16, projection=True))
    with pytest.raises(ValueError, match=r"pool geometry must match .* expected \(3, 2, 16, torch.float32\)"):
        FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY, pool=other)


def test_positions_checked_without_hint_and_clamped_with_it(device):
    weights, norms, eps, cos_sin = make_model(device)
    geometry = dict(num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    ctx, _ = make_ctx(2, device)
    positions = torch.tensor([1, MAX_POS + 5], device=device)
    checked = FusedKVMaterializer(weights, norms, eps, cos_sin, **geometry)
    with pytest.raises(ValueError, match=rf"positions \[{MAX_POS + 5}\] at token indices \[1\]"):
        checked.materialize(ctx, positions)
    hinted = FusedKVMaterializer(weights, norms, eps, cos_sin, **geometry, max_position_hint=MAX_POS)
    k, _ = hinted.materialize(ctx, positions)
    k_ref, _ = unfused(ctx, weights, norms, eps, cos_sin, positions)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda w, n, cs: dict(kv_proj_weights=[w[0][:63]] + w[1:]),
            r"kv_proj_weights\[0\] must have shape \(64, 24\), got \(63, 24\)",
        ),
        (lambda w, n, cs: dict(k_norm_weights=n[:2]), r"k_norm_weights must hold 3 layers, got 2"),
        (lambda w, n, cs: dict(eps=[1e-6, 1e-6]), r"eps must hold 3 values \(one per layer\), got 2"),
        (lambda w, n, cs: dict(eps=0.0), r"eps must be > 0"),
        (lambda w, n, cs: dict(rotary_dim=7), r"^Invalid fused KV rotary/head dim pair: rotary_dim=7, head_dim=16\. "),
        (
            lambda w, n, cs: dict(rotary_dim=18),
            r"^Invalid fused KV rotary/head dim pair: rotary_dim=18, head_dim=16\. ",
        ),
        (lambda w, n, cs: dict(num_kv_heads=0), r"num_kv_heads must be a positive int, got 0"),
        (
            lambda w, n, cs: dict(max_position_hint=MAX_POS + 1),
            rf"max_position_hint must be an int in \[1, {MAX_POS}\]",
        ),
        (
            lambda w, n, cs: dict(cos_sin_cache=cs[:, :6]),
            r"cos_sin_cache must have shape \[max_pos >= 1, >= 8\], got \(32, 6\)",
        ),
    ],
)
def test_constructor_rejects_bad_arguments_by_name(device, change, message):
    weights, norms, eps, cos_sin = make_model(device)
    kwargs = dict(
        kv_proj_weights=weights,
        k_norm_weights=norms,
        eps=eps,
        cos_sin_cache=cos_sin,
        num_kv_heads=H,
        head_dim=D,
        rotary_dim=ROTARY,
    )
    kwargs.update(change(weights, norms, cos_sin))
    with pytest.raises(ValueError, match=message):
        FusedKVMaterializer(**kwargs)


def test_materialize_rejects_mismatched_hidden_states(device):
    weights, norms, eps, cos_sin = make_model(device)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    _, positions = make_ctx(2, device)
    with pytest.raises(ValueError, match=r"ctx_hidden must have shape \[total_ctx, 24\], got \(2, 23\)"):
        mat.materialize(torch.zeros(2, HIDDEN - 1, device=device), positions)
    with pytest.raises(ValueError, match=r"ctx_hidden must have dtype=torch.float32"):
        mat.materialize(torch.zeros(2, HIDDEN, device=device, dtype=torch.float64), positions)


def test_wrong_types_are_type_errors_naming_the_argument(device):
    from kvplan import PlanBufferPool

    weights, norms, eps, cos_sin = make_model(device)
    geometry = dict(num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    with pytest.raises(TypeError, match="eps must be a float, a sequence of floats or a tensor, got NoneType"):
        FusedKVMaterializer(weights, norms, None, cos_sin, **geometry)
    with pytest.raises(TypeError, match="kv_proj_weights must be a tensor or a sequence of per-layer tensors"):
        FusedKVMaterializer(iter(weights), norms, eps, cos_sin, **geometry)
    with pytest.raises(TypeError, match="num_kv_heads must be a positive int, got float"):
        FusedKVMaterializer(weights, norms, eps, cos_sin, **{**geometry, "num_kv_heads": float(H)})
    with pytest.raises(ValueError, match="pool has no materialize slabs"):
        FusedKVMaterializer(weights, norms, eps, cos_sin, pool=PlanBufferPool(device), **geometry)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, **geometry)
    with pytest.raises(TypeError, match="max_tokens must be an int >= 0, got str"):
        mat.reserve("x")


def test_a_pool_with_the_projection_holds_everything_the_materializer_writes(device):
    """Issue 21: the GEMM workspace and the slabs come from the pool (budget, stats and freeze cover them), and the
    pool's geometry stands in for num_kv_heads, head_dim and rotary_dim (issue 22)."""
    torch.manual_seed(3)
    L, H, D, hidden = 2, 2, 8, 16
    weights = [torch.randn(2 * H * D, hidden, device=device) for _ in range(L)]
    norms = [torch.rand(D, device=device) + 0.5 for _ in range(L)]
    cos_sin = torch.randn(64, D, device=device)
    pool = PlanBufferPool(device, geometry=MaterializeGeometry(L, H, D, torch.float32, projection=True))
    mat = FusedKVMaterializer(weights, norms, 1e-6, cos_sin, pool=pool)
    own = FusedKVMaterializer(weights, norms, 1e-6, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=D)
    hidden_states, positions = torch.randn(5, hidden, device=device), torch.tensor([0, 3, 7, 9, 63], device=device)
    with pytest.raises(PoolCapacityError, match=r"ensure_capacity\(batch=0, num_steps=1, top_k=0, total_ctx=5\) "):
        mat.materialize(hidden_states, positions)
    mat.reserve(8)  # through the pool: its slabs and projection
    stats = pool.stats().as_dict()
    assert stats["kv_proj.capacity.ctx"] == 8 and stats["k_out.capacity.ctx"] == 8
    pool.ensure_capacity(batch=0, total_ctx=5)
    k, v = mat.materialize(hidden_states, positions)
    k_own, v_own = own.materialize(hidden_states, positions)
    assert torch.equal(k, k_own) and torch.equal(v, v_own)
    assert mat.pool is pool  # nothing of its own: the GEMM wrote into the pool's kv_proj
    torch.testing.assert_close(pool.kv_proj(5), hidden_states @ mat.weight.t(), atol=1e-5, rtol=1e-5)
    assert k.data_ptr() == pool.kv_out(5)[0].data_ptr()
    pool.freeze()
    with pytest.raises(PoolFrozenError, match="kv_proj"):
        pool.ensure_capacity(batch=0, total_ctx=9)


def test_its_own_pool_refuses_growth_while_frozen_naming_the_reservation_to_make(device):
    weights, norms, eps, cos_sin = make_model(device)
    mat = FusedKVMaterializer(weights, norms, eps, cos_sin, num_kv_heads=H, head_dim=D, rotary_dim=ROTARY)
    mat.reserve(4)
    mat.pool.freeze()  # as capture does: growth would move a buffer a captured graph points at
    ctx, positions = make_ctx(4, device)
    k, _ = mat.materialize(ctx, positions)  # within the reservation
    generation, pointer = mat.pool.generation, k.data_ptr()
    ctx, positions = make_ctx(9, device)
    refusal = r"^FusedKVMaterializer.materialize\(\) of 9 tokens: .*cannot grow the pool: the pool is frozen"
    with pytest.raises(PoolFrozenError, match=rf"{refusal}.*call reserve\(max_tokens=9\) .*before freeze\(\)"):
        mat.materialize(ctx, positions)
    assert mat.pool.generation == generation and mat.capacity_tokens == 4
    assert mat.materialize(*make_ctx(4, device))[0].data_ptr() == pointer


def test_launches_through_the_pool_in_its_checked_mode(device, monkeypatch):
    """The kernel launch is the pool's: a pool in checked mode compares it with the reference, positions included."""
    from kvplan import PoolConfig, checked

    calls = []
    compare = checked.materialize

    def recording(launch, call):  # (the pool's record of the call: the one its launch runs)
        calls.append(call.check_positions)
        return compare(launch, call)

    monkeypatch.setattr(checked, "materialize", recording)
    weights, norms, eps, cos_sin = make_model(device)
    geometry = MaterializeGeometry(L, H, D, torch.float32, projection=True)
    pool = PlanBufferPool(device, geometry=geometry, config=PoolConfig(check=True))
    pool.reserve(batch=0, total_ctx=4)
    hinted = FusedKVMaterializer(weights, norms, eps, cos_sin, rotary_dim=ROTARY, pool=pool, max_position_hint=MAX_POS)
    unhinted = FusedKVMaterializer(weights, norms, eps, cos_sin, rotary_dim=ROTARY, pool=pool)
    ctx, positions = make_ctx(4, device)
    k, v = hinted.materialize(ctx, positions)
    k_ref, v_ref = unfused(ctx, weights, norms, eps, cos_sin, positions)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    unhinted.materialize(ctx, positions)
    assert calls == [False, True]
