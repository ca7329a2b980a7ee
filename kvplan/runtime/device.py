"""Device helpers the kernel launchers share: the device guard, the SM count that sizes grids, whether a launch may
start early (programmatic dependent launch), and KV rows viewed as the widest integer words."""

from __future__ import annotations

import contextlib
import functools

import torch

from kvplan.runtime.triton_adapter import interpreted

__all__ = ["as_words", "dependent_launch", "device_guard", "num_sms", "row_word_dtype"]

# Widest integer word first: a row copied as int64 words moves 8 bytes per lane instead of 1.
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a CUDA launch (a Triton launch goes to the current device, not the tensor's)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 under the interpreter), cached: it sizes copy grids."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def dependent_launch(device: torch.device, kernel: object) -> bool:
    """Whether ``kernel``, following another launch of the same call, may start early on ``device`` (programmatic
    dependent launch): compiled kernels on Hopper or later. Such a kernel calls ``gdc_wait`` before its first access,
    so only its launch overlaps the kernel before it; the first kernel of a call never starts early."""
    return device.type == "cuda" and not interpreted(kernel) and _hopper_or_later(device)


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def row_word_dtype(*rows: torch.Tensor) -> torch.dtype:
    """Widest integer word that divides every given 2-D tensor's row bytes, row pitch and start address.

    Copy kernels move rows as such words, so 576-byte rows go as 72 int64 words and a 13-byte row as 13 bytes;
    the tail of the power-of-two block is masked, so any item size is copied completely.
    """
    for dtype in _WORD_DTYPES:
        size = dtype.itemsize
        if all(
            (t.shape[1] * t.element_size()) % size == 0
            and (t.stride(0) * t.element_size()) % size == 0
            and t.data_ptr() % size == 0
            for t in rows
        ):
            return dtype
    return torch.uint8


def as_words(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` ([n, item], last dim contiguous) reinterpreted as ``dtype`` words: same storage, no copy."""
    return rows if rows.dtype == dtype else rows.view(torch.uint8).view(dtype)
