"""Fused KV materialization in one memory-bound pass (docs/kernels.md §5).

One program takes ``BLOCK_T`` tokens x ``BLOCK_H`` heads of one layer (all heads from a few tokens up; one head at
decode sizes, where the work per program, not the bytes, sets the time): it loads K as its two rotary halves (plus the
pass-through tail) and V, all before any store so every load is in flight at once, normalizes and rotates K in float32
registers (the rotate-half needs no second load: each half is a tile of its own) and writes K and V to the layer-major
outputs. Per-program base offsets are 64-bit (a pool slab can pass 2^31 elements), per-tile offsets stay small.
Positions are clamped in the kernel so the cos/sin cache is never read out of bounds. Every tensor is read or written
through its strides (an ``eps`` expanded to every layer included); outputs that overlap themselves, each other or an
input are refused before the launch (``kvplan.validate.arguments.check_materialize_args``).
Names: the kernel glossary, ``kvplan/kernels/glossary.py``.
"""

from __future__ import annotations

import functools
import os

import attrs
import torch
import triton
import triton.language as tl

from kvplan.calls import MaterializeCall
from kvplan.config import plain_int
from kvplan.runtime.device import device_guard
from kvplan.runtime.launch_replay import UNRECORDED, LaunchCache, Recorder
from kvplan.validate.arguments import check_interpreter_set_first, check_materialize_args, check_positions_in_range
from kvplan.workspace import next_pow2

__all__ = ["MaterializeLaunch", "materialize", "run_materialize_call"]

# Elements of one V tile a program aims for: 4096 bf16 = 8 KiB of V plus 8 KiB of K in flight per program.
_TILE_ELEMENTS = 4096


