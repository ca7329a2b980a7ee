"""Miss-plan copy: host rows -> device rows, for swap-in's own copy and for plan replay (docs/kernels.md §4).

The copy is bound by the host link, and on a large host cache by the GPU's address translation of host memory:
random 576-byte rows read zero-copy from a 4.6 GB pinned cache reach about a third of the link, because every row in
flight touches its own translation region. What lifts it is locality of the rows in flight, so this copy reads them
in host-address order with a bounded number in flight:

- each plan row is sorted by host row (the swap-in writes a speculative plan so above small batches, whose entries'
  order is free; a single-step plan stays in miss order and the swap-in's own copy walks the host-row order the
  sort left in its workspace), and the copy walks all rows together by quantile: work item ``(q, b)`` is the
  ``q``-th of ``Q`` equal slices of row ``b``, items in ``q``-major order. Rows of random host rows sorted this way
  advance through the host cache together, so the rows in flight at any moment lie in one narrow window of addresses
  (a merge of the sorted rows, without merging them);
- one warp per program, a few rows per item, one program per SM: few rows in flight, each item one tile;
- program ``p`` takes items ``p, p + G, ...``; or, from a work counter, in strict order: that keeps the programs closer
  together on a large host cache, but every item is an atomic on one address, which serialises when the rows come from
  L2. The swap-in's own copy takes the counter when its plan spans more than ``DYNAMIC_SPAN_BYTES`` of host rows and
  shares none (decided on the device, from what the plan's sort recorded).

With the swap-in's workspace (``workspace``: the record of which entries share a host row, ``kvplan.kernels.hisparse``)
the copy reads from the host only the entries that read it (one per distinct host row) and copies every other entry
from the device row its host row went to, after those reads. A replay does it in two launches (the launch boundary
orders them); the swap-in's own copy in one: when many entries share, every program takes host reads from a work
counter, then all wait for the count of reads done (they wait only on reads that running programs took, so the wait
ends whatever order programs start in) and copy the shared entries; otherwise the ordered copy's programs copy every
entry and the rest return at once, so a plan that shares nothing pays no second launch. Small batches use a flat grid
instead, every row of the plan in flight (``FLAT_COPY_LAUNCH``).

The grids, the work counter and their thresholds: docs/benchmarks.md, "Why each threshold is what it is".

Rows are moved as the widest integer words that divide the item size; row pitches are compile-time constants so the
compiler knows each row's alignment. The loop bounds are read on the device, so a launch never synchronises and can be
captured in a CUDA graph. Every row index is checked against its tensor, counts are clamped to the plan's columns, and a
shared entry is copied from another entry's device row only when that entry holds the same host row and reads it from
the host in this copy (else from the host): a broken plan or workspace skips or re-reads an entry instead of touching
memory outside ``host_cache`` / ``device_buffer``.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvplan.counters import REPLAY_COPY_BASE
from kvplan.plan import MissPlan
from kvplan.runtime.device import as_words, device_guard, num_sms, row_word_dtype
from kvplan.runtime.launch_replay import UNRECORDED, LaunchCache, Recorder
from kvplan.validate.arguments import check_copy
from kvplan.workspace import DISPATCH, DONE, HOST_ROW_LIMIT, PADDING, ROW_WORDS, SHARED, next_pow2


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

_COUNT_BLOCK = tl.constexpr(256)  # batch rows whose counts one step of the max-count loop reads
# Plan entries from which the swap-in's copy may take the work counter (docs/benchmarks.md, "Work counter"). A launch
# argument, as the span is, not a compiled constant.
DYNAMIC_MIN_ENTRIES = 2048
_WIDE = tl.constexpr(8)  # tiles per item of the host rows' launch when many entries share host rows
_ROW_WORDS = tl.constexpr(ROW_WORDS)
_SHARED = tl.constexpr(SHARED)
_PADDING = tl.constexpr(PADDING)
_DONE = tl.constexpr(DONE)
_HOST_ROW_LIMIT = tl.constexpr(HOST_ROW_LIMIT)


@triton.jit
def _row_count(count_ptr, ws_ptr, ws_stride, marks, row, columns):
    """Copies of plan row ``row``: its count clamped to ``[0, columns]``, 0 for a row the swap-in marked padding
    (``marks``: the workspace's row words are read; else ``ws_ptr`` is a stand-in of at least one word, stride 0)."""
    count = tl.load(count_ptr + row)
    word = tl.load(ws_ptr + row.to(tl.int64) * ws_stride + _SHARED)
    count = tl.where((word == _PADDING) & (marks != 0), 0, count)
    return tl.minimum(tl.maximum(count, 0), columns)


@triton.jit
def _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
               src_row, dst_row, m, in_list, take, n_host, n_dev, HOST_STRIDE: tl.constexpr,
               DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """One tile: the copies ``m`` (lanes where ``in_list``) that ``take`` holds for moved; 1 per lane that copied.
    The entries load under ``in_list`` alone, so they load while ``take`` is still being worked out. With V rows
    (``host_v_ptr`` not ``None``, same row pitches) each copy moves its K row and its V row, both loads in flight
    before either store."""
    words = tl.arange(0, BLOCK_W)
    src = tl.load(src_row + m, mask=in_list, other=-1)
    dst = tl.load(dst_row + m, mask=in_list, other=-1).to(tl.int64)
    ok = take & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
    tile_ok = ok[:, None] & (words < WORDS)[None, :]
    values = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
    if host_v_ptr is not None:
        values_v = tl.load(host_v_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
        tl.store(dev_v_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values_v, mask=tile_ok)
    tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=tile_ok)
    return ok.to(tl.int32)


@triton.jit
def _copy_shared_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                      src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, ws_ptr, ws_stride,
                      m, shared_from, take, n_real, columns, plan_stride, n_host, n_dev,
                      HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
                      BLOCK_W: tl.constexpr):  # fmt: skip
    """One tile of shared entries (lanes ``take``, entries ``m`` of the walked row ``src_ptr``/``dst_ptr``):
    each copied from the device row of the plan entry at offset ``shared_from`` (of ``plan_src_ptr``/``plan_dst_ptr``,
    row stride ``plan_stride``) when that entry holds the same host row and read it from the host in this copy, else
    from the host. Returns 1 per lane that copied."""
    words = tl.arange(0, BLOCK_W)
    src = tl.load(src_ptr + m, mask=take, other=-1)
    dst = tl.load(dst_ptr + m, mask=take, other=-1).to(tl.int64)
    ok = take & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
    at = shared_from.to(tl.int64)
    owner_row = at // tl.maximum(plan_stride, 1)  # (a plan of one row may have any row stride, 0 included)
    owner_m = at - owner_row * plan_stride
    owner = ok & (owner_row < n_real) & (owner_m < columns)
    owner_count = tl.load(count_ptr + owner_row, mask=owner, other=0)
    owner = owner & (owner_m < tl.minimum(tl.maximum(owner_count, 0), columns))
    owner_ws = ws_ptr + owner_row * ws_stride
    owner_word = tl.load(owner_ws + _SHARED, mask=owner, other=0)
    owner = owner & (owner_word != _PADDING)  # a padding row's entries are not copied: nothing to copy from
    owner_shares = owner_word > 0
    owner_from = tl.load(owner_ws + _ROW_WORDS + owner_m, mask=owner & owner_shares, other=-1)
    owner_src = tl.load(plan_src_ptr + at, mask=owner, other=-1)
    owner_dst = tl.load(plan_dst_ptr + at, mask=owner, other=-1).to(tl.int64)
    on_device = owner & (owner_from < 0) & (owner_src == src) & (owner_dst >= 0) & (owner_dst < n_dev)
    in_row = (words < WORDS)[None, :]
    # (.cg: in a fused copy the owner's row was written by another program of the same launch, past this SM's L1)
    from_dev = tl.load(dev_ptr + (owner_dst[:, None] * DEV_STRIDE + words[None, :]), mask=on_device[:, None] & in_row,
                       cache_modifier=".cg")  # fmt: skip
    from_host = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]),
                        mask=(ok & (on_device == 0))[:, None] & in_row)  # fmt: skip
    values = tl.where(on_device[:, None], from_dev, from_host)
    if host_v_ptr is not None:  # the V row the same way, both in flight before either store
        from_dev_v = tl.load(dev_v_ptr + (owner_dst[:, None] * DEV_STRIDE + words[None, :]),
                             mask=on_device[:, None] & in_row, cache_modifier=".cg")  # fmt: skip
        from_host_v = tl.load(host_v_ptr + (src[:, None] * HOST_STRIDE + words[None, :]),
                              mask=(ok & (on_device == 0))[:, None] & in_row)  # fmt: skip
        values_v = tl.where(on_device[:, None], from_dev_v, from_host_v)
        tl.store(dev_v_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values_v, mask=ok[:, None] & in_row)
    tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=ok[:, None] & in_row)
    return ok.to(tl.int32)


