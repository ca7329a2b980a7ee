"""Miss-plan copy: host rows -> device rows, one full-grid kernel for swap-in's own copy and for plan replay.

The copy is bound by the host link, so it is spread over the whole GPU: a 2-D grid of (batch row, chunk) programs,
each walking its row's plan entries ``m < miss_count[row]`` in strides of the whole chunk count, copying a tile of
rows at a time as the widest integer words that divide the item size. Row pitches are compile-time constants, so the
compiler knows each row's alignment and issues 16-byte loads where the pitch allows. The loop bound is read on the
device, so the launch never synchronises and can be captured in a CUDA graph. Every row index is checked against its
tensor: a broken plan skips the entry instead of touching memory outside ``host_cache`` / ``device_buffer``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels import checks
from kvplan.kernels._launch import as_words, device_guard, next_pow2, num_sms, row_word_dtype

# Swept on an H200 (scripts/bench_swap_in.py --sweep): 50,048 rows of 576 B from a 4.6 GB pinned cache ran at
# 21.3-21.8 GB/s for every rows-per-program (4-16) x warps (4, 8) x programs-per-SM (8, 32) tried: the host side,
# not the launch shape, bounds random row reads. These are the best of the sweep.
ROWS_PER_PROGRAM = 16
PROGRAMS_PER_SM = 8
NUM_WARPS = 4


@triton.jit(do_not_specialize=["batch", "capacity", "n_host", "n_dev", "counter_base", "row_bytes"])
def _copy_rows_kernel(
    host_ptr,
    dev_ptr,
    miss_src_ptr,
    miss_dst_ptr,
    miss_count_ptr,
    num_real_ptr,
    counters_ptr,
    batch,
    capacity,
    plan_stride,
    n_host,
    n_dev,
    counter_base,
    row_bytes,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.load(num_real_ptr), batch)
    if row < n_real:
        count = tl.minimum(tl.load(miss_count_ptr + row), capacity)
        plan_row = row.to(tl.int64) * plan_stride
        lanes = tl.arange(0, ROWS)
        words = tl.arange(0, BLOCK_W)
        word_ok = words < WORDS
        copied = tl.zeros([ROWS], dtype=tl.int32)
        start = chunk * ROWS
        while start < count:
            m = start + lanes
            in_plan = m < count
            src = tl.load(miss_src_ptr + plan_row + m, mask=in_plan, other=-1)
            dst = tl.load(miss_dst_ptr + plan_row + m, mask=in_plan, other=-1).to(tl.int64)
            ok = in_plan & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
            tile_ok = ok[:, None] & word_ok[None, :]
            src_off = src[:, None] * HOST_STRIDE + words[None, :]
            dst_off = dst[:, None] * DEV_STRIDE + words[None, :]
            values = tl.load(host_ptr + src_off, mask=tile_ok)
            tl.store(dev_ptr + dst_off, values, mask=tile_ok)
            copied += ok.to(tl.int32)
            start += CHUNKS * ROWS
        if HAS_COUNTERS:
            n = tl.sum(copied, axis=0).to(tl.int64)
            if n > 0:
                tl.atomic_add(counters_ptr + counter_base, n)
                tl.atomic_add(counters_ptr + counter_base + 1, n * row_bytes)


def launch_copy(
    *,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    counters: torch.Tensor | None,
    counter_base: int,
    batch: int | None = None,
    rows_per_program: int | None = None,
    programs_per_sm: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Launch the copy on already validated arguments (the first ``batch`` plan rows; default: all of them).

    The launch parameters default to the module's tuned constants (the benchmark passes others to sweep them)."""
    batch = miss_count.shape[0] if batch is None else batch
    rows_per_program = rows_per_program or ROWS_PER_PROGRAM
    programs_per_sm = programs_per_sm or PROGRAMS_PER_SM
    num_warps = num_warps or NUM_WARPS
    capacity = miss_src.shape[1]
    if batch == 0 or capacity == 0 or host_cache.shape[1] == 0:
        return
    word = row_word_dtype(host_cache, device_buffer)
    host_words = as_words(host_cache, word)
    dev_words = as_words(device_buffer, word)
    words = host_words.shape[1]
    device = device_buffer.device
    rows = min(rows_per_program, next_pow2(capacity))
    chunks = min(triton.cdiv(capacity, rows), max(1, triton.cdiv(programs_per_sm * num_sms(device), batch)))
    dummy = miss_count
    with device_guard(device):
        _copy_rows_kernel[(batch, chunks)](
            host_words,
            dev_words,
            miss_src,
            miss_dst,
            miss_count,
            dummy if num_real_reqs is None else num_real_reqs,
            dummy if counters is None else counters,
            batch,
            capacity,
            miss_src.stride(0),
            host_words.shape[0],
            dev_words.shape[0],
            counter_base,
            host_cache.shape[1] * host_cache.element_size(),
            HOST_STRIDE=host_words.stride(0),
            DEV_STRIDE=dev_words.stride(0),
            WORDS=words,
            BLOCK_W=next_pow2(words),
            ROWS=rows,
            CHUNKS=chunks,
            HAS_NUM_REAL=num_real_reqs is not None,
            HAS_COUNTERS=counters is not None,
            num_warps=num_warps,
        )


def copy_planned(
    *,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    counters: torch.Tensor | None = None,
    counter_base: int = REPLAY_COPY_BASE,
) -> None:
    """Replay a miss plan: copy host row ``miss_src[r, m]`` to device row ``miss_dst[r, m]`` for real rows ``r``
    and ``m < miss_count[r]`` (spec §4). Layers sharing the anchor's top-k call this with their own caches.

    ``num_real_reqs`` is a ``[1]`` int32 device tensor (``None``: every plan row is real). Adds (rows, bytes) to
    ``counters[counter_base : counter_base + 2]``. Allocates nothing and never synchronises.
    """
    checks.check_copy_args(
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        num_real_reqs=num_real_reqs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        counters=counters,
        counter_base=counter_base,
    )
    launch_copy(
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        num_real_reqs=num_real_reqs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        counters=counters,
        counter_base=counter_base,
    )