# T is not specialised: the general kernel was the faster at T = 1 too (docs/benchmarks.md, "Materialize launch")
@triton.jit(do_not_specialize=["T"])
def _materialize_kernel(
    # pointers
    kv_ptr,  # [T, Lyr, 2*H*D] kv, strides (kv_st, kv_sl, kv_sd): per token and layer H K heads then H V heads
    w_ptr,  # [Lyr, D] k_norm_weight, strides (w_sl, w_sd)
    eps_ptr,  # [Lyr] float32 eps, stride eps_s
    cs_ptr,  # [max_pos, >= 2R] cos_sin_cache, strides (cs_sp, cs_sd): R cosines then R sines per position
    pos_ptr,  # [T] positions (any int dtype), stride pos_s; clamped to [0, max_pos)
    k_ptr,  # [Lyr, T, H, D] k_out, strides (k_sl, k_st, k_sh, k_sd)
    v_ptr,  # [Lyr, T, H, D] v_out, strides (v_sl, v_st, v_sh, v_sd)
    # strides (of the tensors above)
    eps_s,
    kv_st,
    kv_sl,
    kv_sd,
    w_sl,
    w_sd,
    cs_sp,
    cs_sd,
    pos_s,
    k_sl,
    k_st,
    k_sh,
    k_sd,
    v_sl,
    v_st,
    v_sh,
    v_sd,
    # sizes
    T,
    max_pos,
    # compile-time: the shapes, the tiles
    LAYERS: tl.constexpr,  # Lyr (a constant: the program's layer and tile without a runtime division)
    H: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,  # rotary_dim // 2
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program (a power of two)
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,  # pow2 >= D - 2R, or 0 when the rotary part covers the head
    BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T) * cdiv(H, BLOCK_H) * Lyr,)``, layers fastest, then head tiles, then token tiles:
    program ``pid`` takes layer ``pid % Lyr`` of ``BLOCK_T`` tokens x ``BLOCK_H`` heads. It loads K (its two rotary
    halves and pass-through tail) and V first, then the positions' cos/sin rows and the layer's weight and eps;
    RMS-normalizes each K head over ``D`` in float32 (times the weight), rotates its first ``2R`` dims (rotate-half)
    and stores K and V. Tokens past ``T`` and heads past ``H`` are masked.

    Read: ``kv`` (K and V of its tokens and heads in the layer), ``positions`` (clamped to ``[0, max_pos)``), those
    positions' ``cos_sin_cache`` rows, the layer's ``k_norm_weight`` row and ``eps``.
    Written: ``k_out`` and ``v_out`` at ``[layer, tokens, heads, :]``; nothing else."""
    pid = tl.program_id(0)
    layer = (pid % LAYERS).to(tl.int64)
    rest = pid // LAYERS
    HEAD_TILES: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    h0 = rest % HEAD_TILES * BLOCK_H
    t0 = (rest // HEAD_TILES).to(tl.int64) * BLOCK_T

    kv_base = kv_ptr + t0 * kv_st + layer * kv_sl
    k_base = k_ptr + layer * k_sl + t0 * k_st
    v_base = v_ptr + layer * v_sl + t0 * v_st

    ot = tl.arange(0, BLOCK_T)[:, None, None]
    oh = h0 + tl.arange(0, BLOCK_H)[None, :, None]
    orr = tl.arange(0, BLOCK_R)[None, None, :]
    od = tl.arange(0, BLOCK_D)[None, None, :]
    ot64 = ot.to(tl.int64)

    row_mask = (t0 + ot) < T
    if HEAD_TILES * BLOCK_H != H:
        row_mask = row_mask & (oh < H)
    r_mask = row_mask
    if BLOCK_R != R:
        r_mask = r_mask & (orr < R)
    d_mask = row_mask
    if BLOCK_D != D:
        d_mask = d_mask & (od < D)

    # every global load first, so they are all in flight together
    k_row = kv_base + ot64 * kv_st + (oh * D) * kv_sd
    x1 = tl.load(k_row + orr * kv_sd, mask=r_mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + (orr + R) * kv_sd, mask=r_mask, other=0.0).to(tl.float32)
    v = tl.load(kv_base + ot64 * kv_st + (H * D + oh * D + od) * kv_sd, mask=d_mask, other=0.0)
    if BLOCK_P > 0:
        op = tl.arange(0, BLOCK_P)[None, None, :] + 2 * R
        p_mask = row_mask & (op < D)
        x3 = tl.load(k_row + op * kv_sd, mask=p_mask, other=0.0).to(tl.float32)

    pos = tl.load(pos_ptr + (t0 + ot64) * pos_s, mask=(t0 + ot) < T, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # clamp: the cache is never read out of bounds
    # cos/sin tiles take K's full [BLOCK_T, BLOCK_H, BLOCK_R] shape (heads re-read them from L1): same layout as K,
    # so the rotation needs no layout conversion through shared memory
    cs_tile = cs_ptr + pos * cs_sp + oh * 0 + orr * cs_sd
    cs_mask = orr < R
    c = tl.load(cs_tile, mask=cs_mask, other=0.0).to(tl.float32)
    s = tl.load(cs_tile + R * cs_sd, mask=cs_mask, other=0.0).to(tl.float32)
    w_row = w_ptr + layer * w_sl
    w1 = tl.load(w_row + orr * w_sd, mask=cs_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_row + (orr + R) * w_sd, mask=cs_mask, other=0.0).to(tl.float32)
    eps = tl.load(eps_ptr + layer * eps_s).to(tl.float32)

    ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
    if BLOCK_P > 0:
        ss += tl.sum(x3 * x3, axis=2)
    rstd = tl.rsqrt(ss / D + eps)[:, :, None]
    n1 = x1 * rstd * w1
    n2 = x2 * rstd * w2

    out_ty = k_ptr.dtype.element_ty
    k_tile = k_base + ot64 * k_st + oh * k_sh
    tl.store(k_tile + orr * k_sd, (n1 * c - n2 * s).to(out_ty), mask=r_mask)
    tl.store(k_tile + (orr + R) * k_sd, (n2 * c + n1 * s).to(out_ty), mask=r_mask)
    if BLOCK_P > 0:
        w3 = tl.load(w_row + op * w_sd, mask=op < D, other=0.0).to(tl.float32)
        tl.store(k_tile + op * k_sd, (x3 * rstd * w3).to(out_ty), mask=p_mask)
    tl.store(v_base + ot64 * v_st + oh * v_sh + od * v_sd, v, mask=d_mask)


def _materialize_grid(T: int, num_kv_heads: int, num_layers: int, block_t: int, block_h: int) -> tuple[int]:
    """``_materialize_kernel``'s grid: one program per (token block, head block, layer), axis 0 in that order."""
    return (triton.cdiv(T, block_t) * triton.cdiv(num_kv_heads, block_h) * num_layers,)