@triton.jit
def _host_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
               src_ptr, dst_ptr, ws_ptr, ws_stride, record_at, b, lo, hi, m, in_list,
               many_shared, n_host, n_dev, HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
               BLOCK_W: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """One work item of the entries that read the host (entries ``[lo, hi)`` of plan row ``b``, walked at
    ``src_ptr``/``dst_ptr``, that row's entries); 1 per lane copied.
    With ``many_shared`` the item spans ``_WIDE`` tiles: the item's records (and the row word) at once, then each tile
    holding an entry that reads the host (a row that shares nothing has no record: every entry reads it)."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    if many_shared:
        row_ws = ws_ptr + b * ws_stride
        row_word = tl.load(row_ws + _SHARED)  # <= 0: no entry of the row shares (no record to read)
        wide = lo + tl.arange(0, ROWS * _WIDE)
        in_wide = wide < hi
        record = tl.load(row_ws + record_at + wide, mask=in_wide, other=-1)
        # (the row word broadcast to the tile first: with a scalar in it, Triton 3.9's interpreter gives the mask a
        # dtype its loads refuse)
        reads = in_wide & ((record < 0) | (tl.zeros([ROWS * _WIDE], tl.int32) + row_word <= 0))
        tiles = tl.max(tl.reshape(reads.to(tl.int32), [_WIDE, ROWS]), axis=1)
        free = tl.zeros([ROWS], tl.int32) + row_word <= 0  # the row shares nothing: each entry reads the host
        for t in tl.static_range(_WIDE):
            if tl.sum(tl.where(tl.arange(0, _WIDE) == t, tiles, 0), axis=0) > 0:
                mt = lo + t * ROWS + tl.arange(0, ROWS)
                in_tile = mt < hi
                tile_record = tl.load(row_ws + record_at + mt, mask=in_tile, other=-1)
                copied += _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, src_ptr, dst_ptr, mt, in_tile,
                                     in_tile & ((tile_record < 0) | free), n_host, n_dev, HOST_STRIDE, DEV_STRIDE,
                                     WORDS, BLOCK_W)  # fmt: skip
    else:
        copied += _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                             src_ptr, dst_ptr, m, in_list, in_list, n_host, n_dev,
                             HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
    return copied


@triton.jit
def _shared_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                 src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, ws_ptr, ws_stride,
                 record_at, b, m, in_list, n_real, columns, plan_stride, n_host, n_dev,
                 HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """One work item of the entries that share another's host row (entries ``m`` of plan row ``b``, walked at
    ``src_ptr``/``dst_ptr``, that row's entries); 1 per lane copied."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    row_ws = ws_ptr + b * ws_stride
    row_shares = tl.zeros([ROWS], tl.int32) + tl.load(row_ws + _SHARED) > 0
    shared_from = tl.load(row_ws + record_at + m, mask=in_list, other=-1)
    take = in_list & (shared_from >= 0) & row_shares
    if tl.max(take.to(tl.int32), axis=0) > 0:
        copied += _copy_shared_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                    src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr,
                                    ws_ptr, ws_stride, m, shared_from, take, n_real, columns, plan_stride,
                                    n_host, n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
    return copied


