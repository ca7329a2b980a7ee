"""Raw validators for the kernels' arguments (docs/kernels.md §6), with boolean guards beside them.

Engines that call the kernels directly match these messages with regexes, so a ``ValueError`` message is exactly the
spec text, or the spec text, one space and a hint of the fix. The spec's checks run in the spec's order; kvplan's own
checks (layout and devices the kernels rely on) run after all of them, so an input failing a spec rule always reports
that rule. ``TypeError``s for arguments of the wrong Python type come before every ``ValueError``.

Every check looks only at shapes, dtypes, strides and devices: it never reads tensor contents, never synchronises with
the device and allocates nothing when the input is valid. Each check and its guard share one function that returns
the error instead of raising it, so ``*_fits(...)`` is ``True`` exactly when ``check_*(...)`` passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvplan.config import as_int
from kvplan.errors import NotAnIntError
from kvplan.table_rules import device_key  # (the one-device rule's key; exported here too)

_Error = TypeError | ValueError


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    """Shapes print as Python tuples, ``(5, 7, 8, 128)``, never as ``torch.Size([...])``."""
    return tuple(t.shape)


def _spec_error(spec_text: str, hint: str) -> ValueError:
    return ValueError(f"{spec_text} {hint}")


def _not_tensor(name: str, value: object, *, optional: bool = False) -> TypeError | None:
    if isinstance(value, torch.Tensor) or (optional and value is None):
        return None
    expected = "a torch.Tensor or None" if optional else "a torch.Tensor"
    return TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def _not_int(name: str, value: object) -> TypeError | None:
    """None for an int (NumPy's too, docs/errors.md); else the one rule's error, naming ``name``."""
    if as_int(value) is not None:
        return None
    return NotAnIntError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return device_key(a) == device_key(b)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


# --------------------------------------------------------------------------------------------------------------------
# Miss plan (single-step and speculative)

# A plan is three tensors or none (the SGLang adapter raises this text bare, as SGLang does).
PLAN_TOGETHER = "miss_src, miss_dst, and miss_count must be provided together."


def plan_dtype_error(miss_src: Tensor, miss_dst: Tensor, miss_count: Tensor) -> ValueError | None:
    """The plan's dtypes, with the texts of docs/kernels.md §6: the swap-in's plan check and the plan copy's
    (``kvplan.validate.arguments.check_copy``) both run it."""
    if miss_src.dtype != torch.int64 or miss_dst.dtype != torch.int32:
        return _spec_error(
            "miss_src must be int64 and miss_dst must be int32.",
            f"Got miss_src {miss_src.dtype}, miss_dst {miss_dst.dtype}.",
        )
    if miss_count.dtype != torch.int32:
        return _spec_error("miss_count must be int32.", f"Got {miss_count.dtype}.")
    return None


def _miss_plan_error(
    top_k_tokens: object, miss_src: object, miss_dst: object, miss_count: object, *, speculative: bool
) -> _Error | None:
    error = _not_tensor("top_k_tokens", top_k_tokens)
    for name, value in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        error = error or _not_tensor(name, value, optional=True)
    if error is not None:
        return error

    prefix = "speculative " if speculative else ""
    if top_k_tokens.ndim != (3 if speculative else 2):
        if speculative:
            return _spec_error(
                "speculative top_k_tokens must have shape [batch, steps, top_k].",
                f"Got {_shape(top_k_tokens)}; single-step [batch, top_k] calls use check_miss_plan.",
            )
        return _spec_error(
            "top_k_tokens must have shape [batch, top_k].",
            f"Got {_shape(top_k_tokens)}; speculative [batch, steps, top_k] calls use check_spec_miss_plan.",
        )

    plan = {"miss_src": miss_src, "miss_dst": miss_dst, "miss_count": miss_count}
    given = [name for name, t in plan.items() if t is not None]
    if not given:
        return None
    if len(given) < 3:
        missing = [name for name in plan if name not in given]
        return _spec_error(
            PLAN_TOGETHER,
            f"Got {' and '.join(given)} without {' and '.join(missing)}; pass all three views of one plan, or none.",
        )
    if error := plan_dtype_error(miss_src, miss_dst, miss_count):
        return error

    batch = top_k_tokens.shape[0]
    steps = top_k_tokens.shape[1] if speculative else 1
    top_k = top_k_tokens.shape[-1]
    capacity = steps * top_k
    if any(t.ndim != 2 or t.shape[0] < batch or t.shape[1] < capacity for t in (miss_src, miss_dst)):
        if speculative:
            spec_text = (
                f"speculative miss_src/miss_dst must have shape [batch, >= steps * top_k] (capacity {capacity})."
            )
            sizing = f"batch={batch}, num_steps={steps}, top_k={top_k}"
        else:
            spec_text = f"miss_src/miss_dst must have shape [batch, >= top_k] (capacity {capacity})."
            sizing = f"batch={batch}, top_k={top_k}"
        return _spec_error(
            spec_text,
            f"Got miss_src {_shape(miss_src)}, miss_dst {_shape(miss_dst)} for batch={batch}; "
            f"size the plan with PlanBufferPool.ensure_capacity({sizing}) and pass its views.",
        )
    if miss_count.ndim != 1 or miss_count.shape[0] < batch:
        return _spec_error(
            f"{prefix}miss_count must have shape [batch].",
            f"Got {_shape(miss_count)} for batch={batch}.",
        )
    if miss_src.stride(0) != miss_dst.stride(0):
        return _spec_error(
            "miss_src/miss_dst row strides must match.",
            f"Got {miss_src.stride(0)} and {miss_dst.stride(0)}; take both as [:batch, :capacity] views of slabs "
            "with the same column count (the pool's views always are).",
        )

    # kvplan's own checks: what the kernels need to address the plan safely.
    device = top_k_tokens.device
    if not all(_same_device(t.device, device) for t in plan.values()):
        return ValueError(
            f"miss_src, miss_dst and miss_count must be on top_k_tokens' device {device}: got "
            f"{miss_src.device}, {miss_dst.device}, {miss_count.device}. Take the plan views from the pool of that "
            "device."
        )
    columns_strided = capacity > 1 and (miss_src.stride(1) != 1 or miss_dst.stride(1) != 1)
    rows_overlap = batch > 1 and miss_src.stride(0) < capacity
    if columns_strided or rows_overlap:
        return ValueError(
            "miss_src/miss_dst must have unit column stride and rows that do not overlap: got strides "
            f"{miss_src.stride()} and {miss_dst.stride()} for capacity {capacity}. Pass row-major slabs or "
            "[:batch, :capacity] slices of them, not transposed, stepped or expanded views."
        )
    if batch > 1 and miss_count.stride(0) != 1:
        return ValueError(
            f"miss_count must have unit stride: got stride {miss_count.stride(0)}. Pass a contiguous [batch] tensor "
            "or a [:batch] slice of one."
        )
    return None


_Given = Tensor | None  # a miss-plan tensor the caller may leave to the kernel to allocate


def _raise_if(error: Exception | None) -> None:
    if error is not None:
        raise error


def check_spec_miss_plan(top_k_tokens: Tensor, miss_src: _Given, miss_dst: _Given, miss_count: _Given) -> None:
    """Validate a speculative swap-in's ``[batch, steps, top_k]`` top-k and optional miss plan (docs/kernels.md §6)."""
    _raise_if(_miss_plan_error(top_k_tokens, miss_src, miss_dst, miss_count, speculative=True))


def check_miss_plan(top_k_tokens: Tensor, miss_src: _Given, miss_dst: _Given, miss_count: _Given) -> None:
    """Validate a single-step swap-in's ``[batch, top_k]`` top-k and its optional miss plan (docs/kernels.md §6)."""
    _raise_if(_miss_plan_error(top_k_tokens, miss_src, miss_dst, miss_count, speculative=False))


def spec_miss_plan_fits(top_k_tokens: Tensor, miss_src: _Given, miss_dst: _Given, miss_count: _Given) -> bool:
    """True exactly when :func:`check_spec_miss_plan` would pass; never raises for bad input."""
    return _miss_plan_error(top_k_tokens, miss_src, miss_dst, miss_count, speculative=True) is None


def miss_plan_fits(top_k_tokens: Tensor, miss_src: _Given, miss_dst: _Given, miss_count: _Given) -> bool:
    """True exactly when :func:`check_miss_plan` would pass; never raises for bad input."""
    return _miss_plan_error(top_k_tokens, miss_src, miss_dst, miss_count, speculative=False) is None


# --------------------------------------------------------------------------------------------------------------------
# Fused KV materialization


def _output_error(
    name: str, out: torch.Tensor | None, expected_shape: tuple[int, ...], kv: torch.Tensor
) -> ValueError | None:
    """The spec's shape then device/dtype check of one output (``None`` outputs are allocated and always fit)."""
    if out is None:
        return None
    if _shape(out) != expected_shape:
        return _spec_error(
            f"Invalid {name} shape for fused KV materialization: got {_shape(out)}, expected {expected_shape}.",
            f"Pass {name}=None to allocate it, or a [n_layers, total_ctx, num_kv_heads, head_dim] view of a slab.",
        )
    if not _same_device(out.device, kv.device) or out.dtype != kv.dtype:
        return _spec_error(
            f"Invalid {name} device/dtype for fused KV materialization: got device={out.device}, dtype={out.dtype}, "
            f"expected device={kv.device}, dtype={kv.dtype}.",
            f"Allocate {name} like kv.",
        )
    return None


def _size_error(num_kv_heads: int, head_dim: int, *, low: int) -> ValueError | None:
    """kvplan's own check of the two sizes, after the engines' list: each at least ``low``."""
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value < low:
            if low == 1:
                return ValueError(f"{name} must be positive for fused KV materialization, got {value}.")
            return ValueError(f"{name} must be non-negative for fused KV materialization, got {value}.")
    return None


def _materialize_error(
    kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
) -> _Error | None:
    tensors = {
        "kv": kv,
        "k_norm_weight": k_norm_weight,
        "eps": eps,
        "cos_sin_cache": cos_sin_cache,
        "positions": positions,
    }
    for name, value in tensors.items():
        if error := _not_tensor(name, value):
            return error
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("rotary_dim", rotary_dim)):
        if error := _not_int(name, value):
            return error
    for name, value in (("k_out", k_out), ("v_out", v_out)):
        if error := _not_tensor(name, value, optional=True):
            return error
    num_kv_heads, head_dim, rotary_dim = as_int(num_kv_heads), as_int(head_dim), as_int(rotary_dim)  # (NumPy's)

    heads, dim = num_kv_heads, head_dim
    if kv.ndim != 3:
        return _spec_error(
            f"Invalid stacked fused KV projection shape: got {_shape(kv)}, expected 3D "
            "[total_ctx, n_layers, kv_size*2].",
            f"Stack the layers' projections as [total_ctx, n_layers, {2 * heads * dim}].",
        )
    total_ctx, n_layers = kv.shape[0], kv.shape[1]
    if total_ctx == 0:  # nothing more of the list; a negative size cannot shape the (n_layers, 0, H, D) outputs
        return _size_error(num_kv_heads, head_dim, low=0)
    if kv.shape[2] != 2 * heads * dim:
        return _spec_error(
            f"Invalid fused KV projection shape: got {_shape(kv)}, expected trailing dim {2 * heads * dim}.",
            f"The last dim holds {heads} K heads then {heads} V heads of {dim} values each.",
        )
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        return _spec_error(
            f"Invalid fused KV rotary/head dim pair: rotary_dim={rotary_dim}, head_dim={head_dim}.",
            "rotary_dim must be even and in [2, head_dim].",
        )
    if _shape(k_norm_weight) != (n_layers, dim):
        return _spec_error(
            "Invalid stacked k_norm_weight shape for fused KV materialization: got "
            f"{_shape(k_norm_weight)}, expected {(n_layers, dim)}.",
            "Stack one K RMSNorm weight per layer as [n_layers, head_dim].",
        )
    if _shape(eps) != (n_layers,):
        return _spec_error(
            f"Invalid stacked eps shape for fused KV materialization: got {_shape(eps)}, expected {(n_layers,)}.",
            "Pass one epsilon per layer.",
        )
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] < rotary_dim:
        return _spec_error(
            f"Invalid cos_sin_cache shape for fused KV materialization: got {_shape(cos_sin_cache)}, "
            f"expected [max_pos, >= {rotary_dim}].",
            "Row p holds rotary_dim/2 cosines then rotary_dim/2 sines.",
        )
    if positions.ndim != 1 or positions.shape[0] != total_ctx:
        count = positions.shape[0] if positions.ndim == 1 else _shape(positions)
        return _spec_error(
            f"positions must match kv token count for fused KV materialization: positions={count}, "
            f"total_ctx={total_ctx}.",
            "Pass a 1-D tensor with one RoPE position per token.",
        )
    expected_out = (n_layers, total_ctx, heads, dim)
    if error := _output_error("k_out", k_out, expected_out, kv):
        return error
    if error := _output_error("v_out", v_out, expected_out, kv):
        return error
    if error := _size_error(num_kv_heads, head_dim, low=1):  # (the list refuses all but H == 0 with kv [T, Lyr, 0])
        return error

    # kvplan's own checks: dtypes, devices and layouts the kernel reads without copying.
    if not kv.dtype.is_floating_point:
        return ValueError(f"kv must be a floating tensor for fused KV materialization: got dtype={kv.dtype}.")
    for name in ("k_norm_weight", "eps", "cos_sin_cache"):
        t = tensors[name]
        if not t.dtype.is_floating_point:
            return ValueError(
                f"{name} must be a floating tensor for fused KV materialization: got dtype={t.dtype}. "
                "Any floating dtype is read as float32."
            )
        if not _same_device(t.device, kv.device):
            return ValueError(
                f"{name} must be on kv's device for fused KV materialization: got device={t.device}, "
                f"expected device={kv.device}."
            )
    if cos_sin_cache.shape[0] == 0:
        return ValueError(
            "cos_sin_cache must have at least one position row for fused KV materialization: got "
            f"{_shape(cos_sin_cache)}."
        )
    if not _is_integer_dtype(positions.dtype):
        return ValueError(
            f"positions must be an integer tensor for fused KV materialization: got dtype={positions.dtype}."
        )
    for name, t, dim_index in (("kv", kv, 2), ("k_out", k_out, 3), ("v_out", v_out, 3)):
        if t is not None and t.shape[dim_index] > 1 and t.stride(dim_index) != 1:
            return ValueError(
                f"{name} must have a unit stride in its last dim for fused KV materialization: got strides "
                f"{t.stride()}. Pass a view whose last dim is dense (e.g. .contiguous())."
            )
    return None


def check_materialize(
    kv: Tensor, k_norm_weight: Tensor, eps: Tensor, cos_sin_cache: Tensor, positions: Tensor, num_kv_heads: int,
    head_dim: int, rotary_dim: int, k_out: Tensor | None = None, v_out: Tensor | None = None,
) -> None:  # fmt: skip
    """Validate fused KV materialization arguments in the order of docs/kernels.md §6; ``T == 0`` passes early."""
    error = _materialize_error(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
    )
    _raise_if(error)


def materialize_fits(*args: object, **kwargs: object) -> bool:
    """True exactly when :func:`check_materialize` would pass with the same arguments; never raises for bad input
    (arguments it does not take included)."""
    try:
        check_materialize(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True