@functools.lru_cache(maxsize=256)
def _tile_constants(num_kv_heads: int, head_dim: int, rotary_dim: int) -> dict[str, int]:
    """The kernel's compile-time shape arguments (cached: computing them per call costs more than the check)."""
    R = rotary_dim // 2
    pass_dims = head_dim - 2 * R
    return dict(
        H=num_kv_heads,
        D=head_dim,
        R=R,
        BLOCK_R=next_pow2(R),
        BLOCK_P=next_pow2(pass_dims) if pass_dims > 0 else 0,
        BLOCK_D=next_pow2(head_dim),
    )


# Up to this many tokens a program takes one token and one head (decode sizes: many short programs finish sooner than
# a few long ones; docs/benchmarks.md, "Materialize launch"); from there, BLOCK_T tokens x all heads.
SMALL_T = 32


def launch_config(T: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)`` for a launch: one token and head per program up to ``SMALL_T`` tokens, else
    about ``_TILE_ELEMENTS`` V elements per program (all heads).

    ``BLOCK_T = 4`` with 4 warps was the fastest measured (docs/benchmarks.md, "Materialize launch").
    """
    if T <= SMALL_T:
        return 1, 1, 1
    per_token = next_pow2(num_kv_heads) * next_pow2(head_dim)
    block_t = max(1, min(next_pow2(T), _TILE_ELEMENTS // per_token))
    tile = block_t * per_token
    num_warps = 8 if tile >= 8192 else 4 if tile >= 2048 else 2 if tile >= 512 else 1
    return block_t, next_pow2(num_kv_heads), num_warps


@attrs.frozen
class MaterializeLaunch:
    """Launch shape override: tokens and heads per program, warps (benchmarks; ``None`` keeps ``launch_config``'s)."""

    block_t: int | None = None
    block_h: int | None = None
    num_warps: int | None = None


def kv_outputs(
    kv: torch.Tensor, num_kv_heads: int, head_dim: int, k_out: torch.Tensor | None, v_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_out, v_out)`` for a materialize of ``kv [T, Lyr, 2*H*D]``: the given ones, and new layer-major
    ``[Lyr, T, H, D]`` tensors of ``kv``'s dtype and device for those not given (the kernel's and the traced op's
    one construction; the reference, an oracle, allocates its own)."""
    shape = (kv.shape[1], kv.shape[0], num_kv_heads, head_dim)
    if k_out is None:
        k_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    if v_out is None:
        v_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    return k_out, v_out


def materialize(
    kv: torch.Tensor, k_norm_weight: torch.Tensor, eps: torch.Tensor, cos_sin_cache: torch.Tensor,
    positions: torch.Tensor, num_kv_heads: int, head_dim: int, rotary_dim: int, k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None, *, check_positions: bool = False, launch_records: LaunchCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Normalize and rotate K, copy V, from ``kv [T, Lyr, 2*H*D]`` into layer-major ``[Lyr, T, H, D]`` outputs
    (docs/kernels.md §5); returns ``(k_out, v_out)``. The arguments up to ``v_out`` may be passed by position, in the
    order of docs/kernels.md §5.

    Parameters
    ----------
    kv : Tensor
        Read. ``[T, Lyr, 2*H*D]`` float16/bfloat16/float32, last dim dense: K then V of each token and layer.
    k_norm_weight : Tensor
        Read. ``[Lyr, D]``: RMSNorm weight of K per layer; one ``[D]`` weight shared by every layer is refused,
        pass ``w.expand(Lyr, D)`` (read through its strides, no copy).
    eps : Tensor
        Read. ``[Lyr]`` float32: RMSNorm epsilon per layer (an expanded scalar works).
    cos_sin_cache : Tensor
        Read. ``[max_pos, rotary_dim]`` float32: cos then sin halves per position.
    positions : Tensor
        Read. ``[T]`` integer: each token's position (clamped into the cache unless ``check_positions``).
    num_kv_heads, head_dim, rotary_dim : int
        ``H``, ``D`` and the rotated leading dims of each head (even, ``<= D``).
    k_out, v_out : Tensor, optional
        Written. ``[Lyr, T, H, D]`` of ``kv``'s dtype, any strides (e.g. views of a pool slab); allocated if ``None``.
    check_positions : bool
        Raise ``ValueError`` for positions outside the cache. Reads them on the host (a synchronisation): off by
        default, and must stay off under CUDA-graph capture.
    launch_records : LaunchCache, optional
        Where a checked call's launches are recorded, so that a later call laid out alike skips its checks and
        relaunches them under the records' policy (``kvplan.runtime.launch_replay``; a pool passes its own). ``None``
        (the default): every call is checked and launched, nothing is recorded.

    Given both outputs it allocates nothing and never synchronises (unless ``check_positions``).
    """
    call = MaterializeCall(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out,
                           v_out, check_positions)  # fmt: skip
    return run_materialize_call(call, records=launch_records)


