"""Small launch helpers shared by the kernel wrappers: device guard, power-of-two blocks, word views of KV rows."""

from __future__ import annotations

import contextlib
import functools

import torch

# Widest integer word first: a row copied as int64 words moves 8 bytes per lane instead of 1.
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton blocks are powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


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
