"""Plan order and sharing: the plan row in host-row order, and one host-row table for the whole call (the share
launch, which also follows the on-chip resolve when its blocks do not claim host rows themselves), and row 0's format
word after an on-chip resolve that did. Names: the kernel glossary, ``kvplan/kernels/glossary.py``."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvplan.kernels.resolve.constants import (
    _CURRENT,
    _FORMAT,
    _HASH,
    _HASH_HI,
    _HOST_ROW_LIMIT,
    _KEY_SHIFT,
    _LOW_MASK,
    _NO_CLAIM,
    _SHARED,
    _SORT_SLICE,
    _SORT_TILE,
    _STAMP_SHIFT,
    _TAG_PERIOD,
    SORT_SLICE,
)
from kvplan.kernels.resolve.records import ResolveArgs, sort_block
from kvplan.kernels.resolve.stages import _row_of
from kvplan.kernels.resolve.tables import _format_word, _words
from kvplan.runtime.launch_replay import Recorder

# ---------------------------------------------------------------------------------------------------------------------
# Sort and share: the plan row in host-row order, and one host-row table for the whole call


@triton.jit
def _claim_host_rows(ws_ptr, ws_stride, table_rows, host, offset, active, LAYOUT: tl.constexpr):
    """Every active lane claims ``host`` (a host row ``< HOST_ROW_LIMIT``) for its plan ``offset`` (``< 2**24``) in
    the call's table: the ``table_rows`` rows' token tables read as one open-addressing table of ``table_rows * TB``
    int64 entries ``stamp << 55 | host << 24 | offset``, each row's part under that row's host-row stamp (anything
    else there is free). Returns, per lane, the offset of the entry that claimed the same host row first, or -1 (this
    lane claimed it, or is inactive)."""
    TB: tl.constexpr = LAYOUT.table_size
    LOG_TB: tl.constexpr = TB.bit_length() - 1
    total = (tl.zeros([], tl.int64) + table_rows) * TB  # (table_rows may arrive as a plain 1)
    mixed = (host.to(tl.int32) * _HASH) ^ ((host >> 32).to(tl.int32) * _HASH_HI)
    mixed = mixed.to(tl.uint32, bitcast=True)
    mixed = mixed ^ (mixed >> 15)
    slot = (mixed.to(tl.int64) * total) >> 32  # in [0, total)
    owner = tl.full(host.shape, -1, tl.int64)
    pending = active
    probes = tl.zeros([], tl.int64)  # one pass over the table at most: a lane still pending then reads the host itself
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (probes < total):
        probes += 1
        row_ws = ws_ptr + (slot >> LOG_TB) * ws_stride
        stamp = tl.load(row_ws + _CURRENT, mask=pending, other=0).to(tl.int64) % _TAG_PERIOD * 2 + 1
        key = (stamp << (_STAMP_SHIFT - _KEY_SHIFT)) | host
        entry = _words(row_ws, LAYOUT.keys, tl.int64) + (slot & (TB - 1))
        seen = tl.load(entry, mask=pending, other=-1, cache_modifier=".cg")
        free = pending & ((seen >> _STAMP_SHIFT) != stamp)
        # lanes not claiming compare against no_claim, which no entry holds: their compare-and-swap writes nothing
        no_claim = (stamp << _STAMP_SHIFT) | _NO_CLAIM
        old = tl.atomic_cas(entry, tl.where(free, seen, no_claim), (key << _KEY_SHIFT) | offset, sem="relaxed")
        claimed = free & (old == seen)
        # the entry holds this host row: the one seen, or the one a lane of another program claimed first
        held = tl.where(free, old, seen)
        same = pending & ~claimed & ((held >> _KEY_SHIFT) == key)
        owner = tl.where(same, held & _LOW_MASK, owner)
        pending = pending & ~claimed & ~same
        slot = tl.where(pending, tl.where(slot + 1 == total, 0, slot + 1), slot)
    return owner


@triton.jit
def _raise_span(ws, host, usable, LAYOUT: tl.constexpr):
    """Raise the row's span words (``kvplan.workspace``) to cover the ``usable`` lanes' host rows: the swap-in's
    copy then reads the host rows its plan spans beside the counts, not from the plan after them."""
    far = tl.max(tl.where(usable, host + 1, 0), axis=0)
    if far > 0:
        near = tl.max(tl.where(usable, _HOST_ROW_LIMIT - host, 0), axis=0)
        tl.atomic_max(ws + LAYOUT.span, near.to(tl.int32), sem="relaxed")
        tl.atomic_max(ws + LAYOUT.span + 1, far.to(tl.int32), sem="relaxed")


@triton.jit
def _share_entries(ws_ptr, ws_stride, ws, b64, plan_stride, host, position, mine, kv_rows, table_rows, sorted_at,
                   LAYOUT: tl.constexpr, APART: tl.constexpr):  # fmt: skip
    """Plan entries ``position`` (lanes ``mine``) of row ``b64``, host rows ``host``: each claims its host row;
    ``shared_from`` records the first claimer's plan offset (-1: this entry reads the host); the row word counts the
    shared entries, the span words cover them. ``APART``: the same record also at each entry's place in the
    workspace's host-row order (``sorted_at``, in the ``miss_rank`` words), which the swap-in's copy walks."""
    usable = mine & (host >= 0) & (host < kv_rows[0])
    _raise_span(ws, host, usable, LAYOUT)
    owner = _claim_host_rows(ws_ptr, ws_stride, table_rows, host, b64 * plan_stride + position, usable, LAYOUT)
    tl.store(ws + LAYOUT.shared_from + position, owner.to(tl.int32), mask=mine)
    if APART:  # (the miss ranks' words: the place stage is done with them)
        tl.store(ws + LAYOUT.miss_rank + sorted_at, owner.to(tl.int32), mask=mine)
    n_shared = tl.sum((owner >= 0).to(tl.int32), axis=0)
    if n_shared > 0:
        tl.atomic_add(ws + _SHARED, n_shared, sem="relaxed")


@triton.jit
def _miss_lists_to(ws, miss_host, placed_n, out_src, out_dst, LAYOUT: tl.constexpr, CH: tl.constexpr):
    """A row's ``placed_n`` misses, in miss order, from its miss lists to ``out_src``/``out_dst``, ``CH`` at a time."""
    start = 0
    while start < placed_n:
        m = start + tl.arange(0, CH)
        mine = m < placed_n
        tl.store(out_src + m, tl.load(miss_host + m, mask=mine, other=0), mask=mine)
        tl.store(out_dst + m, tl.load(ws + LAYOUT.miss_loc + m, mask=mine, other=-1), mask=mine)
        start += CH


