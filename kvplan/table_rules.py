"""The rules of the hot-buffer tables (docs/kernels.md §1) that more than one check runs, each declared once with its
text: :class:`kvplan.HotBufferState` runs them when it is built, :func:`kvplan.validate.arguments.check_swap_in` on
every swap-in call (the kernels', the ops', the pool's and the reference's: a call record can be built around a state),
so one broken table gets one message wherever it arrives.

- :data:`TABLES`: the five tables in ``HotBufferState``'s field order, each with its dtype and whether it may be
  ``None`` (``scratch_locs``: no scratch rows).
- :func:`not_tensor` and :func:`wrong_dtype`: the type and dtype rules (the texts of every tensor argument of a call,
  the tables' included).
- :func:`row_stride_error` and :func:`hot_error`: the rules relating the tables (one row stride for the two slot tables;
  at most ``HOT_MAX`` hot slots).

Each rule returns its error (``None`` when the tables keep it), as the raw validators of
:mod:`kvplan.validate.messages` do, and the caller raises it at its own place among its own checks: a call breaking
several rules reports the same first one as before the rules were shared. The texts the two checks do not share (the
state's shape texts name ``[R, W]``, the call's its arguments') stay with each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvplan.workspace import HOT_MAX

__all__ = ["TABLE", "TABLES", "Table", "hot_error", "not_tensor", "row_stride_error", "wrong_dtype"]


class Table(NamedTuple):
    """One hot-buffer table: its name (the argument's and the state's field's), its dtype, and whether ``None``
    stands for it (a state without scratch rows)."""

    name: str
    dtype: torch.dtype
    optional: bool = False


TABLES = (
    Table("device_buffer_tokens", torch.int32),
    Table("device_buffer_locs", torch.int32),
    Table("lru_slots", torch.int16),
    Table("host_cache_locs", torch.int64),
    Table("scratch_locs", torch.int32, optional=True),
)
TABLE = {table.name: table for table in TABLES}


def not_tensor(name: str, value: object) -> TypeError | None:
    """``value`` must be a tensor: ``{name} must be a torch.Tensor, got {type}.``"""
    if isinstance(value, torch.Tensor):
        return None
    return TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")


def wrong_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> ValueError | None:
    """``t`` must have one of ``dtypes`` (a table: its :data:`TABLES` dtype): ``{name} must be {dtype}, got ...``"""
    if t.dtype in dtypes:
        return None
    return ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}.")


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
