"""The plan copy's entry kernels, one ``@triton.jit`` kernel per job (what each job is: ``kvplan.kernels.plan_copy``),
over the helpers of ``kvplan.kernels.plan_copy.helpers``. ``kvplan.kernels.plan_copy.launch`` picks the jobs, their
grids and launch shapes, and binds every argument by name. Names: the kernel glossary, ``kvplan/kernels/glossary.py``.

Every kernel's grid is ``(G,)`` (``launch._copy_grid``): programs walk the work items ``(q, b)``, ``q``-major.
Parameters come in the same groups, in the same order, in every kernel; a kernel takes only those it reads:

- pointers:
  ``host_ptr`` ``[n_host, WORDS]`` words, row pitch ``HOST_STRIDE``: host_cache (pinned host memory, read zero-copy);
  ``dev_ptr`` ``[n_dev, WORDS]`` words, row pitch ``DEV_STRIDE``: device_buffer;
  ``host_v_ptr`` / ``dev_v_ptr``: ``None``, or the V rows beside the K rows (same shapes and row pitches): each copy
  moves both;
  ``src_ptr`` / ``dst_ptr`` ``[batch, columns]`` int64 host rows / int32 device rows, row stride ``plan_stride``: the
  plan, where the record's entries point (each row sorted by host row above small batches, for speed only);
  ``walk_src_ptr`` / ``walk_dst_ptr``: the entries in the order the copy walks them, row strides ``walk_strides``:
  ``src_ptr`` and ``dst_ptr``, or (the swap-in's copy of a single-step plan) the same rows in host-row order, from its
  workspace;
  ``count_ptr`` ``[>= batch]`` int32: copies per plan row (clamped to ``[0, columns]``);
  ``num_real_ptr`` ``[1]`` int32: plan rows from it on are padding (read when ``HAS_NUM_REAL``);
  ``counters_ptr`` ``[NUM_COUNTERS]`` int64: (rows, bytes) added at ``counter_base`` (when ``HAS_COUNTERS``);
  ``dispatch_ptr`` ``[2]`` int32, zero before the launch: the work counter, items handed out and programs done (left
  zero, except by the fused copy, whose words the swap-in's resolve zeroes before each call);
  ``ws_ptr`` ``[batch, >= ROW_WORDS + columns]`` int32 words, row stride ``ws_stride``: the swap-in's workspace (its
  record of shared host rows, its padding marks, its span words), or a stand-in of one word (stride 0).
- strides (rows, in elements): ``plan_stride``, ``walk_strides`` (src, dst), ``ws_stride``.
- sizes: ``batch`` plan rows, ``columns`` their entries; ``n_host`` / ``n_dev`` KV rows; ``counter_base`` and
  ``row_bytes`` (what one copy moves, K and V rows); ``record_at``: the word of each workspace row where the walked
  entries' records start; the fused copy's ``readers`` (programs below it read the host when few entries share: the
  ordered copy's grid), ``span_at`` (the words where the sort left the span of each row's host rows),
  ``dynamic_span`` / ``dynamic_entries`` (the host rows a plan must span and the entries it must have to take items
  from the work counter: ``DISPATCH`` 2); ``format_word``: the fused copy writes it to row 0's format word (-1: not).
- modes: ``marks`` 1: ``ws_ptr``'s rows are the swap-in's workspace, whose row word ``SHARED`` marks its padding rows
  (copied never); ``ready_at``: the word of each of those rows where the on-chip resolve publishes the row.
- compile-time: ``HOST_STRIDE``, ``DEV_STRIDE``, ``WORDS``, ``BLOCK_W`` (next power of two ``>= WORDS``), ``ROWS``
  (copies per work item at most); ``DISPATCH`` 0: static items, 1: the work counter, 2: the counter when the plan is
  wide and shares few host rows; ``HAS_NUM_REAL``, ``HAS_COUNTERS``; ``PDL``: launched to start early (the swap-in's
  copies): wait for the launch before any access.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvplan.kernels.plan_copy.helpers import (
    _WIDE,
    _add_copy_counters,
    _copy_host_reads,
    _plan_summary,
    _real_rows,
    _walk,
    _walk_published_rows,
)
from kvplan.workspace import DONE, FORMAT

_DONE = tl.constexpr(DONE)
_FORMAT = tl.constexpr(FORMAT)

# Runtime ints never specialised (a value of 1 or a multiple of 16 would compile another kernel)
_RUNTIME_INTS = ["walk_strides", "ws_stride", "batch", "columns", "n_host", "n_dev", "counter_base", "row_bytes",
                 "marks"]  # fmt: skip
_RECORD_INTS = [*_RUNTIME_INTS, "record_at"]
_PLAN_INTS = [*_RECORD_INTS, "plan_stride"]
_FUSED_INTS = [*_PLAN_INTS, "readers", "span_at", "dynamic_span", "dynamic_entries", "format_word"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _copy_entries_kernel(
    # pointers: KV rows (K, then V or None), the walked entries, counts, num_real_reqs, counters, work counter, marks
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr, counters_ptr,
    dispatch_ptr, ws_ptr,
    # strides
    walk_strides, ws_stride,
    # sizes
    batch, columns, n_host, n_dev, counter_base, row_bytes,
    # modes
    marks,
    # compile-time: row pitches and widths, rows per item; modes
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr, DISPATCH: tl.constexpr, HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Every entry, read from the host (a copy without the swap-in's record of shared host rows: the flat and the
    ordered copy). ``DISPATCH`` 0 or 1."""
    if PDL:
        gdc_wait()
    _copy_host_reads(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr,
                     counters_ptr, dispatch_ptr, ws_ptr, walk_strides, ws_stride, batch, columns, n_host, n_dev,
                     counter_base, row_bytes, None, marks, False, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS,
                     DISPATCH, HAS_NUM_REAL, HAS_COUNTERS)  # fmt: skip