@triton.jit
def _walk(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
          walk_src, walk_dst, walk_strides, record_at, src_ptr, dst_ptr, count_ptr, dispatch_ptr,
          ws_ptr, ws_stride, marks, first, stride, from_counter, items, slices, n_real, columns, plan_stride, n_host,
          n_dev,
          READS: tl.constexpr, wide, HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
          BLOCK_W: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Work items ``(q, b)`` below ``items`` (``slices`` per row): ``first``, ``first + stride``, ... or, with
    ``from_counter``, each from ``dispatch_ptr``, over the entries of ``walk_src``/``walk_dst`` (row strides
    ``walk_strides``, their records at word ``record_at`` of each workspace row: the plan, or the swap-in's copy of a
    single-step plan in host-row order); ``src_ptr``/``dst_ptr``/``plan_stride``: the plan, where records point.
    ``READS``: the entries that read the host (``wide``: items of ``_WIDE`` tiles, the tiles that hold a reader);
    else the entries that share another's host row. Returns the copies per lane and the items done."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    done = tl.zeros([], tl.int64)
    if from_counter:
        # (relaxed: a ticket orders nothing; what follows the walk orders what the programs read of one another)
        item = tl.atomic_add(dispatch_ptr, 1, sem="relaxed").to(tl.int64)
    else:
        item = tl.zeros([], tl.int64) + first
    while item < items:
        q = item // n_real
        b = item - q * n_real
        count = _row_count(count_ptr, ws_ptr, ws_stride, marks, b, columns).to(tl.int64)
        lo = q * count // slices
        hi = (q + 1) * count // slices
        m = lo + tl.arange(0, ROWS)
        in_list = m < hi
        # the walked row (its two arrays may have different row strides)
        own_src, own_dst = walk_src + b * walk_strides[0], walk_dst + b * walk_strides[1]
        if READS:
            copied += _host_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                 own_src, own_dst, ws_ptr, ws_stride, record_at, b, lo, hi,
                                 m, in_list, wide, n_host, n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W,
                                 ROWS)  # fmt: skip
        else:
            copied += _shared_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                   own_src, own_dst, src_ptr, dst_ptr, count_ptr, ws_ptr,
                                   ws_stride, record_at, b, m, in_list, n_real, columns, plan_stride, n_host,
                                   n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS)  # fmt: skip
        done += 1
        if from_counter:
            item = tl.atomic_add(dispatch_ptr, 1, sem="relaxed").to(tl.int64)
        else:
            item += stride
    return copied, done