@triton.jit
def _sort_row(ws, count_at, src_row, dst_row, SORT: tl.constexpr, LAYOUT: tl.constexpr, CH: tl.constexpr,
              APART: tl.constexpr):  # fmt: skip
    """One program sorts a row's miss lists into its plan by host row (a bitonic sort of ``SB`` keys
    ``host << LOG | m``, ``SORT = (SB, LOG, LIMIT)``: host rows clamped to ``LIMIT`` so keys stay below 2**62); a row
    of more than ``SB`` misses keeps miss order (copied in chunks of ``CH``). ``APART``: the plan keeps miss order and
    the host-row order goes to words of the workspace the resolve is done with (``_launch_swap_in``), each sorted
    miss's place to the ``old_lru`` words."""
    SB: tl.constexpr = SORT[0]
    LOG: tl.constexpr = SORT[1]
    LIMIT: tl.constexpr = SORT[2]
    placed_n = tl.load(count_at)
    miss_host = _words(ws, LAYOUT.miss_host, tl.int64)
    if APART:
        out_src, out_dst = _words(ws, LAYOUT.hot, tl.int64), ws + LAYOUT.occ_entry
        _miss_lists_to(ws, miss_host, placed_n, src_row, dst_row, LAYOUT, CH)  # the plan in miss order
    else:
        out_src, out_dst = src_row, dst_row
    if placed_n <= SB:
        m = tl.arange(0, SB)
        mine = m < placed_n
        h = tl.load(miss_host + m, mask=mine, other=0)
        key = tl.where(mine, tl.minimum(tl.maximum(h, 0), LIMIT), LIMIT + 1)  # unused lanes sort last
        key = tl.sort((key << LOG) | m.to(tl.int64))
        which = (key & (SB - 1)).to(tl.int32)
        tl.store(out_src + m, tl.load(miss_host + which, mask=mine, other=0), mask=mine)
        tl.store(out_dst + m, tl.load(ws + LAYOUT.miss_loc + which, mask=mine, other=-1), mask=mine)
        if APART:
            tl.store(ws + LAYOUT.old_lru + which, m, mask=mine)
    else:
        _miss_lists_to(ws, miss_host, placed_n, out_src, out_dst, LAYOUT, CH)