@triton.jit(do_not_specialize=[*_RUNTIME_INTS, "ready_at"])
def _copy_published_rows_kernel(
    # pointers: KV rows (K, then V or None), the walked entries, counts, num_real_reqs, counters, the swap-in's
    # workspace (padding marks, ready words)
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr, counters_ptr,
    ws_ptr,
    # strides
    walk_strides, ws_stride,
    # sizes
    batch, columns, n_host, n_dev, counter_base, row_bytes,
    # modes
    marks, ready_at,
    # compile-time: row pitches and widths, rows per tile; modes
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr, HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The flat copy after the on-chip resolve: every entry read from the host, each plan row as soon as its block has
    published it (its ready word turns 1: ``_walk_published_rows``), not when the whole resolve is done. Launched to
    start early (``PDL``), it still ends only after the resolve does (a final ``gdc_wait``): what follows it in the
    stream follows the resolve too."""
    n_real = _real_rows(num_real_ptr, batch, HAS_NUM_REAL)
    copied = _walk_published_rows(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr,
                                  ws_ptr, walk_strides, ws_stride, n_real, columns, n_host, n_dev, marks, ready_at,
                                  HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS)  # fmt: skip
    if HAS_COUNTERS:
        _add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)
    if PDL:
        gdc_wait()


@triton.jit(do_not_specialize=_RECORD_INTS)
def _copy_host_reads_kernel(
    # pointers: KV rows (K, then V or None), the walked entries, counts, num_real_reqs, counters, work counter, record
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr, counters_ptr,
    dispatch_ptr, ws_ptr,
    # strides
    walk_strides, ws_stride,
    # sizes
    batch, columns, n_host, n_dev, counter_base, row_bytes, record_at,
    # modes
    marks,
    # compile-time: row pitches and widths, rows per item; modes
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr, DISPATCH: tl.constexpr, HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """A replay's first launch with the record of shared host rows: the entries that read the host (every entry when
    few share one; when many do, items of ``_WIDE`` tiles, copying only the tiles that hold a reader). The entries
    that share follow in ``_copy_shared_entries_kernel`` (the launch boundary orders them). ``DISPATCH`` 0 or 1."""
    if PDL:
        gdc_wait()
    _copy_host_reads(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr,
                     counters_ptr, dispatch_ptr, ws_ptr, walk_strides, ws_stride, batch, columns, n_host, n_dev,
                     counter_base, row_bytes, record_at, marks, True, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS,
                     DISPATCH, HAS_NUM_REAL, HAS_COUNTERS)  # fmt: skip


@triton.jit(do_not_specialize=_PLAN_INTS)
def _copy_shared_entries_kernel(
    # pointers: KV rows (K, then V or None), the plan, the walked entries, counts, num_real_reqs, counters, record
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, src_ptr, dst_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr,
    counters_ptr, ws_ptr,
    # strides
    plan_stride, walk_strides, ws_stride,
    # sizes
    batch, columns, n_host, n_dev, counter_base, row_bytes, record_at,
    # modes
    marks,
    # compile-time: row pitches and widths, rows per item; modes
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr, HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A replay's second launch with the record of shared host rows: the entries that share another entry's host row,
    each copied from the device row that entry read it to (``_copy_shared_tile``), when many entries share (else the
    first launch read every entry: nothing to do). Static items."""
    if PDL:
        gdc_wait()
    n_real, longest, many_shared, _ = _plan_summary(
        count_ptr, num_real_ptr, ws_ptr, ws_stride, batch, columns, 0, 0, 0, marks, True, 0, HAS_NUM_REAL
    )  # fmt: skip
    slices = tl.cdiv(longest, ROWS).to(tl.int64)
    items = tl.where(many_shared, slices * n_real, 0)  # no record to follow: nothing to do
    copied = _walk(
        host_ptr=host_ptr, dev_ptr=dev_ptr, host_v_ptr=host_v_ptr, dev_v_ptr=dev_v_ptr, walk_src=walk_src_ptr,
        walk_dst=walk_dst_ptr, src_ptr=src_ptr, dst_ptr=dst_ptr, count_ptr=count_ptr, dispatch_ptr=None,
        ws_ptr=ws_ptr, walk_strides=walk_strides, plan_stride=plan_stride, ws_stride=ws_stride,
        first=tl.program_id(0), stride=tl.num_programs(0), items=items, slices=slices, n_real=n_real, columns=columns,
        n_host=n_host, n_dev=n_dev, record_at=record_at, marks=marks, from_counter=False, wide=False, READS=False,
        HOST_STRIDE=HOST_STRIDE, DEV_STRIDE=DEV_STRIDE, WORDS=WORDS, BLOCK_W=BLOCK_W, ROWS=ROWS,
    )[0]  # fmt: skip
    if HAS_COUNTERS:
        _add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)


