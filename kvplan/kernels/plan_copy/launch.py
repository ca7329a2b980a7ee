"""How the plan copy is launched, all in one place: its launch shapes (``CopyLaunch``: ``COPY_LAUNCH``,
``FLAT_COPY_LAUNCH``, ``SHARED_COPY_LAUNCH``), the work counter's thresholds, its grid (``_copy_grid``), which entry
kernel each job runs on which grid (``launch_copy``), and every kernel argument, bound by name.

The grids, the work counter and their thresholds: docs/benchmarks.md, "Why each threshold is what it is". How the copy
works: ``kvplan.kernels.plan_copy``; the kernels: ``kvplan.kernels.plan_copy.kernels``.
"""

from __future__ import annotations

import attrs
import torch
import triton

from kvplan.kernels.plan_copy.kernels import (
    _copy_entries_kernel,
    _copy_host_reads_kernel,
    _copy_published_rows_kernel,
    _copy_reads_then_shared_kernel,
    _copy_shared_entries_kernel,
)
from kvplan.plan import MissPlan
from kvplan.runtime.device import as_words, device_guard, num_sms, row_word_dtype
from kvplan.runtime.launch_replay import Recorder
from kvplan.workspace import DISPATCH, ROW_WORDS, next_pow2


@attrs.frozen
class CopyLaunch:
    """Launch shape of the plan copy: rows per work item, programs per SM, warps per program."""

    rows_per_program: int = 4
    programs_per_sm: int = 1
    num_warps: int = 1


# One warp, 4 rows an item, one program per SM: more put more translation regions in flight (docs/benchmarks.md,
# "Copy grid").
COPY_LAUNCH = CopyLaunch()
# Small batches: every row of the plan in flight (a program per item), the plan in miss order.
FLAT_COPY_LAUNCH = CopyLaunch(rows_per_program=4, programs_per_sm=16, num_warps=1)
# The grid of a copy with the swap-in's record of shared rows: when rows are shared all of it takes part (few entries
# read the host, most are skipped or copied on the device); otherwise only the ordered copy's share of it.
SHARED_COPY_LAUNCH = CopyLaunch(rows_per_program=4, programs_per_sm=8, num_warps=1)
# The swap-in's own copy takes items from a work counter when its plan's host rows span more than this (and none is
# shared): on a large host cache the counter keeps the programs' rows closer together (docs/benchmarks.md, "Work
# counter").
DYNAMIC_SPAN_BYTES = 1 << 30
# Plan entries from which the swap-in's copy may take the work counter (docs/benchmarks.md, "Work counter"). A launch
# argument, as the span is, not a compiled constant.
DYNAMIC_MIN_ENTRIES = 2048


def _copy_grid(shape: CopyLaunch, sms: int, batch: int, columns: int) -> tuple[int]:
    """Axis 0: programs, each walking work items (slice ``q``, plan row ``b``), ``q``-major: ``programs_per_sm`` per
    SM, and no more than the work items can use."""
    return (max(1, min(shape.programs_per_sm * sms, batch * triton.cdiv(columns, shape.rows_per_program))),)