@triton.jit
def _add_copy_counters(counters_ptr, counter_base, rows, row_bytes):
    """Add (rows, bytes) at ``counters[counter_base : counter_base + 2]`` (nothing for zero rows)."""
    if rows > 0:
        n = rows.to(tl.int64)
        tl.atomic_add(counters_ptr + counter_base, n, sem="relaxed")
        tl.atomic_add(counters_ptr + counter_base + 1, n * row_bytes, sem="relaxed")


_RUNTIME_INTS = ["batch", "columns", "plan_stride", "n_host", "n_dev", "counter_base", "row_bytes", "ws_stride",
                 "dynamic_span", "dynamic_entries", "readers", "span_at", "walk_strides", "record_at",
                 "marks"]  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _ordered_copy_kernel(
    host_ptr,  # [n_host, WORDS] words, row pitch HOST_STRIDE: host_cache (pinned host memory, read zero-copy)
    dev_ptr,  # [n_dev, WORDS] words, row pitch DEV_STRIDE: device_buffer
    host_v_ptr,  # None, or the V rows beside host_ptr's K rows (same shape and row pitch): each copy moves both
    dev_v_ptr,  # None, or the V rows beside dev_ptr's (same shape and row pitch)
    src_ptr,  # [batch, columns] int64, row stride plan_stride: host rows, each row sorted ascending (for speed only)
    dst_ptr,  # [batch, columns] int32, row stride plan_stride: device rows
    walk_src_ptr,  # the entries in the order the copy walks them, row strides walk_strides: src_ptr and dst_ptr, or
    walk_dst_ptr,  # (the swap-in's copy of a single-step plan) the same rows in host-row order, from its workspace
    count_ptr,  # [>= batch] int32: copies per plan row (clamped to [0, columns])
    num_real_ptr,  # [1] int32: plan rows from it on are padding (read when HAS_NUM_REAL)
    counters_ptr,  # [NUM_COUNTERS] int64: (rows, bytes) added at counter_base (when HAS_COUNTERS)
    dispatch_ptr,  # [2] int32, zero before the launch (DISPATCH > 0 or PHASE 3): items handed out, programs done (left
    # zero, except by PHASE 3)
    ws_ptr,  # [batch, >= ROW_WORDS + columns] int32 words, row stride ws_stride: the swap-in's record (PHASE > 0)
    batch,
    columns,
    plan_stride,
    n_host,
    n_dev,
    counter_base,
    row_bytes,
    ws_stride,
    dynamic_span,  # DISPATCH == 2: host rows a plan must span to take items from the counter
    dynamic_entries,  # DISPATCH == 2: and the entries it must have
    readers,  # PHASE 3: programs below this read the host when few entries share (the ordered copy's grid)
    span_at,  # DISPATCH == 2: the row words where the swap-in's sort left the span of each row's host rows
    walk_strides,  # (src, dst) row strides of walk_src_ptr and walk_dst_ptr
    record_at,  # PHASE > 0: the word of each workspace row where the walked entries' records start
    marks,  # 1: ws_ptr's rows are the swap-in's workspace, whose row word SHARED marks its padding rows (copied never)
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,  # next power of two >= WORDS
    ROWS: tl.constexpr,  # copies per work item at most
    DISPATCH: tl.constexpr,  # 0: static items; 1: the work counter; 2: the counter when the plan is wide, unshared
    PHASE: tl.constexpr,  # 0: every entry; 1: entries that read the host; 2: entries that share another's host row;
    # 3: both, in one launch (the second kind after the first: see the docstring; ws_ptr's row words zeroed before)
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    PDL: tl.constexpr,  # launched to start early (the swap-in's copies): wait for the launch before any access
):
    """Grid ``_copy_grid``, ``(G,)``: programs walk the work items ``(q, b)``, ``q``-major (see the module
    docstring).

    PHASE 3 (the swap-in's own copy) runs phases 1 and 2 in one launch. When many entries share host rows, every
    program takes phase 1's items from the work counter, counts the items it finished (a release after its copies),
    waits until all of them are counted (an acquire), then takes phase 2's items in turn: a program waits only for
    items that programs already running have taken, so the wait ends whatever order the programs start in. Otherwise
    the first ``readers`` programs (the ordered copy's grid, one per SM) run phase 1 alone and the others return at
    once: a plan that shares nothing pays no second launch. The words are left as they end (the swap-in's resolve
    zeroes them before each call's copy)."""
    if PDL:
        gdc_wait()
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    # Q slices per row: enough that the longest row's slices hold at most ROWS copies; the entries that share a host
    # row; the host rows the plan spans (the sort's span words: HOST_ROW_LIMIT - lowest, highest + 1, 0 for none).
    # Every batch row's words load at once, beside num_real_reqs (rows past it are dropped once it arrives): one round
    # of loads, not two
    rows = tl.arange(0, _COUNT_BLOCK)
    most = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    shared = tl.zeros([_COUNT_BLOCK], dtype=tl.int64)
    entries = tl.zeros([_COUNT_BLOCK], dtype=tl.int64)
    near = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    far = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    while tl.min(rows, axis=0) < batch:  # (a while loop: the interpreter cannot take tensors as range() bounds)
        inside = rows < batch
        row_count = tl.load(count_ptr + rows, mask=inside, other=0)
        # (the row words: a padding mark, and with the record the entries that share; a stand-in's word otherwise)
        word = tl.load(ws_ptr + rows.to(tl.int64) * ws_stride + _SHARED, mask=inside, other=0)
        row_count = tl.where((word == _PADDING) & (marks != 0), 0, row_count)
        if DISPATCH == 2:
            span_words = ws_ptr + rows.to(tl.int64) * ws_stride + span_at
            row_near = tl.load(span_words, mask=inside, other=0)
            row_far = tl.load(span_words + 1, mask=inside, other=0)
        real = rows < n_real
        row_count = tl.where(real, tl.minimum(tl.maximum(row_count, 0), columns), 0)
        most = tl.maximum(most, row_count)
        if PHASE > 0:
            shared += tl.where(real, tl.maximum(word, 0), 0).to(tl.int64)
            entries += row_count.to(tl.int64)
        if DISPATCH == 2:
            near = tl.maximum(near, tl.where(row_count > 0, row_near, 0))
            far = tl.maximum(far, tl.where(row_count > 0, row_far, 0))
        rows += _COUNT_BLOCK
    n_shared = tl.sum(shared, axis=0)
    n_entries = tl.sum(entries, axis=0)
    # the record is used when a sixteenth or more of the entries share a host row: then few entries read the host, so
    # the host rows' items span _WIDE tiles and copy only the tiles that hold a reader. Below that (chance collisions
    # of random rows) the copy is the plain ordered copy: a few rows read twice cost less than consulting the record
    # for every entry
    many_shared = (n_shared > 0) & (n_shared * 16 >= n_entries)
    longest = tl.max(most, axis=0)
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if DISPATCH == 2:
        # the work counter pays on plans over a wide host span when few entries share a host row (docs/benchmarks.md,
        # "Work counter")
        far_most = tl.max(far, axis=0).to(tl.int64)
        span = tl.where(far_most > 0, far_most - 1 - (_HOST_ROW_LIMIT - tl.max(near, axis=0).to(tl.int64)), -1)
        dynamic = ~many_shared & (span > dynamic_span) & (n_entries >= dynamic_entries)
    else:
        dynamic = tl.zeros([], tl.int1) | (DISPATCH == 1)  # (a tensor, as the branch above makes it)
    copied = tl.zeros([ROWS], dtype=tl.int32)
    if PHASE == 3:
        if many_shared:
            slices = tl.cdiv(longest, ROWS * _WIDE).to(tl.int64)
            items = slices * n_real
            done_ptr = ws_ptr + tl.minimum(batch - 1, 1) * ws_stride + _DONE  # (off the counter's line)
            reads, done = _walk(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                walk_src_ptr, walk_dst_ptr, walk_strides, record_at, src_ptr,
                                dst_ptr, count_ptr, dispatch_ptr, ws_ptr, ws_stride, marks, pid, grid, True, items,
                                slices, n_real, columns, plan_stride, n_host, n_dev, True, True, HOST_STRIDE,
                                DEV_STRIDE, WORDS, BLOCK_W, ROWS)  # fmt: skip
            copied += reads
            if done > 0:
                tl.debug_barrier()  # every thread's copies, then the release that publishes them
                tl.atomic_add(done_ptr, done.to(tl.int32), sem="release")
            # every item of phase 1 done: a plain poll of the count, then an acquire of it
            while tl.load(done_ptr, volatile=True) < items:
                pass
            tl.atomic_add(done_ptr, 0, sem="acquire")
            tl.debug_barrier()  # threads that did not acquire themselves read the device rows after this
            slices = tl.cdiv(longest, ROWS).to(tl.int64)
            copied += _walk(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                            walk_src_ptr, walk_dst_ptr, walk_strides, record_at, src_ptr, dst_ptr,
                            count_ptr, dispatch_ptr, ws_ptr, ws_stride, marks, pid, grid, False, slices * n_real,
                            slices, n_real, columns, plan_stride, n_host, n_dev, False, True, HOST_STRIDE, DEV_STRIDE,
                            WORDS, BLOCK_W, ROWS)[0]  # fmt: skip
        elif pid < readers:
            slices = tl.cdiv(longest, ROWS).to(tl.int64)
            copied += _walk(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                            walk_src_ptr, walk_dst_ptr, walk_strides, record_at, src_ptr, dst_ptr,
                            count_ptr, dispatch_ptr, ws_ptr, ws_stride, marks, pid, tl.minimum(grid, readers), dynamic,
                            slices * n_real, slices, n_real, columns, plan_stride, n_host, n_dev, True, False,
                            HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS)[0]  # fmt: skip
    else:
        per_item = ROWS
        if PHASE == 1:
            per_item = tl.where(many_shared, ROWS * _WIDE, ROWS)
        slices = tl.cdiv(longest, per_item).to(tl.int64)
        items = slices * n_real
        if PHASE == 2:
            items = tl.where(many_shared, items, 0)  # no record to follow: nothing to do
        copied += _walk(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                        walk_src_ptr, walk_dst_ptr, walk_strides, record_at, src_ptr, dst_ptr,
                        count_ptr, dispatch_ptr, ws_ptr, ws_stride, marks, pid, grid, dynamic, items, slices, n_real,
                        columns, plan_stride, n_host, n_dev, PHASE < 2, many_shared & (PHASE == 1), HOST_STRIDE,
                        DEV_STRIDE, WORDS, BLOCK_W, ROWS)[0]  # fmt: skip
        if DISPATCH > 0:
            if dynamic:
                # the last program to finish (every other one has taken its last item) leaves the counter zero for
                # the next launch on it
                if tl.atomic_add(dispatch_ptr + 1, 1, sem="acq_rel") == grid - 1:
                    tl.atomic_xchg(dispatch_ptr, 0)
                    tl.atomic_xchg(dispatch_ptr + 1, 0)
    if HAS_COUNTERS:
        _add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)


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
    marked: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Launch the copy on already validated arguments: the first ``batch`` plan rows (default: all of them), items
    handed out by ``dispatch`` (two int32 words, zero before the launch and left zero after it) when given. With
    ``workspace`` (int32 words ``[>= batch, >= ROW_WORDS + columns]``: a swap-in's record of shared host rows) two
    launches: entries that read the host, then entries that share one's host row; ``choose_dispatch`` (the swap-in's
    own copy, whose resolve zeroed the record's row words) one launch of both (``PHASE`` 3), which takes the work
    counter when the plan is wide (``span_at``: the int32 word of each workspace row where the sort left the span of
    the row's host rows, ``kvplan.workspace``; ``walk``: ``(src, dst, record_at)``, the same entries in another
    order, whose records sit at word ``record_at`` of each workspace row, for the copy to walk: the swap-in's copy of a
    single-step plan in host-row order, the plan itself staying in miss order).
    ``early``: the launches follow others of the call and may start early (``dependent_launch``). ``marked``: the
    swap-in's workspace as int32 words, read for the rows it marked padding when ``workspace`` is not given (with
    ``workspace`` its marks are read): those rows copy nothing, whatever their plan rows hold. ``host_cache_v`` /
    ``device_buffer_v`` (checked: the K tensors' shapes, dtypes and row strides): each copy also moves its V row, in
    the same pass (the counters count the entry once, the bytes of both rows)."""
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    walk_src, walk_dst, record_at = (miss_src, miss_dst, ROW_WORDS) if walk is None else walk
    batch = miss_src.shape[0] if batch is None else batch
    launch = launch or COPY_LAUNCH
    columns = miss_src.shape[1]
    if batch == 0 or columns == 0 or host_cache.shape[1] == 0:
        return
    values = host_cache_v is not None
    kv = (host_cache, device_buffer, host_cache_v, device_buffer_v) if values else (host_cache, device_buffer)
    word = row_word_dtype(*kv)
    host_words = as_words(host_cache, word)
    dev_words = as_words(device_buffer, word)
    host_v_words = as_words(host_cache_v, word) if values else None
    dev_v_words = as_words(device_buffer_v, word) if values else None
    words = host_words.shape[1]
    device = device_buffer.device
    item_bytes = host_cache.shape[1] * host_cache.element_size()
    row_bytes = item_bytes * (2 if values else 1)  # what one copy moves (K and V rows)
    sms = num_sms(device)
    grid = _copy_grid(launch, sms, batch, columns)
    if workspace is None:
        phases = [(0, grid, 0, launch)]
    elif choose_dispatch:  # both kinds of entries in one launch: the wider grid, of which the ordered copy's reads
        wide = _copy_grid(SHARED_COPY_LAUNCH, sms, batch, columns)
        phases = [(3, (max(grid[0], wide[0]),), grid[0], launch)]
    else:  # entries that read the host (the ordered copy's grid), then entries that share their host row
        phases = [(1, grid, 0, launch), (2, _copy_grid(SHARED_COPY_LAUNCH, sms, batch, columns), 0, SHARED_COPY_LAUNCH)]
    rows_words = workspace if workspace is not None else marked  # the row words that mark padding rows, if any
    if dispatch is not None:
        mode = 1
    elif choose_dispatch and workspace is not None:
        mode, dispatch = 2, workspace[0, DISPATCH : DISPATCH + 2]
    else:
        mode = 0
    with device_guard(device):
        for phase, phase_grid, readers, shape in phases:
            recorder.launch(
                _ordered_copy_kernel,
                phase_grid,
                host_words,
                dev_words,
                host_v_words,
                dev_v_words,
                miss_src,
                miss_dst,
                walk_src,
                walk_dst,
                miss_count,
                miss_count if num_real_reqs is None else num_real_reqs,
                miss_count if counters is None else counters,
                miss_count if dispatch is None else dispatch,
                miss_count if rows_words is None else rows_words,
                batch,
                columns,
                miss_src.stride(0),
                host_words.shape[0],
                dev_words.shape[0],
                counter_base,
                row_bytes,
                0 if rows_words is None else rows_words.stride(0),
                DYNAMIC_SPAN_BYTES // max(item_bytes, 1),
                DYNAMIC_MIN_ENTRIES,
                readers,
                span_at,
                (walk_src.stride(0), walk_dst.stride(0)),
                record_at,
                0 if rows_words is None else 1,
                HOST_STRIDE=host_words.stride(0),
                DEV_STRIDE=dev_words.stride(0),
                WORDS=words,
                BLOCK_W=next_pow2(words),
                ROWS=shape.rows_per_program,
                DISPATCH=mode if phase != 2 else 0,
                PHASE=phase,
                HAS_NUM_REAL=num_real_reqs is not None,
                HAS_COUNTERS=counters is not None,
                PDL=early,
                launch_pdl=early,
                num_warps=shape.num_warps,
            )


def copy_planned(
    plan: MissPlan,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    num_real_reqs: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    launch_records: LaunchCache | None = None,
    host_cache_v: torch.Tensor | None = None,
    device_buffer_v: torch.Tensor | None = None,
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
    workspace : Tensor, optional
        Read. The workspace of the swap-in that wrote ``plan`` (``pool.replay`` passes the pool's): its record of
        the entries that share a host row, so each distinct host row is read from the host once and copied on the
        device to the others. Any int64 ``[>= batch, >= ceil((8 + columns) / 2)]`` tensor is safe: an entry is
        copied from another's device row only when that one holds the same host row and read it in this copy.
    launch_records : LaunchCache, optional
        Where a checked call's launches are recorded, so that a later call laid out alike skips its checks and
        relaunches them under the records' policy (``kvplan.runtime.launch_replay``; a pool passes its own). ``None``
        (the default): every call is checked and launched, nothing is recorded.
    host_cache_v, device_buffer_v : Tensor, optional
        Both or neither: the V rows of an MHA layer beside its K rows (``host_cache``/``device_buffer``), each with its
        K twin's shape, dtype and row stride. Each entry copies its K row and its V row in one pass (the plan of
        :func:`kvplan.kernels.swap_in_blocks` replayed into another layer's K and V caches); the counters add the
        entry once and the bytes of both rows.

    Allocates nothing and never synchronises (CUDA-graph capturable). Rows are read in host-address order when each
    plan row is sorted by ``src``, as swap-ins above small batches write them (faster on large host caches).
    """
    run_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, workspace=workspace,
        records=launch_records, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v,
    )  # fmt: skip


