"""Miss-plan copy: host rows -> device rows, for swap-in's own copy and for plan replay (docs/kernels.md §4).

The copy is bound by the host link, and on a large host cache by the GPU's address translation of host memory:
random 576-byte rows read zero-copy from a 4.6 GB pinned cache reach about a third of the link, because every row in
flight touches its own translation region. What lifts it is locality of the rows in flight, so this copy reads them
in host-address order with a bounded number in flight:

- each plan row is sorted by host row (the swap-in writes it so; the order of a plan row's entries is free), and
  the copy walks all rows together by quantile: work item ``(q, b)`` is the ``q``-th of ``Q`` equal slices of row
  ``b``, items in ``q``-major order. Rows of random host rows sorted this way advance through the host cache
  together, so the rows in flight at any moment lie in one narrow window of addresses (a merge of the sorted rows,
  without merging them);
- one warp per program, a few rows per item, one program per SM: few rows in flight, each item one tile;
- program ``p`` takes items ``p, p + G, ...``. A work counter (``dispatch``, a benchmark knob) hands them out in
  strict order instead: it keeps the programs closer together on a large host cache, but every item is an atomic on
  one address, which serialises when the rows come from L2.

Measured on the H200 (``kvplan bench swap_in``, 50,048 rows of 576 B, 64 requests): from a 4.6 GB host cache with
random rows per request, 0.66 of the pinned copy ceiling (0.71 with the counter, 0.36 in the plans' miss order); from
a 512 MB window 0.90 (0.89); with every request on the same rows (served partly from L2) 0.76, against 0.27 with the
counter (docs/benchmarks.md).

Rows are moved as the widest integer words that divide the item size; row pitches are compile-time constants so the
compiler knows each row's alignment. The loop bounds are read on the device, so a launch never synchronises and can be
captured in a CUDA graph. Every row index is checked against its tensor, and counts are clamped to the plan's
columns: a broken plan skips the entry instead of touching memory outside ``host_cache`` / ``device_buffer``.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels.launch_cache import (
    LaunchCache,
    Recorder,
    as_words,
    device_guard,
    next_pow2,
    num_sms,
    row_word_dtype,
)
from kvplan.plan import MissPlan
from kvplan.validate.arguments import check_copy


@attrs.frozen
class CopyLaunch:
    """Launch shape of the plan copy: rows per work item, programs per SM, warps per program."""

    rows_per_program: int = 4
    programs_per_sm: int = 1
    num_warps: int = 1


# Defaults measured on the H200 (one warp, 4 rows an item, one program per SM: 0.62 of the link ordered with a counter
# from 4.6 GB; more programs or warps per SM put more translation regions in flight and lose).
COPY_LAUNCH = CopyLaunch()

_COUNT_BLOCK = tl.constexpr(256)  # batch rows whose counts one step of the max-count loop reads


@triton.jit
def copy_plan_rows(
    host_ptr,  # [n_host, WORDS] words (row pitch HOST_STRIDE): host_cache
    dev_ptr,  # [n_dev, WORDS] words (row pitch DEV_STRIDE): device_buffer
    src_row,  # [>= stop] int64: host rows of one list of copies
    dst_row,  # [>= stop] int32: device rows of the same copies
    start,
    stop,
    step,
    n_host,
    n_dev,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,  # next power of two >= WORDS
    ROWS: tl.constexpr,
):
    """Copy entries ``m < stop`` in ``[t, t + ROWS)`` for ``t = start, start + step, ...`` of one list of copies:
    host row ``src_row[m]`` -> device row ``dst_row[m]``, each index checked. Returns how many rows were copied."""
    lanes = tl.arange(0, ROWS)
    copied = tl.zeros([ROWS], dtype=tl.int32)
    first = start
    while first < stop:  # (a while loop: the interpreter cannot take tensors as range() bounds)
        m = first + lanes
        copied += _copy_tile(host_ptr, dev_ptr, src_row, dst_row, m, m < stop, n_host, n_dev, HOST_STRIDE,
                             DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
        first += step
    return tl.sum(copied, axis=0)


@triton.jit
def _copy_tile(host_ptr, dev_ptr, src_row, dst_row, m, in_list, n_host, n_dev, HOST_STRIDE: tl.constexpr,
               DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """One tile: the copies ``m`` (lanes where ``in_list``) moved; 1 per lane that copied."""
    words = tl.arange(0, BLOCK_W)
    src = tl.load(src_row + m, mask=in_list, other=-1)
    dst = tl.load(dst_row + m, mask=in_list, other=-1).to(tl.int64)
    ok = in_list & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
    tile_ok = ok[:, None] & (words < WORDS)[None, :]
    values = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
    tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=tile_ok)
    return ok.to(tl.int32)


@triton.jit
def add_copy_counters(counters_ptr, counter_base, rows, row_bytes):
    """Add (rows, bytes) at ``counters[counter_base : counter_base + 2]`` (nothing for zero rows)."""
    if rows > 0:
        n = rows.to(tl.int64)
        tl.atomic_add(counters_ptr + counter_base, n)
        tl.atomic_add(counters_ptr + counter_base + 1, n * row_bytes)


_RUNTIME_INTS = ["batch", "columns", "plan_stride", "n_host", "n_dev", "counter_base", "row_bytes"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _ordered_copy_kernel(
    host_ptr,  # [n_host, WORDS] words, row pitch HOST_STRIDE: host_cache (pinned host memory, read zero-copy)
    dev_ptr,  # [n_dev, WORDS] words, row pitch DEV_STRIDE: device_buffer
    src_ptr,  # [batch, columns] int64, row stride plan_stride: host rows, each row sorted ascending (for speed only)
    dst_ptr,  # [batch, columns] int32, row stride plan_stride: device rows
    count_ptr,  # [>= batch] int32: copies per plan row (clamped to [0, columns])
    num_real_ptr,  # [1] int32: plan rows from it on are padding (read when HAS_NUM_REAL)
    counters_ptr,  # [NUM_COUNTERS] int64: (rows, bytes) added at counter_base (when HAS_COUNTERS)
    dispatch_ptr,  # [2] int32, zero before the launch: items handed out, programs done (when DYNAMIC; left zero)
    batch,
    columns,
    plan_stride,
    n_host,
    n_dev,
    counter_base,
    row_bytes,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,  # next power of two >= WORDS
    ROWS: tl.constexpr,  # copies per work item at most
    DYNAMIC: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Grid ``(G,)``: ``G`` programs walk the work items ``(q, b)``, ``q``-major (see the module docstring)."""
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    # Q slices per row: enough that the longest row's slices hold at most ROWS copies
    rows = tl.arange(0, _COUNT_BLOCK)
    most = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    while tl.min(rows, axis=0) < n_real:  # (a while loop: the interpreter cannot take tensors as range() bounds)
        most = tl.maximum(most, tl.load(count_ptr + rows, mask=rows < n_real, other=0))
        rows += _COUNT_BLOCK
    longest = tl.minimum(tl.max(most, axis=0), columns)
    slices = tl.cdiv(longest, ROWS).to(tl.int64)
    items = slices * n_real
    copied = tl.zeros([ROWS], dtype=tl.int32)
    if DYNAMIC:
        item = tl.atomic_add(dispatch_ptr, 1).to(tl.int64)
    else:
        item = tl.program_id(0).to(tl.int64)
    while item < items:
        q = item // n_real
        b = item - q * n_real
        count = tl.minimum(tl.maximum(tl.load(count_ptr + b), 0), columns).to(tl.int64)
        lo = q * count // slices
        hi = (q + 1) * count // slices
        m = lo + tl.arange(0, ROWS)
        row = b * plan_stride
        copied += _copy_tile(host_ptr, dev_ptr, src_ptr + row, dst_ptr + row, m, m < hi, n_host, n_dev, HOST_STRIDE,
                             DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
        if DYNAMIC:
            item = tl.atomic_add(dispatch_ptr, 1).to(tl.int64)
        else:
            item += tl.num_programs(0)
    if HAS_COUNTERS:
        add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)
    if DYNAMIC:
        # the last program to finish (every other one has taken its last item) leaves the counter zero for the next
        # launch on it
        if tl.atomic_add(dispatch_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(dispatch_ptr, 0)
            tl.atomic_xchg(dispatch_ptr + 1, 0)


def launch_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int, recorder: Recorder, batch: int | None = None,
    dispatch: torch.Tensor | None = None, launch: CopyLaunch | None = None,
) -> None:  # fmt: skip
    """Launch the copy on already validated arguments: the first ``batch`` plan rows (default: all of them), items
    handed out by ``dispatch`` (two int32 words, zero before the launch and left zero after it) when given."""
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    batch = miss_src.shape[0] if batch is None else batch
    launch = launch or COPY_LAUNCH
    columns = miss_src.shape[1]
    if batch == 0 or columns == 0 or host_cache.shape[1] == 0:
        return
    word = row_word_dtype(host_cache, device_buffer)
    host_words = as_words(host_cache, word)
    dev_words = as_words(device_buffer, word)
    words = host_words.shape[1]
    device = device_buffer.device
    # no more programs than work items can use: a row of `columns` copies is at most that many items
    programs = min(launch.programs_per_sm * num_sms(device), batch * triton.cdiv(columns, launch.rows_per_program))
    with device_guard(device):
        # grid (G,): axis 0 programs, each walking work items (slice q, plan row b), q-major
        recorder.launch(
            _ordered_copy_kernel,
            (programs,),
            host_words,
            dev_words,
            miss_src,
            miss_dst,
            miss_count,
            miss_count if num_real_reqs is None else num_real_reqs,
            miss_count if counters is None else counters,
            miss_count if dispatch is None else dispatch,
            batch,
            columns,
            miss_src.stride(0),
            host_words.shape[0],
            dev_words.shape[0],
            counter_base,
            host_cache.shape[1] * host_cache.element_size(),
            HOST_STRIDE=host_words.stride(0),
            DEV_STRIDE=dev_words.stride(0),
            WORDS=words,
            BLOCK_W=next_pow2(words),
            ROWS=launch.rows_per_program,
            DYNAMIC=dispatch is not None,
            HAS_NUM_REAL=num_real_reqs is not None,
            HAS_COUNTERS=counters is not None,
            num_warps=launch.num_warps,
        )