def launch_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    host_cache_v: torch.Tensor | None = None, device_buffer_v: torch.Tensor | None = None,
    num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int, recorder: Recorder, batch: int | None = None,
    dispatch: torch.Tensor | None = None, launch: CopyLaunch | None = None, workspace: torch.Tensor | None = None,
    choose_dispatch: bool = False, span_at: int = 0, walk: tuple | None = None, early: bool = False,
    marked: torch.Tensor | None = None, ready_at: int | None = None, format_word: int | None = None,
) -> None:  # fmt: skip
    """Launch the copy on already validated arguments: the first ``batch`` plan rows (default: all of them), items
    handed out by ``dispatch`` (two int32 words, zero before the launch and left zero after it) when given. With
    ``workspace`` (int32 words ``[>= batch, >= ROW_WORDS + columns]``: a swap-in's record of shared host rows) two
    launches: entries that read the host, then entries that share one's host row; ``choose_dispatch`` (the swap-in's
    own copy, whose resolve zeroed the record's row words) one launch of both (``_copy_reads_then_shared_kernel``),
    which takes the work counter when the plan is wide (``span_at``: the int32 word of each workspace row where the
    sort left the span of the row's host rows, ``kvplan.workspace``; ``walk``: ``(src, dst, record_at)``, the same
    entries in another order, whose records sit at word ``record_at`` of each workspace row, for the copy to walk: the
    swap-in's copy of a single-step plan in host-row order, the plan itself staying in miss order).
    ``early``: the launches follow others of the call and may start early (``dependent_launch``). ``marked``: the
    swap-in's workspace as int32 words, read for the rows it marked padding when ``workspace`` is not given (with
    ``workspace`` its marks are read): those rows copy nothing, whatever their plan rows hold. ``host_cache_v`` /
    ``device_buffer_v`` (checked: the K tensors' shapes, dtypes and row strides): each copy also moves its V row, in
    the same pass (the counters count the entry once, the bytes of both rows). ``ready_at`` (with ``marked``, no
    ``workspace``, no ``dispatch``: the flat copy after the on-chip resolve): each plan row is copied once its ready
    word, int32 word ``ready_at`` of its ``marked`` row, says the resolve published it, not after the whole resolve.
    ``format_word`` (with ``choose_dispatch``: the swap-in's own copy after the on-chip resolve claimed host rows):
    written to row 0's format word once the resolve is done, which every block of it read (``kvplan.workspace``)."""
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    walk_src, walk_dst, record_at = (miss_src, miss_dst, ROW_WORDS) if walk is None else walk
    batch = miss_src.shape[0] if batch is None else batch
    launch = launch or COPY_LAUNCH
    columns = miss_src.shape[1]
    if format_word is not None and not (choose_dispatch and workspace is not None):
        raise ValueError("launch_copy: format_word needs the swap-in's workspace and choose_dispatch")
    if ready_at is not None and (marked is None or workspace is not None or dispatch is not None):
        raise ValueError("launch_copy: ready_at needs marked (the rows' ready words), no workspace and no dispatch")
    if batch == 0 or columns == 0 or host_cache.shape[1] == 0:
        return
    values = host_cache_v is not None
    kv = (host_cache, device_buffer, host_cache_v, device_buffer_v) if values else (host_cache, device_buffer)
    word = row_word_dtype(*kv)
    host_words = as_words(host_cache, word)
    dev_words = as_words(device_buffer, word)
    words = host_words.shape[1]
    item_bytes = host_cache.shape[1] * host_cache.element_size()
    rows_words = workspace if workspace is not None else marked  # the row words that mark padding rows, if any
    if dispatch is not None:
        mode = 1
    elif choose_dispatch and workspace is not None:
        mode, dispatch = 2, workspace[0, DISPATCH : DISPATCH + 2]
    else:
        mode = 0
    # every job's arguments, in the kernels' groups (kvplan/kernels/plan_copy/kernels.py); unread stand-ins are valid
    # tensors
    every = dict(
        host_ptr=host_words, dev_ptr=dev_words,
        host_v_ptr=as_words(host_cache_v, word) if values else None,
        dev_v_ptr=as_words(device_buffer_v, word) if values else None,
        walk_src_ptr=walk_src, walk_dst_ptr=walk_dst, count_ptr=miss_count,
        num_real_ptr=miss_count if num_real_reqs is None else num_real_reqs,
        counters_ptr=miss_count if counters is None else counters,
        ws_ptr=miss_count if rows_words is None else rows_words,
        walk_strides=(walk_src.stride(0), walk_dst.stride(0)),
        ws_stride=0 if rows_words is None else rows_words.stride(0),
        batch=batch, columns=columns, n_host=host_words.shape[0], n_dev=dev_words.shape[0], counter_base=counter_base,
        row_bytes=item_bytes * (2 if values else 1),  # what one copy moves (K and V rows)
        marks=0 if rows_words is None else 1,
        HOST_STRIDE=host_words.stride(0), DEV_STRIDE=dev_words.stride(0), WORDS=words, BLOCK_W=next_pow2(words),
        HAS_NUM_REAL=num_real_reqs is not None, HAS_COUNTERS=counters is not None, PDL=early, launch_pdl=early,
    )  # fmt: skip
    counter = dict(dispatch_ptr=miss_count if dispatch is None else dispatch, DISPATCH=mode)
    plan_rows = dict(src_ptr=miss_src, dst_ptr=miss_dst, plan_stride=miss_src.stride(0), record_at=record_at)
    sms = num_sms(device_buffer.device)
    grid = _copy_grid(launch, sms, batch, columns)
    # the jobs: (entry kernel, grid, launch shape, the job's own arguments)
    if ready_at is not None:  # the flat copy, each row as the on-chip resolve publishes it
        jobs = [(_copy_published_rows_kernel, grid, launch, dict(ready_at=ready_at))]
    elif workspace is None:  # every entry from the host: the ordered copy (or the flat one, FLAT_COPY_LAUNCH)
        jobs = [(_copy_entries_kernel, grid, launch, counter)]
    elif choose_dispatch:  # both kinds of entries in one launch: the wider grid, of which the ordered copy's reads
        shared_grid = _copy_grid(SHARED_COPY_LAUNCH, sms, batch, columns)
        span = DYNAMIC_SPAN_BYTES // max(item_bytes, 1)  # in host rows
        written = -1 if format_word is None else format_word  # (-1: the fused copy writes no format word)
        fused = dict(plan_rows, **counter, readers=grid[0], span_at=span_at, dynamic_span=span,
                     dynamic_entries=DYNAMIC_MIN_ENTRIES, format_word=written)  # fmt: skip
        jobs = [(_copy_reads_then_shared_kernel, (max(grid[0], shared_grid[0]),), launch, fused)]
    else:  # entries that read the host (the ordered copy's grid), then entries that share their host row
        shared_grid = _copy_grid(SHARED_COPY_LAUNCH, sms, batch, columns)
        jobs = [(_copy_host_reads_kernel, grid, launch, dict(counter, record_at=record_at)),
                (_copy_shared_entries_kernel, shared_grid, SHARED_COPY_LAUNCH, plan_rows)]  # fmt: skip
    with device_guard(device_buffer.device):
        for kernel, job_grid, shape, own in jobs:
            recorder.launch(kernel, job_grid, **every, **own, ROWS=shape.rows_per_program, num_warps=shape.num_warps)