@triton.jit(do_not_specialize=_FUSED_INTS)
def _copy_reads_then_shared_kernel(
    # pointers: KV rows (K, then V or None), the plan, the walked entries, counts, num_real_reqs, counters, work
    # counter, the swap-in's workspace
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, src_ptr, dst_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr,
    counters_ptr, dispatch_ptr, ws_ptr,
    # strides
    plan_stride, walk_strides, ws_stride,
    # sizes
    batch, columns, n_host, n_dev, counter_base, row_bytes, record_at, readers, span_at, dynamic_span,
    dynamic_entries, format_word,
    # modes
    marks,
    # compile-time: row pitches and widths, rows per item; modes
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr, DISPATCH: tl.constexpr, HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The swap-in's own copy with its record of shared host rows: the host reads and then the shared entries, in one
    launch (``DISPATCH`` 2, or 1). When many entries share host rows, every program takes host reads from the work
    counter, counts the items it finished (a release after its copies), waits until all of them are counted (an
    acquire), then takes the shared entries' items in turn: a program waits only for items that programs already
    running have taken, so the wait ends whatever order the programs start in. Otherwise the first ``readers``
    programs (the ordered copy's grid, one per SM) read every entry, from the work counter when the plan is wide
    (``DISPATCH`` 2), and the others return at once: a plan that shares nothing pays no second launch. The work
    counter's words are left as they end (the swap-in's resolve zeroes them before each call's copy).
    ``format_word`` >= 0 (after the on-chip resolve, which claimed the host rows itself): program 0 writes it to row 0's
    format word, which every block of the resolve read (``kvplan.workspace``)."""
    if PDL:
        gdc_wait()
    if (tl.program_id(0) == 0) & (format_word >= 0):
        tl.store(ws_ptr + _FORMAT, format_word)
    n_real, longest, many_shared, dynamic = _plan_summary(
        count_ptr, num_real_ptr, ws_ptr, ws_stride, batch, columns, span_at, dynamic_span, dynamic_entries, marks,
        True, DISPATCH, HAS_NUM_REAL,
    )  # fmt: skip
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    copied = tl.zeros([ROWS], dtype=tl.int32)
    if many_shared:
        slices = tl.cdiv(longest, ROWS * _WIDE).to(tl.int64)
        items = slices * n_real
        done_ptr = ws_ptr + tl.minimum(batch - 1, 1) * ws_stride + _DONE  # (off the counter's line)
        reads, done = _walk(
            host_ptr=host_ptr, dev_ptr=dev_ptr, host_v_ptr=host_v_ptr, dev_v_ptr=dev_v_ptr, walk_src=walk_src_ptr,
            walk_dst=walk_dst_ptr, src_ptr=src_ptr, dst_ptr=dst_ptr, count_ptr=count_ptr, dispatch_ptr=dispatch_ptr,
            ws_ptr=ws_ptr, walk_strides=walk_strides, plan_stride=plan_stride, ws_stride=ws_stride, first=pid,
            stride=grid, items=items, slices=slices, n_real=n_real, columns=columns, n_host=n_host, n_dev=n_dev,
            record_at=record_at, marks=marks, from_counter=True, wide=True, READS=True, HOST_STRIDE=HOST_STRIDE,
            DEV_STRIDE=DEV_STRIDE, WORDS=WORDS, BLOCK_W=BLOCK_W, ROWS=ROWS,
        )  # fmt: skip
        copied += reads
        if done > 0:
            tl.debug_barrier()  # every thread's copies, then the release that publishes them
            tl.atomic_add(done_ptr, done.to(tl.int32), sem="release")
        # every host read done: a plain poll of the count, then an acquire of it
        while tl.load(done_ptr, volatile=True) < items:
            pass
        tl.atomic_add(done_ptr, 0, sem="acquire")
        tl.debug_barrier()  # threads that did not acquire themselves read the device rows after this
        slices = tl.cdiv(longest, ROWS).to(tl.int64)
        copied += _walk(
            host_ptr=host_ptr, dev_ptr=dev_ptr, host_v_ptr=host_v_ptr, dev_v_ptr=dev_v_ptr, walk_src=walk_src_ptr,
            walk_dst=walk_dst_ptr, src_ptr=src_ptr, dst_ptr=dst_ptr, count_ptr=count_ptr, dispatch_ptr=dispatch_ptr,
            ws_ptr=ws_ptr, walk_strides=walk_strides, plan_stride=plan_stride, ws_stride=ws_stride, first=pid,
            stride=grid, items=slices * n_real, slices=slices, n_real=n_real, columns=columns, n_host=n_host,
            n_dev=n_dev, record_at=record_at, marks=marks, from_counter=False, wide=True, READS=False,
            HOST_STRIDE=HOST_STRIDE, DEV_STRIDE=DEV_STRIDE, WORDS=WORDS, BLOCK_W=BLOCK_W, ROWS=ROWS,
        )[0]  # fmt: skip
    elif pid < readers:
        slices = tl.cdiv(longest, ROWS).to(tl.int64)
        copied += _walk(
            host_ptr=host_ptr, dev_ptr=dev_ptr, host_v_ptr=host_v_ptr, dev_v_ptr=dev_v_ptr, walk_src=walk_src_ptr,
            walk_dst=walk_dst_ptr, src_ptr=src_ptr, dst_ptr=dst_ptr, count_ptr=count_ptr, dispatch_ptr=dispatch_ptr,
            ws_ptr=ws_ptr, walk_strides=walk_strides, plan_stride=plan_stride, ws_stride=ws_stride, first=pid,
            stride=tl.minimum(grid, readers), items=slices * n_real, slices=slices, n_real=n_real, columns=columns,
            n_host=n_host, n_dev=n_dev, record_at=record_at, marks=marks, from_counter=dynamic, wide=False,
            READS=True, HOST_STRIDE=HOST_STRIDE, DEV_STRIDE=DEV_STRIDE, WORDS=WORDS, BLOCK_W=BLOCK_W, ROWS=ROWS,
        )[0]  # fmt: skip
    if HAS_COUNTERS:
        _add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)
