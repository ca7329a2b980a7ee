"""The rules of the hot-buffer tables (docs/kernels.md §1) and of the tensor arguments that more than one check runs,
each declared once with its text: :class:`kvplan.HotBufferState` runs the tables' when it is built, the call checks of
:mod:`kvplan.validate.arguments` run them on every call (the kernels', the ops', the pool's and the reference's: a
swap-in's call record can be built around a state), so one broken table gets one message wherever it arrives.

This module sits below the state and below :mod:`kvplan.validate` (it imports neither): the call checks import the
call record, which imports the state, so a state importing the validation package would close a circle.

- :data:`TABLES`: the five tables in ``HotBufferState``'s field order, each with its dtype, the shape the texts name,
  and whether it may be ``None`` (``scratch_locs``: no scratch rows).
- :func:`not_tensor`, :func:`wrong_dtype`, :func:`wrong_shape`, :func:`unresolved_view` and :func:`wrong_device`: the
  type, dtype, shape (2-D, rows, row-major rows), stored-values and one-device rules (the texts of every tensor
  argument of a call, the tables' included).
- :func:`row_stride_error` and :func:`hot_error`: the rules relating the tables (one row stride for the two slot tables;
  at most ``HOT_MAX`` hot slots).

Each rule returns its error (``None`` when the tables keep it), as the raw validators of
:mod:`kvplan.validate.messages` do, and the caller raises it at its own place among its own checks: a call breaking
several rules reports the same first one as before the rules were shared, and the state runs the shape, device and
stored-values rules in the call's order. Each check keeps its own reach (the state does not ask for row-major columns;
the call check skips the row stride of one request). The texts the two checks do not share stay with each: the state's
words for some relations of the tables, which its tests name (``device_buffer_locs`` ``(R, W) like
device_buffer_tokens``, ``lru_slots``' ``1 <= hot < W``, ``host_cache_locs``' contiguous rows, ``scratch_locs``
``[R, C]``), and the call's that name its other arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvplan.workspace import HOT_MAX

__all__ = [
    "TABLE", "TABLES", "Table", "device_key", "hot_error", "not_tensor", "row_stride_error", "unresolved_view",
    "wrong_device", "wrong_dtype", "wrong_shape",
]  # fmt: skip


class Table(NamedTuple):
    """One hot-buffer table: its name (the argument's and the state's field's), its dtype, the shape its texts name
    (``{requests}`` and ``{width}``: ``device_buffer_tokens``' rows and columns, filled in when a text is built), and
    whether ``None`` stands for it (a state without scratch rows)."""

    name: str
    dtype: torch.dtype
    shape: str
    optional: bool = False


TABLES = (
    Table("device_buffer_tokens", torch.int32, "[requests, hot + tail]"),
    Table("device_buffer_locs", torch.int32, "[{requests}, {width}] (device_buffer_tokens')"),
    Table("lru_slots", torch.int16, "[{requests}, hot]"),
    Table("host_cache_locs", torch.int64, "[{requests}, max_len]"),
    Table("scratch_locs", torch.int32, "[{requests}, scratch]", optional=True),
)
TABLE = {table.name: table for table in TABLES}


def not_tensor(name: str, value: object, *, optional: bool = False) -> TypeError | None:
    """``value`` must be a tensor (``optional``: or ``None``): ``{name} must be a torch.Tensor[ or None], got
    {type}.``"""
    if isinstance(value, torch.Tensor) or (optional and value is None):
        return None
    expected = "a torch.Tensor or None" if optional else "a torch.Tensor"
    return TypeError(f"{name} must be {expected}, got {type(value).__name__}.")


def wrong_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> ValueError | None:
    """``t`` must have one of ``dtypes`` (a table: its :data:`TABLES` dtype): ``{name} must be {dtype}, got ...``"""
    if t.dtype in dtypes:
        return None
    return ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}.")


def wrong_shape(
    name: str,
    t: torch.Tensor,
    requests: int | None = None,
    width: int | None = None,
    *,
    rows: bool = False,
    columns: bool = True,
    shape: str | None = None,
) -> ValueError | None:
    """``t`` is 2-D (with ``rows``: of ``requests`` rows), ``{name} must have shape {shape}, got {given}.``, and with
    ``columns`` its rows are row-major (the kernels address row ``r`` as base + r * stride(0) + column):
    ``{name} must have unit column stride (row-major rows), got strides {strides}.``

    ``shape`` (a table's: its :data:`TABLES` shape) is the expected shape's text, ``{requests}`` and ``{width}``
    filled in from the arguments only when the text is built (nothing is formatted for a tensor that fits)."""
    if t.dim() != 2 or (rows and t.shape[0] != requests):
        expected = (TABLE[name].shape if shape is None else shape).format(requests=requests, width=width)
        return ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}.")
    if columns and t.shape[1] > 1 and t.stride(1) != 1:
        return ValueError(f"{name} must have unit column stride (row-major rows), got strides {t.stride()}.")
    return None


def unresolved_view(**tensors: object) -> ValueError | None:
    """Every given tensor's data is what its bits say. A negative view (``torch._neg_view``, the ``imag`` of a
    conjugate) or a conjugate one (``conj()`` of a complex tensor) shares its base's memory with a flag that torch's
    own ops apply on read; a kernel reads the stored words, so it would copy or read the base's values, or fail deep
    inside torch. The first such tensor's error, by name; non-tensors are skipped. Reads two flags per tensor."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj()):
            what, fix = ("negative", "resolve_neg") if t.is_neg() else ("conjugate", "resolve_conj")
            return ValueError(
                f"{name} must hold its values as stored, got a {what} view (torch applies its {what} bit on read; "
                f"the kernel reads the stored values); pass {name}.{fix}(), a plain copy."
            )
    return None


def device_key(device: torch.device) -> tuple[str, int]:
    """``cuda`` and ``cuda:0`` (when 0 is current) are one device: compare (type, index) with the index filled in."""
    if device.index is not None:
        return device.type, device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return device.type, torch.cuda.current_device()
    return device.type, 0


def wrong_device(device: torch.device | None, owner: str, **tensors: torch.Tensor | None) -> ValueError | None:
    """Every given tensor (``None`` skipped) is on ``device``, ``owner``'s: ``{name} must be on the kernels' device
    {device} (that of {owner}), got {given}.`` ``device=None`` (the reference, which runs wherever the tensors are):
    nothing to check."""
    if device is None:
        return None
    key = None  # (device_key only for a device that is not ``device`` itself)
    for name, t in tensors.items():
        if t is None or (given := t.device) == device:
            continue
        if key is None:
            key = device_key(device)
        if device_key(given) != key:
            return ValueError(f"{name} must be on the kernels' device {device} (that of {owner}), got {given}.")
    return None


def row_stride_error(device_buffer_tokens: torch.Tensor, device_buffer_locs: torch.Tensor) -> ValueError | None:
    """The two slot tables share one row stride: the kernels address row ``rid`` of both with one offset."""
    expected, given = device_buffer_tokens.stride(0), device_buffer_locs.stride(0)
    if given == expected:
        return None
    return ValueError(f"device_buffer_locs must have device_buffer_tokens' row stride {expected}, got {given}.")


def hot_error(hot: int) -> ValueError | None:
    """``lru_slots`` has at most ``HOT_MAX`` columns: its entries are int16 slot numbers."""
    if hot <= HOT_MAX:
        return None
    return ValueError(f"lru_slots must have at most {HOT_MAX} columns (int16 slot numbers), got hot = {hot}.")