_SORT_INTS = ["batch_indexing", "ws_stride", "plan_stride", "kv_rows"]


@triton.jit(do_not_specialize=_SORT_INTS)
def _sort_plan_kernel(
    # pointers
    rpi_ptr,  # the batch rows: req_pool_indices, seq_lens, num_real_reqs (read by _row_of, which says what)
    seq_ptr,
    num_real_ptr,
    ws_ptr,  # [B, LAYOUT.words] int32 workspace rows (miss lists, host-row table, shared_from)
    count_ptr,  # [>= B] int32 miss_count (the place stage wrote it)
    src_ptr,  # [>= B, >= S*K] int64 miss_src
    dst_ptr,  # [>= B, >= S*K] int32 miss_dst
    # strides
    ws_stride,  # the workspace's row stride
    plan_stride,  # miss_src's and miss_dst's row stride
    # sizes
    batch_indexing,  # the batch rows' strides, B and R (BatchIndexing), read by _row_of
    kv_rows,  # (n_host, n_dev): rows of host_cache and device_buffer
    # compile-time: the shapes, the plan's mode, what to do, flags
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    SORT: tl.constexpr,  # write the sorted plan from the miss lists (else the plan is already sorted: share only)
    ROW_SB: tl.constexpr,  # (not SORT) the most misses one program per row sorts (sort_block): longer rows unsorted
    HAS_NUM_REAL: tl.constexpr,
    PDL: tl.constexpr,  # launched to start early: wait for the resolve launch before any access
):
    """Grid ``_sort_plan_grid``, ``(cdiv(S*K, SORT_SLICE), B)``: program ``(i, b)`` takes misses
    ``[i * SORT_SLICE, ...)`` of row ``b``. Sorting, miss ``m`` (host row ``h``) goes to plan entry ``#{misses before
    it in (host row, m) order}``, a permutation of ``[0, miss_count)``, by comparing it with every miss of the row (the
    copies it orders cost far more). Sharing (``MODE.shared``), each entry then claims its host row in the call's
    table. Program ``(0, 0)`` writes row 0's format word (after one program per row, whose programs all read it, this
    launch always runs)."""
    if PDL:
        gdc_wait()
    b = tl.program_id(1)
    if (tl.program_id(0) == 0) & (b == 0):
        tl.store(ws_ptr + _FORMAT, _format_word(ws_stride, LAYOUT))
    _, _, _, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL)
    if long_row:
        placed_n = tl.load(count_ptr + b)
        m = tl.program_id(0) * _SORT_SLICE + tl.arange(0, _SORT_SLICE)
        mine = m < placed_n
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            b64 = b.to(tl.int64)
            ws = ws_ptr + b64 * ws_stride
            row = b64 * plan_stride
            if SORT:
                miss_host = _words(ws, LAYOUT.miss_host, tl.int64)
                h = tl.load(miss_host + m, mask=mine, other=0)
                position = tl.zeros([_SORT_SLICE], tl.int32)
                other = tl.arange(0, _SORT_TILE)
                while tl.min(other, axis=0) < placed_n:
                    h2 = tl.load(miss_host + other, mask=other < placed_n, other=0)
                    earlier = (h2[None, :] < h[:, None]) | ((h2[None, :] == h[:, None]) & (other[None, :] < m[:, None]))
                    position += tl.sum((earlier & (other < placed_n)[None, :]).to(tl.int32), axis=1)
                    other += _SORT_TILE
                loc = tl.load(ws + LAYOUT.miss_loc + m, mask=mine, other=-1)
                if MODE.apart:  # the plan in miss order; its host-row order in the workspace, for the copy
                    tl.store(src_ptr + row + m, h, mask=mine)
                    tl.store(dst_ptr + row + m, loc, mask=mine)
                    tl.store(_words(ws, LAYOUT.hot, tl.int64) + position, h, mask=mine)  # (words the resolve
                    tl.store(ws + LAYOUT.occ_entry + position, loc, mask=mine)  # is done with: _launch_swap_in)
                    entry, sorted_at = m, position
                else:
                    tl.store(src_ptr + row + position, h, mask=mine)
                    tl.store(dst_ptr + row + position, loc, mask=mine)
                    entry, sorted_at = position, position
            else:
                entry = m
                h = tl.load(src_ptr + row + m, mask=mine, other=-1)
                sorted_at = m
                if MODE.apart:  # one program per row left each miss's place in host-row order (_sort_row)
                    # (the row's count broadcast to the lanes first: a scalar in a mask gives it a dtype Triton
                    # 3.9's interpreter refuses in a load)
                    sorted_row = (tl.zeros([_SORT_SLICE], tl.int32) + placed_n) <= ROW_SB
                    sorted_at = tl.load(ws + LAYOUT.old_lru + m, mask=mine & sorted_row, other=0)
                    sorted_at = tl.where(sorted_row, sorted_at, m)  # (longer rows keep miss order)
            if MODE.shared:
                _share_entries(ws_ptr, ws_stride, ws, b64, plan_stride, h, entry, mine, kv_rows, batch_indexing[2],
                               sorted_at, LAYOUT, MODE.apart)  # fmt: skip


