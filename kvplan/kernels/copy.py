"""Miss-plan copy: host rows -> device rows, for swap-in's own copy and for plan replay.

The copy is bound by the host link, so it is spread over the whole GPU: a 2-D grid of (chunk, batch row) programs,
each walking its row's plan entries ``m < miss_count[row]`` in strides of the whole chunk count, copying a tile of
rows at a time as the widest integer words that divide the item size. Row pitches are compile-time constants, so the
compiler knows each row's alignment and issues 16-byte loads where the pitch allows. The loop bound is read on the
device, so the launch never synchronises and can be captured in a CUDA graph. Every row index is checked against its
tensor: a broken plan skips the entry instead of touching memory outside ``host_cache`` / ``device_buffer``.

How much is in flight matters on a large host cache: random rows read zero-copy over the link thrash the host-side
address translation when too many are outstanding at once, so the grid is sized per SM (``LaunchConfig``) rather
than per row.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels._launch import LaunchCache, Recorder, as_words, device_guard, next_pow2, num_sms, row_word_dtype
from kvplan.plan import MissPlan
from kvplan.validate.arguments import check_copy


@attrs.frozen
class CopyLaunch:
    """Launch shape of the plan copy: rows per tile, warps per program, programs per SM (the grid is capped there)."""

    rows_per_program: int = 16
    programs_per_sm: int = 8
    num_warps: int = 4


# Defaults; scripts/bench_swap_in.py --sweep measures the alternatives on the H200.
COPY_LAUNCH = CopyLaunch()


@triton.jit
def copy_plan_rows(
    host_ptr,
    dev_ptr,
    src_row,
    dst_row,
    start,
    stop,
    step,
    n_host,
    n_dev,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Copy plan entries ``m < stop`` in ``[t, t + ROWS)`` for ``t = start, start + step, ...`` of one plan row
    (``src_row``/``dst_row`` point at it): host row ``src_row[m]`` -> device row ``dst_row[m]``, each index checked.
    Returns how many rows were copied."""
    lanes = tl.arange(0, ROWS)
    words = tl.arange(0, BLOCK_W)
    word_ok = words < WORDS
    copied = tl.zeros([ROWS], dtype=tl.int32)
    first = start
    while first < stop:  # (a while loop: the interpreter cannot take tensors as range() bounds)
        m = first + lanes
        in_plan = m < stop
        src = tl.load(src_row + m, mask=in_plan, other=-1)
        dst = tl.load(dst_row + m, mask=in_plan, other=-1).to(tl.int64)
        ok = in_plan & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
        tile_ok = ok[:, None] & word_ok[None, :]
        values = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
        tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=tile_ok)
        copied += ok.to(tl.int32)
        first += step
    return tl.sum(copied, axis=0)


@triton.jit
def add_copy_counters(counters_ptr, counter_base, rows, row_bytes):
    """Add (rows, bytes) at ``counters[counter_base : counter_base + 2]`` (nothing for zero rows)."""
    if rows > 0:
        n = rows.to(tl.int64)
        tl.atomic_add(counters_ptr + counter_base, n)
        tl.atomic_add(counters_ptr + counter_base + 1, n * row_bytes)


@triton.jit(do_not_specialize=["batch", "capacity", "n_host", "n_dev", "counter_base", "row_bytes", "plan_stride"])
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
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    chunks = tl.num_programs(0)
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.load(num_real_ptr), batch)
    if row < n_real:
        count = tl.minimum(tl.load(miss_count_ptr + row), capacity)
        plan_row = row.to(tl.int64) * plan_stride
        copied = copy_plan_rows(
            host_ptr,
            dev_ptr,
            miss_src_ptr + plan_row,
            miss_dst_ptr + plan_row,
            chunk * ROWS,
            count,
            chunks * ROWS,
            n_host,
            n_dev,
            HOST_STRIDE,
            DEV_STRIDE,
            WORDS,
            BLOCK_W,
            ROWS,
        )
        if HAS_COUNTERS:
            add_copy_counters(counters_ptr, counter_base, copied, row_bytes)


def launch_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int, recorder: Recorder, batch: int | None = None,
    launch: CopyLaunch | None = None,
) -> None:  # fmt: skip
    """Launch the copy on already validated arguments (the first ``batch`` plan rows; default: all of them)."""
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    batch = miss_count.shape[0] if batch is None else batch
    launch = launch or COPY_LAUNCH
    capacity = miss_src.shape[1]
    if batch == 0 or capacity == 0 or host_cache.shape[1] == 0:
        return
    word = row_word_dtype(host_cache, device_buffer)
    host_words = as_words(host_cache, word)
    dev_words = as_words(device_buffer, word)
    words = host_words.shape[1]
    device = device_buffer.device
    rows = min(launch.rows_per_program, next_pow2(capacity))
    chunks = min(triton.cdiv(capacity, rows), max(1, triton.cdiv(launch.programs_per_sm * num_sms(device), batch)))
    dummy = miss_count
    with device_guard(device):
        recorder.launch(
            _copy_rows_kernel,
            (chunks, batch),
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
            HAS_NUM_REAL=num_real_reqs is not None,
            HAS_COUNTERS=counters is not None,
            num_warps=launch.num_warps,
        )


_LAUNCHES = LaunchCache()


def copy_planned(
    plan: MissPlan,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    num_real_reqs: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Replay a miss plan: copy host row ``plan.src[r, m]`` to device row ``plan.dst[r, m]`` for real rows ``r`` and
    ``m < plan.count[r]`` (docs/kernels.md §4). Layers sharing the anchor's top-k call this with their own caches.

    Parameters
    ----------
    plan : MissPlan
        Read. ``src`` int64 / ``dst`` int32 ``[batch, columns]`` (one row stride), ``count`` int32 ``[>= batch]``: what
        a swap-in wrote this step.
    host_cache : Tensor
        Read. ``[host_rows, item]``, pinned host memory (or on the device), any dtype.
    device_buffer : Tensor
        Written (rows ``plan.dst``). ``[device_rows, item]``, ``host_cache``'s dtype, on the device.
    num_real_reqs : Tensor, optional
        Read on the device. ``[1]`` int32: plan rows from it on are CUDA-graph padding (``None``: all are real).
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: adds the rows and bytes copied (``replayed_*``).

    Allocates nothing and never synchronises (CUDA-graph capturable).
    """
    _copy_planned(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters)


def _copy_planned(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int = REPLAY_COPY_BASE, launch: CopyLaunch | None = None,
) -> None:  # fmt: skip
    """``copy_planned`` with the private knobs: the counters it adds to, the launch shape (benchmarks)."""
    values = (*plan_tensors(plan), host_cache, device_buffer, num_real_reqs, counters, counter_base, launch)
    key = _LAUNCHES.key(values)
    if _LAUNCHES.replay(key, device_buffer):
        return
    check_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, counter_base=counter_base
    )
    recorder = Recorder()
    launch_copy(
        plan,
        host_cache,
        device_buffer,
        num_real_reqs=num_real_reqs,
        counters=counters,
        counter_base=counter_base,
        recorder=recorder,
        launch=launch,
    )
    _LAUNCHES.remember(key, recorder)


def plan_tensors(plan: object) -> tuple:
    """``(src, dst, count)`` of a ``MissPlan`` for a layout key (anything else keys as itself and is refused by the
    checks)."""
    return (plan.src, plan.dst, plan.count) if isinstance(plan, MissPlan) else (plan, None, None)