def run_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int = REPLAY_COPY_BASE, dispatch: torch.Tensor | None = None,
    launch: CopyLaunch | None = None, workspace: torch.Tensor | None = None, records: LaunchCache | None = None,
    host_cache_v: torch.Tensor | None = None, device_buffer_v: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """:func:`copy_planned` with the package's knobs (the ops, the swap-in benchmark): the counters it adds to, a work
    counter (``dispatch``: two int32 words, zero, that no other launch uses at the same time; left zero), the launch
    shape, the launch records (``None``: checked and launched, nothing recorded)."""
    launch = launch or COPY_LAUNCH  # keyed as launched (tests and benchmarks swap the default)
    key = None
    if records is not None:
        values = (*plan_tensors(plan), host_cache, device_buffer, num_real_reqs, counters, counter_base, dispatch,
                  launch, workspace, host_cache_v, device_buffer_v)  # fmt: skip
        key = records.key(values)
        if records.relaunch(key, device_buffer):
            return
    check_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, counter_base=counter_base,
        workspace=workspace, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v,
    )  # fmt: skip
    recorder = UNRECORDED if records is None else Recorder()
    launch_copy(
        plan,
        host_cache,
        device_buffer,
        host_cache_v=host_cache_v,
        device_buffer_v=device_buffer_v,
        num_real_reqs=num_real_reqs,
        counters=counters,
        counter_base=counter_base,
        recorder=recorder,
        dispatch=dispatch,
        launch=launch,
        workspace=None if workspace is None or plan.src.shape[1] == 0 else workspace.view(torch.int32),
    )
    if records is not None:
        records.remember(key, recorder)


def plan_tensors(plan: object) -> tuple:
    """``(src, dst, count)`` of a ``MissPlan`` for a layout key (anything else keys as itself and is refused by the
    checks)."""
    return (plan.src, plan.dst, plan.count) if isinstance(plan, MissPlan) else (plan, None, None)