@triton.jit(do_not_specialize=["ws_stride"])
def _write_format_kernel(ws_ptr, ws_stride, LAYOUT: tl.constexpr, PDL: tl.constexpr):
    """Row 0's format word, after an on-chip resolve whose blocks claimed their host rows themselves when no copy
    follows to write it: every block read the word, and this launch starts after them all."""
    if PDL:
        gdc_wait()
    tl.store(ws_ptr + _FORMAT, _format_word(ws_stride, LAYOUT))


def _launch_format_word(recorder: Recorder, a: ResolveArgs) -> None:
    """One program writes row 0's format word (``_write_format_kernel``)."""
    recorder.launch(_write_format_kernel, (1,), ws_ptr=a.ws32, ws_stride=a.ws_stride, LAYOUT=a.layout, num_warps=1,
                    **a.early())  # fmt: skip


def _sort_plan_grid(occurrences: int, batch: int) -> tuple[int, int]:
    """Axis 0: a slice of ``SORT_SLICE`` plan entries, axis 1: batch row."""
    return (triton.cdiv(occurrences, SORT_SLICE), batch)


def _launch_sort_plan(recorder: Recorder, a: ResolveArgs, sort: bool, row_block: int | None = None) -> None:
    """The plan in host-row order (``sort``: after the split resolve), each entry's host row claimed (when shared),
    row 0's format word (after one program per row or the on-chip resolve, which sorted rows of up to ``row_block``
    misses: ``sort_block``'s by default)."""
    call = a.call
    row_block = sort_block(a.dims.occurrences)[0] if row_block is None else row_block
    recorder.launch(
        _sort_plan_kernel, _sort_plan_grid(a.dims.occurrences, a.dims.batch),
        rpi_ptr=call.req_pool_indices, seq_ptr=call.seq_lens, num_real_ptr=a.num_real,
        batch_indexing=a.batch_indexing, ws_ptr=a.ws32, ws_stride=a.ws_stride, count_ptr=a.plan.count,
        src_ptr=a.plan.src, dst_ptr=a.plan.dst, plan_stride=a.plan.src.stride(0), kv_rows=a.kv_rows,
        SHAPE=a.shape, LAYOUT=a.layout, MODE=a.mode, SORT=sort, ROW_SB=row_block,
        HAS_NUM_REAL=call.num_real_reqs is not None,
        num_warps=8, **a.early(),
    )  # fmt: skip