def run_materialize(
    kv: torch.Tensor, k_norm_weight: torch.Tensor, eps: torch.Tensor, cos_sin_cache: torch.Tensor,
    positions: torch.Tensor, num_kv_heads: int, head_dim: int, rotary_dim: int, k_out: torch.Tensor | None,
    v_out: torch.Tensor | None, check_positions: bool, launch: MaterializeLaunch | None = None,
    records: LaunchCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``materialize`` with the private launch override, argument by argument (the benchmarks, the compile check):
    builds the call's record for :func:`run_materialize_call`."""
    call = MaterializeCall(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out,
                           v_out, check_positions)  # fmt: skip
    return run_materialize_call(call, launch, records)


def run_materialize_call(
    call: MaterializeCall, launch: MaterializeLaunch | None = None, records: LaunchCache | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check and launch one materialize's record (``kvplan.calls.MaterializeCall``): every entry point's launch
    (:func:`materialize`, :func:`run_materialize`, ``kvplan.ops.run_materialize`` and the custom op, so the pool and
    the materializer); ``launch`` overrides the launch shape. Returns ``(k_out, v_out)``. With ``records``, a call laid
    out like a checked one that allocated nothing is replayed (``kvplan.runtime.launch_replay``) from them; without,
    every call is checked and launched, nothing recorded."""
    (kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out,
     check_positions) = call  # fmt: skip
    if type(rotary_dim) is not int or type(head_dim) is not int or type(num_kv_heads) is not int:  # (NumPy's: ints)
        num_kv_heads, head_dim, rotary_dim = (plain_int(v) for v in (num_kv_heads, head_dim, rotary_dim))
    key = None
    if records is not None and k_out is not None and v_out is not None and not check_positions:
        # (a call that allocates or reads positions on the host is never replayed)
        values = (kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out)
        key = records.key((*values, launch))
        if records.relaunch(key, kv):
            return k_out, v_out
    check_materialize_args(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
    )
    if kv.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        check_interpreter_set_first("kv")  # (set only after the kernels were decorated: named, not failed in Triton)
    T, num_layers = kv.shape[0], kv.shape[1]
    H, D = num_kv_heads, head_dim
    k_out, v_out = kv_outputs(kv, H, D, k_out, v_out)
    if T == 0 or num_layers == 0:
        return k_out, v_out
    if positions.device != kv.device:
        key = None  # a copy made per call: nothing to replay
        positions = positions.to(kv.device)
    max_pos = cos_sin_cache.shape[0]
    if check_positions:
        check_positions_in_range(positions, max_pos)

    default_block_t, default_block_h, default_warps = launch_config(T, H, D)
    launch = launch or MaterializeLaunch()
    block_t = launch.block_t or default_block_t
    block_h = launch.block_h or default_block_h
    grid = _materialize_grid(T, H, num_layers, block_t, block_h)
    recorder = UNRECORDED if records is None else Recorder()
    with device_guard(kv.device):
        recorder.launch(
            _materialize_kernel,
            grid,
            kv_ptr=kv,
            w_ptr=k_norm_weight,
            eps_ptr=eps,
            eps_s=eps.stride(0),
            cs_ptr=cos_sin_cache,
            pos_ptr=positions,
            k_ptr=k_out,
            v_ptr=v_out,
            T=T,
            max_pos=max_pos,
            kv_st=kv.stride(0),
            kv_sl=kv.stride(1),
            kv_sd=kv.stride(2),
            w_sl=k_norm_weight.stride(0),
            w_sd=k_norm_weight.stride(1),
            cs_sp=cos_sin_cache.stride(0),
            cs_sd=cos_sin_cache.stride(1),
            pos_s=positions.stride(0),
            k_sl=k_out.stride(0),
            k_st=k_out.stride(1),
            k_sh=k_out.stride(2),
            k_sd=k_out.stride(3),
            v_sl=v_out.stride(0),
            v_st=v_out.stride(1),
            v_sh=v_out.stride(2),
            v_sd=v_out.stride(3),
            LAYERS=num_layers,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            **_tile_constants(H, D, rotary_dim),
            num_warps=launch.num_warps or default_warps,
        )
    if records is not None:
        records.remember(key, recorder)
    return k_out, v_out