LAUNCHES = LaunchCache()  # this module's recorded calls (the benchmarks and tests read its counts)


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
        a swap-in wrote this step. ``batch`` is the plan's rows; counts are clamped to ``[0, columns]``.
    host_cache : Tensor
        Read. ``[host_rows, item]``, pinned host memory (or on the device), any dtype.
    device_buffer : Tensor
        Written (rows ``plan.dst``). ``[device_rows, item]``, ``host_cache``'s dtype, on the device.
    num_real_reqs : Tensor, optional
        Read on the device. ``[1]`` int32: plan rows from it on are CUDA-graph padding (``None``: all are real).
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: adds the rows and bytes copied (``replayed_*``).

    Allocates nothing and never synchronises (CUDA-graph capturable). Rows are read in host-address order when each
    plan row is sorted by ``src``, as swap-ins above small batches write them (faster on large host caches).
    """
    run_copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters)


def run_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int = REPLAY_COPY_BASE, dispatch: torch.Tensor | None = None,
    launch: CopyLaunch | None = None,
) -> None:  # fmt: skip
    """:func:`copy_planned` with the package's knobs (the ops, the swap-in benchmark): the counters it adds to, a work
    counter (``dispatch``: two int32 words, zero, that no other launch uses at the same time; left zero), the launch
    shape."""
    launch = launch or COPY_LAUNCH  # keyed as launched (tests and benchmarks swap the default)
    values = (*plan_tensors(plan), host_cache, device_buffer, num_real_reqs, counters, counter_base, dispatch, launch)
    key = LAUNCHES.key(values)
    if LAUNCHES.relaunch(key, device_buffer):
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
        dispatch=dispatch,
        launch=launch,
    )
    LAUNCHES.remember(key, recorder)


def plan_tensors(plan: object) -> tuple:
    """``(src, dst, count)`` of a ``MissPlan`` for a layout key (anything else keys as itself and is refused by the
    checks)."""
    return (plan.src, plan.dst, plan.count) if isinstance(plan, MissPlan) else (plan, None, None)
