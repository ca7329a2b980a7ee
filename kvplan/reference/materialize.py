"""Plain-PyTorch fused KV materialization (docs/kernels.md §5): the definition the Triton kernel is compared against.

Per token, layer and head: RMSNorm of K in float32, neox RoPE on the first ``rotary_dim`` dims (the rest pass through
normalized), K cast back to ``kv.dtype``; V copied bit-exactly. Outputs are layer-major ``[Lyr, T, H, D]``.
Arguments are checked as the kernel checks them (``kvplan.validate.arguments.check_materialize_args``), so both refuse
the same calls.
"""

from __future__ import annotations

import torch

from kvplan.validate.arguments import check_materialize_args, check_positions_in_range, eps_per_layer

__all__ = ["clamp_positions", "materialize"]


def clamp_positions(positions: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Positions as int64 on their device, clamped to ``[0, max_pos)`` exactly as the kernel clamps them."""
    return positions.to(torch.int64).clamp(0, max_pos - 1)


def materialize(
    kv: torch.Tensor, k_norm_weight: torch.Tensor, eps: torch.Tensor, cos_sin_cache: torch.Tensor,
    positions: torch.Tensor, num_kv_heads: int, head_dim: int, rotary_dim: int, k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None, *, check_positions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Normalize and rotate K, copy V, from ``kv [T, Lyr, 2*H*D]`` into layer-major ``[Lyr, T, H, D]`` outputs: the
    arguments of :func:`kvplan.kernels.materialize`, with ``eps`` also as ``pool.materialize`` takes it: one float
    for every layer, or one per layer."""
    if not isinstance(eps, torch.Tensor) and isinstance(kv, torch.Tensor) and kv.dim() == 3:
        eps = eps_per_layer(eps, kv.shape[1]).to(kv.device)  # (checked as the pool checks it)
    check_materialize_args(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
    )
    num_kv_heads, head_dim, rotary_dim = int(num_kv_heads), int(head_dim), int(rotary_dim)  # (NumPy's: ints)
    T, num_layers = kv.shape[0], kv.shape[1]
    H, D = num_kv_heads, head_dim
    shape = (num_layers, T, H, D)  # (the oracle allocates its own outputs: it shares no code with the kernel's)
    if k_out is None:
        k_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    if v_out is None:
        v_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    if T == 0:
        return k_out, v_out
    max_pos = cos_sin_cache.shape[0]
    positions = positions.to(kv.device)
    if check_positions:
        check_positions_in_range(positions, max_pos)

    r = rotary_dim // 2
    k = kv[:, :, : H * D].unflatten(-1, (H, D)).transpose(0, 1).float()  # [Lyr, T, H, D]
    v = kv[:, :, H * D :].unflatten(-1, (H, D)).transpose(0, 1)
    eps32 = eps.to(device=kv.device, dtype=torch.float32).view(num_layers, 1, 1, 1)
    w = k_norm_weight.to(device=kv.device, dtype=torch.float32).view(num_layers, 1, 1, D)
    n = k * torch.rsqrt(k.square().sum(-1, keepdim=True) / D + eps32) * w

    cs = cos_sin_cache.to(device=kv.device)[clamp_positions(positions, max_pos)].float()  # [T, >= rotary_dim]
    c = cs[:, :r].view(1, T, 1, r)
    s = cs[:, r : 2 * r].view(1, T, 1, r)
    n1, n2 = n[..., :r], n[..., r : 2 * r]
    rotated = torch.cat((n1 * c - n2 * s, n2 * c + n1 * s, n[..., 2 * r :]), dim=-1)

    k_out.copy_(rotated.to(kv.dtype))
    v_out.copy_(v)
    return k_out, v_out
