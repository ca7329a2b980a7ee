"""HiSparse swap-in in Triton (docs/kernels.md §2-§3): resolve, plan, and copy, with the launches chosen by batch.

A row's ``N = S*K`` occurrences are split into chunks of ``occ_chunk`` and its ``HOT`` LRU positions into chunks of
``hot_chunk``. What one chunk decides, the others read from the row's workspace (regions in
``kvplan.workspace``). The chunk stages, in order:

1. *prep* (per occurrence chunk): resolve what needs no table (padding and short rows entirely; invalid occurrences,
   the newest token of the single-step path, tail hits of the speculative path), mark the rest *wanted*, clear the
   row's counters and take the row's next epoch (the table is emptied only when its epoch tags could repeat or the
   workspace does not vouch for it: ``kvplan.workspace``).
2. *insert* (per occurrence chunk): wanted occurrences insert ``stamp << 55 | token << 24 | occurrence`` into the
   table (open addressing; a lane reads a window of entries, then claims the first one not live under this call's
   stamp with a compare-and-swap); an entry keeps its token's first occurrence (``atomic_min`` on the packed key).
3. *place*, in ticket order (a chunk waits only on lower tickets: dynamic tickets with a chained look-back, as in
   single-pass prefix scans; a program that has started keeps being scheduled, so waits end):
   - *hot chunks*: every LRU position looks its slot's token up; a found token is a hit. The entry keeps the least
     recently used such position and its slot (``atomic_min`` of ``position << 16 | slot``); each position gets its
     hit bit, each chunk publishes its count of evictable positions.
   - *occurrence chunks*: first occurrences of tokens no slot holds are misses; backed ones (host row ``>= 0``) are
     ranked within the chunk, the chunk publishes its count, and the lower chunks' counts give each miss its rank
     ``m`` in first-occurrence order; the ``m``-th evictable position is its slot, then scratch rows, then ``-1``.
     Outputs, the filled slots' tokens and the plan entry (or the miss lists the sort reads) are written.
   - *finish chunks* (one per hot chunk): once every occurrence chunk has counted, each moves its positions to the
     new order (``evictables[M:] ++ evictables[:M] ++ hits``); the first writes ``miss_count`` and the overflow.
     The row's table is then part of the call's host-row table (entries of the other stamp, so the token entries
     read as empty there).
4. *sort* (above ``FLAT_COPY_MAX_BATCH``): the plan row in host-row order, so each copy of it (the swap-in's own and
   every replay) reads the host cache in address order; a single-step plan stays in miss order (docs/kernels.md §2)
   and its host-row order goes to workspace words the resolve is done with, for the swap-in's own copy to walk;
5. *share* (same batches): every plan entry claims its host row in one table for the whole call; an entry whose host
   row another entry claimed records that entry (``shared_from``), and the copy reads it from that entry's device row
   instead of the host (each distinct host row read once per call, replays included).

Which launches run these:

- batch ``<= FLAT_COPY_MAX_BATCH``: prep, insert, place (many programs per row), the plan in miss order, then a flat
  copy with every row in flight (``kvplan.kernels.copy``);
- up to ``PER_ROW_MIN_BATCH``: the same resolve with many programs per row, then a sort and share launch, then the
  ordered copy of host rows and the copy of shared rows;
- from ``PER_ROW_MIN_BATCH``: one program per row takes every stage 1-4 in order (the batch alone fills the GPU, and
  the chained launches and waits of the split resolve cost more than they spread), then the share launch and the
  same copies.

The tables' compare-and-swaps and ``atomic_min``s, the claims and the counters are relaxed atomics: each decides
by one location alone (its atomicity and per-location coherence), and what another program reads of them is ordered
by a later launch or by a count published after a barrier (``_publish``, a release; ``_wait_counts``, acquires), as
for plain stores. The default ``acq_rel`` would fence every round of a probe loop on the program's earlier stores
(H200: 3-7 % of a batch-8 call).

Each result is deterministic (the order of table entries is not, and neither is which entry of a shared host row
reads the host, but nothing observable depends on either). Every state access is masked against its table:
out-of-range ``rid``, tokens, LRU entries and rows never touch memory outside the tensors, with the outcomes the
reference defines.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvplan.calls import SwapInCall, swap_in_call
from kvplan.counters import HITS, OVERFLOW, SWAP_IN_COPY_BASE
from kvplan.kernels.copy import COPY_LAUNCH, FLAT_COPY_LAUNCH, CopyLaunch, launch_copy
from kvplan.kernels.launch_cache import LaunchCache, Recorder, dependent_launch, device_guard
from kvplan.kernels.onchip.launch import launch_resolve as launch_onchip
from kvplan.kernels.planner import plan_swap_in
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import SwapInDims, check_swap_in
from kvplan.workspace import (
    CLEARED,
    CURRENT,
    EMPTIES,
    EPOCH,
    FORMAT,
    HOST_ROW_LIMIT,
    HOT_CHUNK_MIN,
    OCC_CHUNK_MIN,
    PADDING,
    SHARED,
    TAG_PERIOD,
    forget_tables,
    next_pow2,
    swap_in_workspace_columns,
    swap_in_workspace_regions,
)

__all__ = ["ResolveLaunch", "swap_in"]

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_SHARED = tl.constexpr(SHARED)
_CURRENT = tl.constexpr(CURRENT)
_EPOCH = tl.constexpr(EPOCH)
_CLEARED = tl.constexpr(CLEARED)
_FORMAT = tl.constexpr(FORMAT)
_EMPTIES = tl.constexpr(EMPTIES)
_PADDING = tl.constexpr(PADDING)
_TAG_PERIOD = tl.constexpr(TAG_PERIOD)
_HOST_ROW_LIMIT = tl.constexpr(HOST_ROW_LIMIT)
_EPOCH_MASK = tl.constexpr(0x7FFFFFFF)  # epochs count in 31 bits (they wrap; only differences below TAG_PERIOD matter)
_STAMP_SHIFT = tl.constexpr(55)  # a table entry: stamp << 55 | key << 24 | occurrence or plan offset
_KEY_SHIFT = tl.constexpr(24)
_LOW_MASK = tl.constexpr((1 << 24) - 1)
_NO_CLAIM = tl.constexpr((1 << 55) - 1)  # key and low bits all ones: no live entry holds them (see MAX_OCCURRENCES)
_NONE = tl.constexpr(0x7FFFFFFF)  # "no hot slot holds this token" in the table's hot region
_HASH = tl.constexpr(0x61C88647)  # odd multiplier (2**32 / golden ratio, negated): Fibonacci hashing
_HASH_HI = tl.constexpr(0x2545F491)  # a second odd multiplier, for the high word of a host row
_WINDOW = tl.constexpr(8)  # table entries one probe round reads per lane
_TAIL_BLOCK = tl.constexpr(64)  # tail slots compared per iteration of the tail search
_CLEAR_BLOCK = tl.constexpr(512)  # table entries one program clears per iteration
_FLAGS_BLOCK = tl.constexpr(1024)  # per-call flag words prep clears per iteration
SORT_SLICE = 32  # misses one program of the sort launch places
_SORT_SLICE = tl.constexpr(SORT_SLICE)
_SORT_TILE = tl.constexpr(128)  # misses each of them is compared with at a time
_PUBLISHED = tl.constexpr(1 << 30)  # flag bit of a published count
ROW_SORT_MAX = 1024  # one program per row sorts up to this many misses at once (more: the plan stays in miss order)


@attrs.frozen
class ResolveLaunch:
    """Launch shape of the resolve. The split resolve (many programs per row): occurrences and LRU positions per
    program and warps per program; the resolve of one program per row: the same three (``row_*``); which of them
    (``per_row``; ``None``: by ``PER_ROW_MIN_BATCH``), whether the plan is sorted (``sorted_plan``; ``None``: above
    ``FLAT_COPY_MAX_BATCH``), whether a sorted plan's entries share host rows (``shared_rows``; ``None``: when the
    call's table can name every host row and plan offset; ``False`` measures what sharing costs) and which resolve
    runs (``resolve``: ``"onchip"``, ``"triton"``, ``"auto"``; ``None``: ``KVPLAN_RESOLVE``, else auto). The rules
    are ``kvplan.kernels.planner``'s."""

    occ_chunk: int = 128
    hot_chunk: int = 256
    num_warps: int = 8
    row_occ_chunk: int = 1024
    row_hot_chunk: int = 512
    row_warps: int = 16
    per_row: bool | None = None
    sorted_plan: bool | None = None
    shared_rows: bool | None = None
    resolve: str | None = None


RESOLVE_LAUNCH = ResolveLaunch()


class ResolveShape(NamedTuple):
    """A resolve's compile-time sizes, passed to the kernels as one constant."""

    steps: int  # S (1 on the single-step path)
    top_k: int  # K
    hot: int  # HOT LRU slots per request
    tail: int  # P tail slots per request
    occ_chunk: int  # occurrences per chunk
    hot_chunk: int  # LRU positions per chunk (a multiple of 32)
    occ_chunks: int  # chunks per row over the occurrences: cdiv(S*K, occ_chunk)
    hot_chunks: int  # chunks per row over the LRU positions: cdiv(HOT, hot_chunk)
    occ_block: int  # next power of two >= occ_chunks (the occurrence chunks' counts as one block)
    hot_block: int  # next power of two >= hot_chunks (the hot chunks' counts as one block)
    in_order: bool  # one program runs a row's chunks in order (its counts are then read after a barrier, not awaited)


class PlanMode(NamedTuple):
    """How a call's plan is written, as one compile-time constant."""

    sorted: bool  # miss lists in the workspace, sorted into the plan by host row (else the plan in miss order)
    shared: bool  # entries claim their host rows in the call's table (needs ``sorted``)
    apart: bool  # (single-step, sorted) the plan in miss order, its host-row order in the workspace for the copy


class BatchIndexing(NamedTuple):
    """How the batch rows are indexed: the kernels' ``batch_indexing`` argument, after ``rpi_ptr, seq_ptr,
    num_real_ptr`` (read by ``_row_of``), passed as a plain tuple of four runtime ints."""

    rpi_stride: int  # req_pool_indices stride
    seq_stride: int  # seq_lens stride
    batch: int  # B
    requests: int  # R: request slots of the state tables


class ResolveArgs(NamedTuple):
    """A checked call's resolve launches, prepared once by ``_launch_swap_in`` for the launchers beside each kernel."""

    call: SwapInCall
    dims: SwapInDims
    tokens: torch.Tensor  # [B, S, K] top_k_tokens (S = 1 on the single-step path)
    out: torch.Tensor  # [B, S, K] top_k_device_locs
    num_real: torch.Tensor  # num_real_reqs, or an unread stand-in (a valid tensor)
    batch_indexing: tuple  # BatchIndexing, as the plain tuple the kernels take
    tables: tuple  # dbt, dbl, lru, hcl, scratch, their row strides, (max_len, scratch): as _place_kernel's
    plan: MissPlan
    ws32: torch.Tensor  # the workspace as int32 words (any int32 tensor when S*K == 0)
    ws_stride: int
    counters: torch.Tensor  # counters, or an unread stand-in
    kv_rows: tuple  # (rows of host_cache, rows of device_buffer)
    shape: ResolveShape
    layout: tuple  # kvplan.kernels.workspace.WorkspaceRegions
    mode: PlanMode
    warps: int
    pdl: bool  # launches after the call's first may start early (dependent_launch)

    def flags(self) -> dict:
        """The compile-time flags of the prep, place and one-program-per-row launches."""
        has_num_real = self.call.num_real_reqs is not None
        return dict(SHAPE=self.shape, LAYOUT=self.layout, MODE=self.mode, HAS_NUM_REAL=has_num_real,
                    num_warps=self.warps)  # fmt: skip

    def early(self) -> dict:
        """A launch that follows another of the call: it may start early, waiting in the kernel (Hopper and later)."""
        return dict(PDL=self.pdl, launch_pdl=self.pdl)


# ---------------------------------------------------------------------------------------------------------------------
# Hash table of a row's wanted tokens: int64 entries ``stamp << 55 | token << 24 | first occurrence`` (tokens >= 0);
# an entry of another stamp (an earlier call's, the host-row table's, or -1) is free. Linear probing, nothing deleted
# within a call. The stamp: 7 bits of the row's epoch, then which table (0 tokens, 1 host rows).


@triton.jit
def _stamp(ws, TABLE: tl.constexpr):
    """This call's stamp of workspace row ``ws``'s table entries (int64): its epoch's tag, then ``TABLE``."""
    epoch = tl.load(ws + _CURRENT).to(tl.int64)
    return ((epoch % _TAG_PERIOD) << 1) | TABLE


@triton.jit
def _format_word(ws_stride, LAYOUT: tl.constexpr):
    """``kvplan.workspace.format_word``: the layout's signature and the row stride."""
    return LAYOUT.signature ^ (ws_stride & 0x3FFFFFFF)


@triton.jit
def _hash(token, LOG_TB: tl.constexpr):
    """Fibonacci hash of int32 tokens to ``[0, 2**LOG_TB)``: the top bits of ``token * _HASH`` (mod 2**32)."""
    mixed = (token * _HASH).to(tl.uint32, bitcast=True)
    return (mixed >> (32 - LOG_TB)).to(tl.int32)


@triton.jit
def _table_insert(keys_ptr, token, occ, active, stamp, LOG_TB: tl.constexpr):
    """Insert ``token`` with occurrence ``occ`` for every active lane, under ``stamp``. Returns each lane's entry (-1
    inactive) and whether the lane claimed it (one lane per entry). Lanes of one token share its entry, which keeps
    their smallest occurrence. Each round reads a window of entries (a claimed entry never changes token, so a token
    or a free entry seen there is final up to the compare-and-swap that claims it, which expects the free value
    seen)."""
    packed = (stamp << _STAMP_SHIFT) | (token.to(tl.int64) << _KEY_SHIFT) | occ.to(tl.int64)
    key = packed >> _KEY_SHIFT  # stamp and token: what a live entry of this token holds above its occurrence
    no_claim = (stamp << _STAMP_SHIFT) | _NO_CLAIM
    w = tl.arange(0, _WINDOW)
    wrap = (1 << LOG_TB) - 1
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    claimed_any = token < -1  # all False
    pending = active
    # a round finishes a lane, moves it a window on, or (a lost claim) moves it onto an entry claimed this call: a
    # table of live entries only (written between calls) ends the search, the lane unplaced, after 2 * TB rounds
    rounds = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (rounds < (2 << LOG_TB)):
        rounds += 1
        cur = tl.load(keys_ptr + ((pos[:, None] + w[None, :]) & wrap), mask=pending[:, None], other=-1,
                      cache_modifier=".cg")  # fmt: skip
        live = (cur >> _STAMP_SHIFT) == stamp
        stop = ((cur >> _KEY_SHIFT) == key[:, None]) | ~live
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        at = (pos + first) & wrap
        seen = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        trying = pending & (first < _WINDOW)
        empty = trying & ((seen >> _STAMP_SHIFT) != stamp)
        # lanes not claiming compare against no_claim, which no entry holds: their compare-and-swap writes nothing
        old = tl.atomic_cas(keys_ptr + at, tl.where(empty, seen, no_claim), packed, sem="relaxed")
        claimed = empty & (old == seen)
        same = (trying & ~empty) | (empty & ~claimed & ((old >> _KEY_SHIFT) == key))
        holder = tl.where(empty, old, seen)
        tl.atomic_min(keys_ptr + at, packed, mask=same & ((holder & _LOW_MASK) > occ), sem="relaxed")
        done = claimed | same
        entry = tl.where(done, at, entry)
        claimed_any = claimed_any | claimed
        lost = empty & ~done  # another token took the free entry first: look again from there
        pos = tl.where(pending & ~trying, pos + _WINDOW, tl.where(lost, at, pos))
        pending = pending & ~done
    return entry, claimed_any


@triton.jit
def _table_find(keys_ptr, token, active, stamp, LOG_TB: tl.constexpr):
    """The entry holding ``token`` under ``stamp`` for every active lane, -1 when absent (the table is complete: read
    only)."""
    key = (stamp << (_STAMP_SHIFT - _KEY_SHIFT)) | token.to(tl.int64)
    w = tl.arange(0, _WINDOW)
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    pending = active
    rounds = 0  # one pass over the table at most (a table of live entries only was written between calls)
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (rounds < ((1 << LOG_TB) + _WINDOW - 1) // _WINDOW):
        rounds += 1
        idx = (pos[:, None] + w[None, :]) & ((1 << LOG_TB) - 1)
        cur = tl.load(keys_ptr + idx, mask=pending[:, None], other=-1, cache_modifier=".cg")
        stop = ((cur >> _KEY_SHIFT) == key[:, None]) | ((cur >> _STAMP_SHIFT) != stamp)
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        value = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        found = pending & (first < _WINDOW) & ((value >> _STAMP_SHIFT) == stamp)
        entry = tl.where(found, (pos + first) & ((1 << LOG_TB) - 1), entry)
        pending = pending & (first == _WINDOW)
        pos += _WINDOW
    return entry


# ---------------------------------------------------------------------------------------------------------------------
# Counts published between programs of the place launch (a flag bit marks a published count)


@triton.jit
def _publish(ptr, value, IN_ORDER: tl.constexpr):
    """Publish ``value`` at ``ptr`` after everything this program wrote (a barrier, then a release; a plain store
    when one program runs the row's chunks in order: only its own threads read it, after a barrier)."""
    tl.debug_barrier()
    # (the tensor first: Triton 3.7-3.9's interpreter turns ``constexpr | tensor`` into a constexpr it cannot store)
    if IN_ORDER:
        tl.store(ptr, value | _PUBLISHED)
    else:
        tl.atomic_xchg(ptr, value | _PUBLISHED, sem="release")


@triton.jit
def _wait_counts(ptr, count, NB: tl.constexpr, IN_ORDER: tl.constexpr):
    """Wait until ``ptr[0:count]`` are all published (they are written by programs with lower tickets, which have
    started and never wait on this one; in order, by this program before); returns them (0 past ``count``)."""
    idx = tl.arange(0, NB)
    inside = idx < count
    if IN_ORDER:
        tl.debug_barrier()  # this program's own earlier chunks published them
        values = tl.load(ptr + idx, mask=inside, other=0, cache_modifier=".cg")
    else:
        values = tl.atomic_add(ptr + idx, 0, mask=inside, sem="acquire")
        while tl.min(tl.where(inside, values & _PUBLISHED, _PUBLISHED), axis=0) == 0:
            values = tl.atomic_add(ptr + idx, 0, mask=inside, sem="acquire")
        tl.debug_barrier()  # threads that did not acquire themselves read the published data after this
    return tl.where(inside, values & ~_PUBLISHED, 0)


@triton.jit
def _lookup(table, index):
    """``table[index]`` for a small 1-D ``table``. A one-element table is broadcast rather than gathered: Triton 3.6
    fails to compile some kernels that gather from one element (a layout pass breaks dominance)."""
    if table.shape[0] == 1:
        return tl.zeros(index.shape, table.dtype) + tl.sum(table, axis=0)
    return tl.gather(table, index, 0)


@triton.jit
def _popcount(x):
    """Set bits of each int32 word (SWAR, no intrinsic: the interpreter runs it too)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _select_bit(word, rank):
    """Position of the ``rank``-th (0-based) set bit of each int32 word (rank < popcount)."""
    u = word.to(tl.uint32, bitcast=True)
    pos = tl.zeros(word.shape, tl.int32)
    for width in tl.static_range(4, -1, -1):
        half = 1 << width
        low = _popcount((u & ((1 << half) - 1)).to(tl.int32, bitcast=True))
        up = rank >= low
        rank = tl.where(up, rank - low, rank)
        pos = tl.where(up, pos + half, pos)
        u = tl.where(up, u >> half, u)
    return pos


@triton.jit
def _words(ws, offset, dtype: tl.constexpr):
    """A workspace region (``offset`` int32 words into the row) as ``dtype`` elements."""
    return (ws + offset).to(tl.pointer_type(dtype), bitcast=True)


@triton.jit
def _clear_table(ws, part, parts, LAYOUT: tl.constexpr):
    """Empty share ``part`` of ``parts`` of a row's token table (entries ``-1``), blocks of ``_CLEAR_BLOCK`` apart."""
    TB: tl.constexpr = LAYOUT.table_size
    keys = _words(ws, LAYOUT.keys, tl.int64)
    start = part * _CLEAR_BLOCK
    while start < TB:
        e = start + tl.arange(0, _CLEAR_BLOCK)
        tl.store(keys + e, tl.full([_CLEAR_BLOCK], -1, tl.int64), mask=e < TB)
        start += parts * _CLEAR_BLOCK


@triton.jit
def _begin_epoch(ws_ptr, ws, ws_stride, first, live, LAYOUT: tl.constexpr):
    """Prep: the row's next epoch, and whether its table must be emptied (its tags could repeat, or its words or row
    0's do not vouch for it: ``kvplan.workspace``). Reads only words the later stages write; chunk ``first``
    publishes both (row words ``CURRENT`` and ``EMPTIES``) with the row words it zeroes, and marks a row that is not
    ``live`` as padding (row word ``SHARED``: the copies skip it, whatever its plan row holds)."""
    epoch = (tl.load(ws + _EPOCH).to(tl.int64) + 1) & _EPOCH_MASK
    age = (epoch - tl.load(ws + _CLEARED).to(tl.int64)) & _EPOCH_MASK
    vouched = (tl.load(ws + _FORMAT) == _format_word(ws_stride, LAYOUT)) & (
        tl.load(ws_ptr + _FORMAT) == _format_word(ws_stride, LAYOUT)
    )
    empties = ~vouched | (age == 0) | (age >= _TAG_PERIOD)
    if first:
        # the row words: no shared entries, the copy's work counter at zero (row 0), this call's epoch and decision
        w = tl.arange(0, 8)
        words = tl.where(w == _CURRENT, epoch.to(tl.int32), tl.where(w == _EMPTIES, empties.to(tl.int32), 0))
        words = tl.where((w == _SHARED) & ~live, _PADDING, words)
        tl.store(ws + w, words, mask=(w <= _CURRENT) | (w == _EMPTIES))
    return empties


@triton.jit
def _end_epoch(ws, ws_stride, vouch, LAYOUT: tl.constexpr):
    """After every prep program of the row has read its words: the epoch the row used, when its table was last
    emptied, and (``vouch``) the format word that vouches for the table from now on. Row 0's format word is read by
    every row's prep: it is written only once every prep program of the call has run."""
    epoch = tl.load(ws + _CURRENT)
    if tl.load(ws + _EMPTIES) != 0:
        tl.store(ws + _CLEARED, epoch)
    tl.store(ws + _EPOCH, epoch)
    if vouch:
        tl.store(ws + _FORMAT, _format_word(ws_stride, LAYOUT))


@triton.jit
def _row_of(
    b,  # the batch row
    rpi_ptr,  # [>= B] req_pool_indices (int32/int64), stride batch_indexing[0]
    seq_ptr,  # [>= B*S] seq_lens (int32/int64), stride batch_indexing[1]; step s of row b at b*S + s
    num_real_ptr,  # [1] int32 num_real_reqs (read when HAS_NUM_REAL)
    batch_indexing,  # BatchIndexing (req_pool_indices stride, seq_lens stride, B, R): every kernel passes it so
    S: tl.constexpr,
    HOT: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
):
    """Batch row ``b``: its request ``rid``, whether it is real (``live``: below ``num_real_reqs``, ``rid`` inside the
    pool), its last step's length, and whether it is a long row (``len > HOT``, resolved through the table)."""
    rpi_stride, seq_stride, batch, num_requests = batch_indexing
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    b64 = b.to(tl.int64)
    rid = tl.load(rpi_ptr + b64 * rpi_stride).to(tl.int64)
    live = (b < n_real) & (rid >= 0) & (rid < num_requests)
    last_len = tl.load(seq_ptr + (b64 * S + S - 1) * seq_stride).to(tl.int64)  # S = 1: row b's length
    return rid, live, last_len, live & (last_len > HOT)


# ---------------------------------------------------------------------------------------------------------------------
# The stages of one chunk, shared by the split kernels and the one-program-per-row kernel


@triton.jit
def _prep_chunk(
    c,  # the occurrence chunk
    b,  # the batch row
    tokens_ptr,
    tok_strides,  # [B, S, K] int32 top_k_tokens (S = 1 on the single-step path) and its strides
    out_ptr,
    out_strides,  # [B, S, K] int32 top_k_device_locs (written) and its strides
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    dbt_ptr,
    dbl_ptr,
    state_stride,  # [R, HOT + P] int32 device_buffer_tokens, _locs; their row stride
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows (not touched when S*K == 0); their row stride
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # kvplan.workspace.WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    HAS_NUM_REAL: tl.constexpr,
):
    """Everything that needs no table; this call's counts and the row words cleared, the row's epoch begun (its table
    emptied when that says so); wanted occurrences marked -2."""
    S: tl.constexpr = SHAPE.steps
    K: tl.constexpr = SHAPE.top_k
    HOT: tl.constexpr = SHAPE.hot
    P: tl.constexpr = SHAPE.tail
    CH: tl.constexpr = SHAPE.occ_chunk
    NOC: tl.constexpr = SHAPE.occ_chunks
    N: tl.constexpr = S * K
    rid, live, last_len, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing, S, HOT, HAS_NUM_REAL)
    b64 = b.to(tl.int64)
    dbt_row = dbt_ptr + rid * state_stride
    dbl_row = dbl_ptr + rid * state_stride
    occ = c * CH + tl.arange(0, CH)
    in_occ = occ < N
    if K > 0:
        step, col = occ // K, occ % K
    else:  # no occurrences (every lane masked): no division by zero
        step, col = occ, occ
    out_ptrs = out_ptr + b64 * out_strides[0] + step * out_strides[1] + col * out_strides[2]
    tok = tl.load(tokens_ptr + b64 * tok_strides[0] + step * tok_strides[1] + col * tok_strides[2], mask=in_occ,
                  other=-1)  # fmt: skip
    if SPEC:
        step_len = tl.load(seq_ptr + (b64 * S + step) * batch_indexing[1], mask=in_occ, other=0).to(tl.int64)
    else:
        step_len = last_len
    valid = in_occ & (tok >= 0) & (tok < step_len)
    if N > 0:
        ws = ws_ptr + b64 * ws_stride
        # every row's table (part of the call's host-row table when shared), emptied only when its epoch says so
        if _begin_epoch(ws_ptr, ws, ws_stride, c == 0, live, LAYOUT):
            _clear_table(ws, c, NOC, LAYOUT)
    if not live:
        # padding row (or a rid outside the pool, handled as one): §3 writes 0 and a zero count, §2 only -1
        if SPEC:
            tl.store(out_ptrs, tl.zeros([CH], tl.int32), mask=in_occ)
            if c == 0:
                tl.store(count_ptr + b, 0)
        else:
            tl.store(out_ptrs, tl.full([CH], -1, tl.int32), mask=in_occ)
    elif not long_row:
        # short row: token t lives at slot t
        if SPEC:
            usable = valid & (tok < HOT + P)
        else:
            usable = valid & (occ < last_len)
        tl.store(out_ptrs, tl.load(dbl_row + tok, mask=usable, other=-1), mask=in_occ)
        if c == 0:
            tl.store(count_ptr + b, 0)
    elif N == 0:
        # nothing to resolve: no misses, the LRU order unchanged (the workspace has no columns)
        if c == 0:
            tl.store(count_ptr + b, 0)
    else:
        if SPEC:
            # the tail: the lowest tail slot j holding t with a real row
            lowest = tl.full([CH], P, tl.int32)
            for j0 in tl.static_range(0, P, _TAIL_BLOCK):
                j = j0 + tl.arange(0, _TAIL_BLOCK)
                tail_tok = tl.load(dbt_row + HOT + j, mask=j < P, other=-1)
                tail_live = (j < P) & (tail_tok >= 0) & (tl.load(dbl_row + HOT + j, mask=j < P, other=-1) >= 0)
                match = (tok[:, None] == tail_tok[None, :]) & tail_live[None, :]
                lowest = tl.minimum(lowest, tl.min(tl.where(match, j[None, :], P), axis=1))
            resolved = valid & (lowest < P)
            pre = tl.load(dbl_row + HOT + lowest, mask=resolved, other=-1)
        else:
            # the newest token lives at slot HOT
            resolved = valid & (tok == last_len - 1)
            pre = tl.zeros([CH], tl.int32) + tl.load(dbl_row + HOT)
        wanted = valid & ~resolved
        tl.store(out_ptrs, tl.where(resolved, pre, -1), mask=in_occ & ~wanted)
        tl.store(ws + LAYOUT.occ_entry + occ, tl.where(wanted, -2, -1), mask=in_occ)
        # (the table's hot region is set by whoever claims an entry)
        if c == 0:
            # every count and flag unpublished, the ticket counter at zero
            FLAGS: tl.constexpr = LAYOUT.old_lru - LAYOUT.sync
            for f0 in tl.static_range(0, FLAGS, _FLAGS_BLOCK):
                f = f0 + tl.arange(0, _FLAGS_BLOCK)
                tl.store(ws + LAYOUT.sync + f, tl.zeros([_FLAGS_BLOCK], tl.int32), mask=f < FLAGS)


@triton.jit
def _insert_chunk(
    c,  # the occurrence chunk
    b,  # the batch row (a long row)
    tokens_ptr,
    tok_strides,  # [B, S, K] int32 top_k_tokens and its strides
    ws,  # this row's workspace (the table)
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
):
    """Wanted occurrences into the row's table; each records its entry, each claimer clears the entry's hot word."""
    K: tl.constexpr = SHAPE.top_k
    CH: tl.constexpr = SHAPE.occ_chunk
    N: tl.constexpr = SHAPE.steps * K
    b64 = b.to(tl.int64)
    occ = c * CH + tl.arange(0, CH)
    wanted = (occ < N) & (tl.load(ws + LAYOUT.occ_entry + occ, mask=occ < N, other=-1) == -2)
    tok = tl.load(tokens_ptr + b64 * tok_strides[0] + (occ // K) * tok_strides[1] + (occ % K) * tok_strides[2],
                  mask=wanted, other=0)  # fmt: skip
    LOG_TB: tl.constexpr = LAYOUT.table_size.bit_length() - 1
    entry, claimed = _table_insert(_words(ws, LAYOUT.keys, tl.int64), tok, occ, wanted, _stamp(ws, 0), LOG_TB)
    tl.store(ws + LAYOUT.occ_entry + occ, entry, mask=wanted)
    tl.store(ws + LAYOUT.hot + entry, tl.full([CH], _NONE, tl.int32), mask=claimed)


@triton.jit
def _hot_chunk(dbt_row, lru_row, ws, hc, SHAPE: tl.constexpr, LAYOUT: tl.constexpr):
    """Place stage, hot chunk ``hc``: LRU positions look their slot's token up; hits recorded and counted; the
    old LRU order kept in the workspace (the finish programs rewrite ``lru_slots`` while others still need it)."""
    HOT: tl.constexpr = SHAPE.hot
    HCH: tl.constexpr = SHAPE.hot_chunk
    LOG_TB: tl.constexpr = LAYOUT.table_size.bit_length() - 1
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    raw = tl.load(lru_row + j, mask=in_hot, other=-1)
    tl.store(_words(ws, LAYOUT.old_lru, tl.int16) + j, raw, mask=in_hot)
    slot = raw.to(tl.int32)
    slot_live = in_hot & (slot >= 0) & (slot < HOT)
    token = tl.load(dbt_row + slot, mask=slot_live, other=-1)
    entry = _table_find(_words(ws, LAYOUT.keys, tl.int64), token, slot_live & (token >= 0), _stamp(ws, 0), LOG_TB)
    hit = entry >= 0
    tl.atomic_min(ws + LAYOUT.hot + entry, (j << 16) | slot, mask=hit, sem="relaxed")
    # the chunk's hit bits: one int32 word per 32 positions (distinct bits, so their sum is their OR)
    bits = tl.where(hit, 1, 0) << (j % 32)
    words = tl.sum(tl.reshape(bits, [HCH // 32, 32]), axis=1)
    tl.store(ws + LAYOUT.hit_bits + hc * (HCH // 32) + tl.arange(0, HCH // 32), words)
    _publish(ws + LAYOUT.hot_counts + hc, tl.sum((in_hot & ~hit).to(tl.int32), axis=0), SHAPE.in_order)


@triton.jit
def _evictable(ws, m, n_evict_before, hot_counts, active, HOT: tl.constexpr, HCH: tl.constexpr, HIT_BITS: tl.constexpr):
    """LRU position of the ``m``-th evictable (0-based, LRU order) for active lanes: its hot chunk by the chunks'
    counts, its word by the words' evictable bits, its bit by a select."""
    WPC: tl.constexpr = HCH // 32
    chunk = tl.sum(tl.where(n_evict_before[None, :] + hot_counts[None, :] <= m[:, None], 1, 0), axis=1)
    rank = m - _lookup(n_evict_before, tl.where(active, chunk, 0))
    w = tl.arange(0, WPC)
    word_index = chunk[:, None] * WPC + w[None, :]
    hits = tl.load(ws + HIT_BITS + word_index, mask=active[:, None], other=-1, cache_modifier=".cg")
    # positions past HOT in the row's last word are not positions: mask them out
    valid_bits = tl.minimum(tl.maximum(HOT - word_index * 32, 0), 32).to(tl.int64)
    in_hot = ((tl.full(valid_bits.shape, 1, tl.int64) << valid_bits) - 1).to(tl.int32)
    evict_words = ~hits & in_hot
    counts = _popcount(evict_words)
    ends = tl.cumsum(counts, axis=1)
    which = tl.sum(tl.where(ends <= rank[:, None], 1, 0), axis=1)
    picked = w[None, :] == which[:, None]
    word = tl.sum(tl.where(picked, evict_words, 0), axis=1)
    skipped = tl.sum(tl.where(picked, ends - counts, 0), axis=1)
    return chunk * HCH + which * 32 + _select_bit(word, rank - skipped)


@triton.jit
def _occurrence_chunk(
    tok_row,  # this batch row of top_k_tokens ([S, K], strides tok_strides[1:])
    tok_strides,
    out_row,  # this batch row of top_k_device_locs
    out_strides,
    dbt_row,  # [HOT + P] this request's device_buffer_tokens
    dbl_row,  # [HOT + P] this request's device_buffer_locs
    hcl_row,  # [max_len] this request's host_cache_locs
    max_len,
    scratch_row,  # [scratch] this request's scratch_locs
    scratch_cols,
    src_row,  # [>= S*K] int64 this batch row's miss_src (written unless MODE.sorted)
    dst_row,  # [>= S*K] int32 this batch row's miss_dst (written unless MODE.sorted)
    ws,  # this row's workspace
    counters_ptr,
    oc,
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    MODE: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Place stage, occurrence chunk ``oc``: misses ranked, slots and rows chosen, outputs and the plan entries (or the
    miss lists the sort reads) written."""
    K: tl.constexpr = SHAPE.top_k
    N: tl.constexpr = SHAPE.steps * K
    HOT: tl.constexpr = SHAPE.hot
    CH: tl.constexpr = SHAPE.occ_chunk
    # every hot chunk looked up
    hot_counts = _wait_counts(ws + LAYOUT.hot_counts, SHAPE.hot_chunks, SHAPE.hot_block, SHAPE.in_order)
    n_evict = tl.sum(hot_counts, axis=0)
    n_evict_before = tl.cumsum(hot_counts, axis=0) - hot_counts
    occ = oc * CH + tl.arange(0, CH)
    in_occ = occ < N
    entry = tl.load(ws + LAYOUT.occ_entry + occ, mask=in_occ, other=-1)
    wanted = entry >= 0
    keys = _words(ws, LAYOUT.keys, tl.int64)
    first_occ = (tl.load(keys + entry, mask=wanted, other=-1, cache_modifier=".cg") & _LOW_MASK).to(tl.int32)
    held_by = tl.load(ws + LAYOUT.hot + entry, mask=wanted, other=_NONE, cache_modifier=".cg")
    held = wanted & (held_by != _NONE)
    # misses at their first occurrence: backed ones ranked within the chunk
    first = wanted & (first_occ == occ)
    miss = first & ~held
    tok = tl.load(tok_row + (occ // K) * tok_strides[1] + (occ % K) * tok_strides[2], mask=wanted, other=0)
    host = tl.load(hcl_row + tok, mask=miss & (tok < max_len), other=-1)
    flag = (miss & (host >= 0)).to(tl.int32)
    in_chunk = tl.cumsum(flag, axis=0) - flag
    tl.store(ws + LAYOUT.miss_rank + occ, tl.where(flag != 0, in_chunk, -1), mask=in_occ)
    _publish(ws + LAYOUT.occ_counts + oc, tl.sum(flag, axis=0), SHAPE.in_order)
    if HAS_COUNTERS:
        hits = tl.sum((first & held).to(tl.int32), axis=0)
        if hits > 0:
            tl.atomic_add(counters_ptr + _HITS, hits.to(tl.int64), sem="relaxed")
    # ranks in first-occurrence order: the misses of lower chunks first (a token's first occurrence is never in a
    # later chunk than its other occurrences)
    occ_counts = _wait_counts(ws + LAYOUT.occ_counts, oc, SHAPE.occ_block, SHAPE.in_order)
    missed = wanted & ~held
    rank_there = tl.load(ws + LAYOUT.miss_rank + first_occ, mask=missed, other=-1, cache_modifier=".cg")
    backed = missed & (rank_there >= 0)
    occ_before = tl.cumsum(occ_counts, axis=0) - occ_counts  # exact for chunks <= oc, which is all we read
    m = _lookup(occ_before, tl.where(backed, first_occ // CH, 0)) + rank_there
    admitted = backed & (m < n_evict)
    if SPEC:
        placed_n = n_evict + scratch_cols
    else:
        placed_n = n_evict
    placed = backed & (m < placed_n)
    position = _evictable(ws, m, n_evict_before, hot_counts, admitted, HOT, SHAPE.hot_chunk, LAYOUT.hit_bits)
    old_lru = _words(ws, LAYOUT.old_lru, tl.int16)
    fill = tl.load(old_lru + position, mask=admitted, other=-1, cache_modifier=".cg").to(tl.int32)
    fill_ok = admitted & (fill >= 0) & (fill < HOT)
    miss_loc = tl.load(dbl_row + fill, mask=fill_ok, other=-1)
    if SPEC:
        scratched = placed & ~admitted
        miss_loc = tl.where(scratched, tl.load(scratch_row + (m - n_evict), mask=scratched, other=-1), miss_loc)
    # (a slot past HOT only in a workspace written between calls: read nothing for it)
    held_slot = held_by & 0xFFFF
    hit_loc = tl.load(dbl_row + held_slot, mask=held & (held_slot < HOT), other=-1)
    loc = tl.where(held, hit_loc, tl.where(placed, miss_loc, -1))
    tl.store(out_row + (occ // K) * out_strides[1] + (occ % K) * out_strides[2], loc, mask=wanted)
    # the token's first occurrence records the miss (host and device row at its rank) and the filled slot's token:
    # in the plan itself when it stays in miss order, else in the miss lists that the sort writes into the plan
    owner = placed & first
    if MODE.sorted:
        miss_host, miss_dst = _words(ws, LAYOUT.miss_host, tl.int64), ws + LAYOUT.miss_loc
    else:
        miss_host, miss_dst = src_row, dst_row
    tl.store(miss_host + m, host, mask=owner)
    tl.store(miss_dst + m, loc, mask=owner)
    tl.store(dbt_row + fill, tok, mask=owner & fill_ok)


@triton.jit
def _finish_chunk(
    lru_row,  # [HOT] this request's lru_slots (rewritten)
    count_at,  # this batch row's miss_count
    ws,  # this row's workspace
    counters_ptr,
    scratch_cols,
    hc,
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    MODE: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Place stage, last tickets: hot chunk ``hc``'s positions move to the new order evictables[M:] ++
    evictables[:M] ++ hits, once every occurrence chunk has counted its misses (``M`` needs them all). The old
    order is read from the workspace copy, so chunks rewrite ``lru_slots`` in place without waiting on each other.
    Every lookup in the row's table is over by then (the call's table of host rows takes it over, under the other
    stamp)."""
    HOT: tl.constexpr = SHAPE.hot
    HCH: tl.constexpr = SHAPE.hot_chunk
    HB: tl.constexpr = SHAPE.hot_block
    hot_counts = _wait_counts(ws + LAYOUT.hot_counts, SHAPE.hot_chunks, HB, SHAPE.in_order)
    n_evict = tl.sum(hot_counts, axis=0)
    n_backed = tl.sum(_wait_counts(ws + LAYOUT.occ_counts, SHAPE.occ_chunks, SHAPE.occ_block, SHAPE.in_order), axis=0)
    admitted_n = tl.minimum(n_backed, n_evict)
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    evict = in_hot & ~(((tl.load(ws + LAYOUT.hit_bits + j // 32, cache_modifier=".cg") >> (j % 32)) & 1) != 0)
    evict_i = evict.to(tl.int32)
    evict_rank = tl.sum(tl.where(tl.arange(0, HB) < hc, hot_counts, 0), axis=0) + tl.cumsum(evict_i, axis=0) - evict_i
    new_pos = tl.where(
        evict,
        tl.where(evict_rank >= admitted_n, evict_rank - admitted_n, n_evict - admitted_n + evict_rank),
        n_evict + j - evict_rank,
    )
    slot = tl.load(_words(ws, LAYOUT.old_lru, tl.int16) + j, mask=in_hot, other=0, cache_modifier=".cg")
    tl.store(lru_row + new_pos, slot, mask=in_hot)
    if SPEC:
        placed_n = admitted_n + tl.minimum(n_backed - admitted_n, scratch_cols)
    else:
        placed_n = admitted_n
    if hc == 0:
        tl.store(count_at, placed_n)
        if HAS_COUNTERS:
            overflow = n_backed - placed_n
            if overflow > 0:
                tl.atomic_add(counters_ptr + _OVERFLOW, overflow.to(tl.int64), sem="relaxed")


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


# ---------------------------------------------------------------------------------------------------------------------
# The split resolve: prep, insert and place launches of many programs per row


_PREP_INTS = ["tok_strides", "out_strides", "batch_indexing", "state_stride", "ws_stride"]


@triton.jit(do_not_specialize=_PREP_INTS)
def _prep_kernel(
    tokens_ptr,
    tok_strides,
    out_ptr,
    out_strides,  # top_k_tokens, top_k_device_locs (_prep_chunk says what each is)
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    dbt_ptr,
    dbl_ptr,
    state_stride,  # [R, HOT + P] int32 device_buffer_tokens, _locs; their row stride
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows (not touched when S*K == 0); their row stride
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    HAS_NUM_REAL: tl.constexpr,
):
    """Grid ``_prep_grid``, ``(occ_chunks, B)``: the prep stage of chunk ``program_id(0)`` of row ``program_id(1)``."""
    _prep_chunk(
        tl.program_id(0), tl.program_id(1), tokens_ptr, tok_strides, out_ptr, out_strides, rpi_ptr, seq_ptr,
        num_real_ptr, batch_indexing, dbt_ptr, dbl_ptr, state_stride, count_ptr, ws_ptr, ws_stride, SPEC, SHAPE, LAYOUT,
        MODE, HAS_NUM_REAL,
    )  # fmt: skip


def _prep_grid(shape: ResolveShape, batch: int) -> tuple[int, int]:
    """Axis 0: occurrence chunk, axis 1: batch row."""
    return (shape.occ_chunks, batch)


def _launch_prep(recorder: Recorder, a: ResolveArgs) -> None:
    """The split resolve's first launch (it never starts early: nothing of the call runs before it)."""
    call = a.call
    recorder.launch(
        _prep_kernel, _prep_grid(a.shape, a.dims.batch),
        a.tokens, a.tokens.stride(), a.out, a.out.stride(), call.req_pool_indices, call.seq_lens, a.num_real,
        a.batch_indexing, call.device_buffer_tokens, call.device_buffer_locs, call.device_buffer_tokens.stride(0),
        a.plan.count, a.ws32, a.ws_stride,
        SPEC=call.speculative, **a.flags(),
    )  # fmt: skip


_INSERT_INTS = ["tok_strides", "batch_indexing", "ws_stride"]


@triton.jit(do_not_specialize=_INSERT_INTS)
def _insert_kernel(
    tokens_ptr,
    tok_strides,  # [B, S, K] int32 top_k_tokens and its strides
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows (the table); their row stride
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    HAS_NUM_REAL: tl.constexpr,
    PDL: tl.constexpr,  # launched to start early (dependent_launch): wait for the prep launch before any access
):
    """Grid ``_prep_grid``, ``(occ_chunks, B)``: the insert stage of chunk ``program_id(0)`` of row
    ``program_id(1)`` (long rows); chunk 0 of every row ends the row's epoch bookkeeping (every prep program has
    read its words by now)."""
    if PDL:
        gdc_wait()
    b = tl.program_id(1)
    ws = ws_ptr + b.to(tl.int64) * ws_stride
    if tl.program_id(0) == 0:
        _end_epoch(ws, ws_stride, True, LAYOUT)
    _, _, _, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL)
    if long_row:
        _insert_chunk(tl.program_id(0), b, tokens_ptr, tok_strides, ws, SHAPE, LAYOUT)


def _launch_insert(recorder: Recorder, a: ResolveArgs) -> None:
    """The split resolve's insert launch (after prep; only with occurrences)."""
    call = a.call
    recorder.launch(
        _insert_kernel, _prep_grid(a.shape, a.dims.batch),  # (prep's grid: a program per chunk and row)
        a.tokens, a.tokens.stride(), call.req_pool_indices, call.seq_lens, a.num_real, a.batch_indexing, a.ws32,
        a.ws_stride,
        SHAPE=a.shape, LAYOUT=a.layout, HAS_NUM_REAL=call.num_real_reqs is not None, num_warps=a.warps, **a.early(),
    )  # fmt: skip


_PLACE_INTS = [
    "tok_strides", "out_strides", "batch_indexing", "table_strides", "table_sizes", "plan_stride", "ws_stride"
]  # fmt: skip


@triton.jit(do_not_specialize=_PLACE_INTS)
def _place_kernel(
    tokens_ptr,
    tok_strides,  # [B, S, K] int32 top_k_tokens and its strides
    out_ptr,
    out_strides,  # [B, S, K] int32 top_k_device_locs (written) and its strides
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    dbt_ptr,  # [R, HOT + P] int32 device_buffer_tokens, row stride table_strides[0]
    dbl_ptr,  # [R, HOT + P] int32 device_buffer_locs, row stride table_strides[0]
    lru_ptr,  # [R, HOT] int16 lru_slots, row stride table_strides[1]
    hcl_ptr,  # [R, max_len] int64 host_cache_locs, row stride table_strides[2]
    scratch_ptr,  # [R, scratch] int32 scratch_locs, row stride table_strides[3] (read when SPEC)
    table_strides,
    table_sizes,  # the four row strides above; (max_len, scratch)
    src_ptr,
    dst_ptr,
    plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst (written unless MODE.sorted)
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows; their row stride
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    PDL: tl.constexpr,  # launched to start early: wait for the insert launch before any access
):
    """Grid ``_place_grid``, ``(hot_chunks + occ_chunks + hot_chunks, B)``: the place stage of row ``program_id(1)``.
    Axis 0 only counts the row's programs: a program of a long row takes the row's next ticket (the workspace's
    ticket counter, which prep zeroed) and runs that role, so each waits only on programs that have started. Tickets
    below ``hot_chunks`` are hot chunks (``_hot_chunk``), the next ``occ_chunks`` occurrence chunks
    (``_occurrence_chunk``), the last ``hot_chunks`` finish chunks (``_finish_chunk``). Programs of other rows return.

    Read: ``top_k_tokens`` (wanted occurrences), the batch rows, request ``rid``'s ``device_buffer_tokens``,
    ``device_buffer_locs``, ``lru_slots``, ``host_cache_locs`` and ``scratch_locs`` (``SPEC``), the row's workspace
    (its table, occurrence entries, published counts).
    Written: ``top_k_device_locs`` of the wanted occurrences; ``device_buffer_tokens`` of the filled slots;
    ``lru_slots`` (the new order); the plan entries in miss order, or the workspace's miss lists (``MODE.sorted``);
    ``miss_count[b]``; the workspace (ticket counter, hit bits, old LRU order, miss ranks, published counts, the
    table's hot words); ``counters`` hits and overflow (``HAS_COUNTERS``)."""
    if PDL:
        gdc_wait()
    b = tl.program_id(1)
    rid, _, _, long_row = _row_of(
        b, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL
    )  # fmt: skip
    if long_row:
        ws = ws_ptr + b.to(tl.int64) * ws_stride
        ticket = tl.atomic_add(ws + LAYOUT.sync, 1)
        _place_stage(
            ticket, b, rid, tokens_ptr, tok_strides, out_ptr, out_strides, rpi_ptr, seq_ptr, num_real_ptr,
            batch_indexing, dbt_ptr, dbl_ptr, lru_ptr, hcl_ptr, scratch_ptr, table_strides, table_sizes, src_ptr,
            dst_ptr, plan_stride, count_ptr, ws, counters_ptr, SPEC, SHAPE, LAYOUT, MODE, HAS_NUM_REAL, HAS_COUNTERS,
        )  # fmt: skip


def _place_grid(shape: ResolveShape, batch: int) -> tuple[int, int]:
    """Axis 0: a ticket (hot, occurrence and finish chunks: a count of programs, not a position), axis 1: batch row."""
    return (2 * shape.hot_chunks + shape.occ_chunks, batch)


def _launch_place(recorder: Recorder, a: ResolveArgs) -> None:
    """The split resolve's place launch (after insert; only with occurrences)."""
    call = a.call
    recorder.launch(
        _place_kernel, _place_grid(a.shape, a.dims.batch),
        a.tokens, a.tokens.stride(), a.out, a.out.stride(), call.req_pool_indices, call.seq_lens, a.num_real,
        a.batch_indexing, *a.tables, a.plan.src, a.plan.dst, a.plan.src.stride(0), a.plan.count, a.ws32, a.ws_stride,
        a.counters,
        SPEC=call.speculative, HAS_COUNTERS=call.counters is not None, **a.flags(), **a.early(),
    )  # fmt: skip


@triton.jit
def _place_stage(
    role, b, rid,  # the place stage's role (hot, occurrence or finish chunk), the batch row (a long row), its request
    tokens_ptr, tok_strides, out_ptr, out_strides,  # top_k_tokens, top_k_device_locs (as _place_kernel's)
    rpi_ptr, seq_ptr, num_real_ptr, batch_indexing,  # the batch rows and their indexing (as _place_kernel's)
    # the state tables at row 0, not request rid's (each role offsets the ones it uses by rid); who uses them:
    dbt_ptr,  # [R, HOT + P] int32 device_buffer_tokens, row stride table_strides[0]: hot reads, occurrence fills
    dbl_ptr,  # [R, HOT + P] int32 device_buffer_locs, row stride table_strides[0]: occurrence reads
    lru_ptr,  # [R, HOT] int16 lru_slots, row stride table_strides[1]: hot reads, finish rewrites
    hcl_ptr,  # [R, max_len] int64 host_cache_locs, row stride table_strides[2]: occurrence reads
    scratch_ptr,  # [R, scratch] int32 scratch_locs, row stride table_strides[3]: occurrence reads (when SPEC)
    table_strides, table_sizes,  # the four row strides above; (max_len, scratch)
    src_ptr, dst_ptr, plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst (the plan's bases); row stride
    count_ptr,  # [>= B] int32 miss_count (the finish role writes row b's)
    ws,  # this row's workspace (already at row b)
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    SPEC: tl.constexpr, SHAPE: tl.constexpr, LAYOUT: tl.constexpr, MODE: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr, HAS_COUNTERS: tl.constexpr,
):  # fmt: skip
    """The place stage's ``role`` in long row ``b``, request ``rid``: hot chunks, then occurrence chunks, then finish
    chunks (``_place_kernel`` says what each reads and writes)."""
    NHC: tl.constexpr = SHAPE.hot_chunks
    NOC: tl.constexpr = SHAPE.occ_chunks
    b64 = b.to(tl.int64)
    state_row = rid * table_strides[0]
    lru_row = lru_ptr + rid * table_strides[1]
    if role < NHC:
        _hot_chunk(dbt_ptr + state_row, lru_row, ws, role, SHAPE, LAYOUT)
    elif role < NHC + NOC:
        _occurrence_chunk(
            tokens_ptr + b64 * tok_strides[0], tok_strides, out_ptr + b64 * out_strides[0], out_strides,
            dbt_ptr + state_row, dbl_ptr + state_row, hcl_ptr + rid * table_strides[2], table_sizes[0],
            scratch_ptr + rid * table_strides[3], table_sizes[1], src_ptr + b64 * plan_stride,
            dst_ptr + b64 * plan_stride, ws, counters_ptr, role - NHC, SPEC, SHAPE, LAYOUT, MODE, HAS_COUNTERS,
        )  # fmt: skip
    else:
        _finish_chunk(lru_row, count_ptr + b, ws, counters_ptr, table_sizes[1], role - NHC - NOC, SPEC, SHAPE, LAYOUT,
                      MODE, HAS_COUNTERS)  # fmt: skip


_SORT_INTS = ["batch_indexing", "ws_stride", "plan_stride", "kv_rows"]


@triton.jit(do_not_specialize=_SORT_INTS)
def _sort_plan_kernel(
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows (miss lists, host-row table, shared_from); row stride
    count_ptr,  # [>= B] int32 miss_count (the place stage wrote it)
    src_ptr,
    dst_ptr,
    plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst; their row stride
    kv_rows,  # (n_host, n_dev): rows of host_cache and device_buffer
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
        call.req_pool_indices, call.seq_lens, a.num_real, a.batch_indexing, a.ws32, a.ws_stride, a.plan.count,
        a.plan.src, a.plan.dst, a.plan.src.stride(0), a.kv_rows,
        SHAPE=a.shape, LAYOUT=a.layout, MODE=a.mode, SORT=sort, ROW_SB=row_block,
        HAS_NUM_REAL=call.num_real_reqs is not None,
        num_warps=8, **a.early(),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# One program per row: every stage of the row in order (chunk waits are then always met)

_ROW_INTS = ["tok_strides", "out_strides", "batch_indexing", "state_stride", "table_strides", "table_sizes",
             "plan_stride", "ws_stride"]  # fmt: skip


@triton.jit(do_not_specialize=_ROW_INTS)
def _resolve_row_kernel(
    tokens_ptr,
    tok_strides,
    out_ptr,
    out_strides,  # top_k_tokens, top_k_device_locs (as _place_kernel's)
    rpi_ptr,
    seq_ptr,
    num_real_ptr,
    batch_indexing,  # the batch rows and their indexing, read by _row_of (it says what)
    dbt_ptr,
    dbl_ptr,
    lru_ptr,
    hcl_ptr,
    scratch_ptr,  # the state tables (as _place_kernel's)
    table_strides,
    table_sizes,  # their row strides (as _place_kernel's); (max_len, scratch)
    src_ptr,
    dst_ptr,
    plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst (written); their row stride
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,
    ws_stride,  # [B, LAYOUT.words] int32 workspace rows; their row stride
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    SORT_BLOCK: tl.constexpr,  # (misses sorted at once, its log2, the largest host row sorted as itself): _sort_row
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Grid ``_resolve_row_grid``, ``(B,)``: program ``b`` runs the prep, insert and place stages of every chunk of
    row ``b`` in order, then sorts the plan row (``MODE.sorted``)."""
    NOC: tl.constexpr = SHAPE.occ_chunks
    NHC: tl.constexpr = SHAPE.hot_chunks
    b = tl.program_id(0)
    for c in range(NOC):
        _prep_chunk(
            c, b, tokens_ptr, tok_strides, out_ptr, out_strides, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing,
            dbt_ptr, dbl_ptr, table_strides[0], count_ptr, ws_ptr, ws_stride, SPEC, SHAPE, LAYOUT, MODE, HAS_NUM_REAL,
        )  # fmt: skip
    rid, _, _, long_row = _row_of(
        b, rpi_ptr, seq_ptr, num_real_ptr, batch_indexing, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL
    )  # fmt: skip
    N: tl.constexpr = SHAPE.steps * SHAPE.top_k
    if N > 0:  # (without occurrences prep resolved everything; the workspace may have no columns)
        tl.debug_barrier()  # every thread has read the row's epoch words
        # (row 0's format word only from the share launch: other programs may not have read it yet)
        _end_epoch(ws_ptr + b.to(tl.int64) * ws_stride, ws_stride, b != 0, LAYOUT)
    if long_row & (N > 0):
        ws = ws_ptr + b.to(tl.int64) * ws_stride
        tl.debug_barrier()  # the table cleared and the wanted occurrences marked by every thread
        for c in range(NOC):
            _insert_chunk(c, b, tokens_ptr, tok_strides, ws, SHAPE, LAYOUT)
        tl.debug_barrier()
        for role in range(NHC + NOC + NHC):
            _place_stage(
                role, b, rid, tokens_ptr, tok_strides, out_ptr, out_strides, rpi_ptr, seq_ptr, num_real_ptr,
                batch_indexing, dbt_ptr, dbl_ptr, lru_ptr, hcl_ptr, scratch_ptr, table_strides, table_sizes, src_ptr,
                dst_ptr, plan_stride, count_ptr, ws, counters_ptr, SPEC, SHAPE, LAYOUT, MODE, HAS_NUM_REAL,
                HAS_COUNTERS,
            )  # fmt: skip
        if MODE.sorted:
            tl.debug_barrier()  # the miss lists and the count, written by other threads
            b64 = b.to(tl.int64)
            _sort_row(ws, count_ptr + b, src_ptr + b64 * plan_stride, dst_ptr + b64 * plan_stride, SORT_BLOCK,
                      LAYOUT, SHAPE.occ_chunk, MODE.apart)  # fmt: skip


def _resolve_row_grid(batch: int) -> tuple[int]:
    """Axis 0: batch row."""
    return (batch,)


def _launch_resolve_row(recorder: Recorder, a: ResolveArgs) -> None:
    """The resolve of one program per row (the call's first launch: it never starts early)."""
    call = a.call
    recorder.launch(
        _resolve_row_kernel, _resolve_row_grid(a.dims.batch),
        a.tokens, a.tokens.stride(), a.out, a.out.stride(), call.req_pool_indices, call.seq_lens, a.num_real,
        a.batch_indexing, *a.tables, a.plan.src, a.plan.dst, a.plan.src.stride(0), a.plan.count, a.ws32, a.ws_stride,
        a.counters,
        SPEC=call.speculative, SORT_BLOCK=sort_block(a.dims.occurrences), HAS_COUNTERS=call.counters is not None,
        **a.flags(),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Launch


LAUNCHES = LaunchCache()  # this module's recorded calls (the benchmarks and tests read its counts)


def run_swap_in(
    call: SwapInCall,
    launch: ResolveLaunch | None = None,
    copy_launch: CopyLaunch | None = None,
    copy: bool = True,
    records: LaunchCache | None = None,
) -> MissPlan:
    """Check, resolve and copy one call (every entry point's launch: :func:`swap_in`, the custom op, the pool, the
    benchmarks); returns the plan written. ``launch``/``copy_launch`` override the tuned launch shapes and
    ``copy=False`` skips the host->device copy (both for benchmarks: a call without its copy breaks the contract). A
    call laid out like a checked one that allocated nothing is launched again from its record
    (``kvplan.kernels.launch_cache``): in ``records`` (a pool's), else this module's ``LAUNCHES``."""
    launch = launch or RESOLVE_LAUNCH  # keyed as launched (tests and benchmarks swap the defaults)
    copy_launch = copy_launch or COPY_LAUNCH
    records = LAUNCHES if records is None else records
    allocates = call.plan is None or call.workspace is None
    key = None if allocates else records.key((*call.flat(), launch, copy_launch, copy))
    if records.relaunch(key, call.top_k_tokens):
        return call.plan
    dims = check_swap_in(call)
    recorder = Recorder()
    plan = _launch_swap_in(call, dims, recorder, launch, copy_launch, copy)
    records.remember(key, recorder)
    return plan


def sort_block(n: int) -> tuple[int, int, int]:
    """``_sort_row``'s constant for rows of ``n`` occurrences: ``(SB, log2(SB), 2**(62 - log2(SB)) - 1)``."""
    block = min(ROW_SORT_MAX, next_pow2(n))
    log = block.bit_length() - 1
    return block, log, (1 << (62 - log)) - 1


def resolve_shape(dims: SwapInDims, occ_chunk: int, hot_chunk: int, in_order: bool) -> ResolveShape:
    """The chunking of a call: ``occ_chunk``/``hot_chunk`` rounded to powers of two within the row's sizes."""
    n = dims.occurrences
    occ_chunk = min(next_pow2(n), max(next_pow2(occ_chunk), OCC_CHUNK_MIN))
    hot_chunk = max(HOT_CHUNK_MIN, min(next_pow2(dims.hot), next_pow2(hot_chunk)))
    occ_chunks, hot_chunks = triton.cdiv(max(n, 1), occ_chunk), triton.cdiv(dims.hot, hot_chunk)
    return ResolveShape(dims.steps, dims.top_k, dims.hot, dims.tail, occ_chunk, hot_chunk, occ_chunks, hot_chunks,
                        next_pow2(occ_chunks), next_pow2(hot_chunks), in_order)  # fmt: skip


def _launch_swap_in(
    call: SwapInCall,
    dims: SwapInDims,
    recorder: Recorder,
    launch: ResolveLaunch,
    copy_launch: CopyLaunch,
    copy: bool,
) -> MissPlan:
    """The launches of a checked call (allocating the plan and workspace when not given)."""
    plan, workspace = call.plan, call.workspace
    batch, n = dims.batch, dims.occurrences
    device = call.top_k_tokens.device
    if plan is None:
        plan = MissPlan.allocate(batch, n, device)
    miss_src, miss_count = plan.src, plan.count
    if batch == 0:
        return plan
    if workspace is None:
        workspace = torch.empty(
            batch, swap_in_workspace_columns(dims.steps, dims.top_k), dtype=torch.int64, device=device
        )
        forget_tables(workspace)
    layout = swap_in_workspace_regions(dims.steps, dims.top_k)
    # int64 rows read as int32 words (unit column stride checked); without occurrences only the prep stage runs,
    # which then never touches the workspace (it may have no columns): any int32 tensor stands in
    ws32 = workspace.view(torch.int32) if n else miss_count
    ws_stride = ws32.stride(0) if n else 0
    plan_stride = miss_src.stride(0)
    chosen = plan_swap_in(call, dims, launch, plan_stride)
    per_row = chosen.resolve == "per_row"
    mode = PlanMode(chosen.sorted, chosen.shared, chosen.apart)
    if per_row:
        shape, warps = resolve_shape(dims, launch.row_occ_chunk, launch.row_hot_chunk, True), launch.row_warps
    else:
        shape, warps = resolve_shape(dims, launch.occ_chunk, launch.hot_chunk, False), launch.num_warps
    tokens = call.top_k_tokens if call.speculative else call.top_k_tokens.unsqueeze(1)  # [B, S, K]
    out = call.top_k_device_locs if call.speculative else call.top_k_device_locs.unsqueeze(1)
    batch_indexing = BatchIndexing(call.req_pool_indices.stride(0), call.seq_lens.stride(0), batch, dims.requests)
    batch_indexing = tuple(batch_indexing)
    num_real = miss_count if call.num_real_reqs is None else call.num_real_reqs  # unread stand-ins: a valid tensor
    counters = miss_src if call.counters is None else call.counters
    scratch = call.device_buffer_locs if call.scratch_locs is None else call.scratch_locs
    state_stride = call.device_buffer_tokens.stride(0)
    table_strides = (state_stride, call.lru_slots.stride(0), call.host_cache_locs.stride(0), scratch.stride(0))
    kv_rows = (call.host_cache.shape[0], call.device_buffer.shape[0])
    tables = (call.device_buffer_tokens, call.device_buffer_locs, call.lru_slots, call.host_cache_locs, scratch,
              table_strides, (dims.max_len, dims.scratch))  # fmt: skip
    # every launch after the first may start early, waiting in the kernel for the one before (Hopper and later)
    pdl = dependent_launch(device, _insert_kernel)
    args = ResolveArgs(call, dims, tokens, out, num_real, batch_indexing, tables, plan, ws32, ws_stride, counters,
                       kv_rows, shape, layout, mode, warps, pdl)  # fmt: skip
    with device_guard(device):
        if chosen.resolve == "onchip":
            # one block per row resolves and sorts; the share launch follows a sorted plan (it also writes row 0's
            # format word, which every block read)
            launch_onchip(recorder, args, chosen.onchip)
            if mode.sorted:
                _launch_sort_plan(recorder, args, sort=False, row_block=chosen.onchip.sort_block)
        elif per_row:
            _launch_resolve_row(recorder, args)
        else:
            _launch_prep(recorder, args)
            if n:
                _launch_insert(recorder, args)
                _launch_place(recorder, args)
        if n and chosen.resolve != "onchip" and (per_row or mode.sorted):
            _launch_sort_plan(recorder, args, sort=not per_row)
    if n and copy and call.host_cache.shape[1] > 0:
        walk = None
        if mode.apart:
            # the plan stays in miss order (docs/kernels.md §2); the copy walks its host-row order, which the sort
            # left in words of the workspace the resolve is done with: host rows in the table's hot words (TB >= 2N
            # int32 words), device rows in the occurrences' entry words, records in the miss ranks' words
            walk = (
                workspace[:, layout.hot // 2 : layout.hot // 2 + n],
                ws32[:, layout.occ_entry : layout.occ_entry + n],
                layout.miss_rank,
            )
        launch_copy(
            plan,
            call.host_cache,
            call.device_buffer,
            num_real_reqs=call.num_real_reqs,
            counters=call.counters,
            counter_base=SWAP_IN_COPY_BASE,
            recorder=recorder,
            batch=batch,
            launch=copy_launch if mode.sorted else FLAT_COPY_LAUNCH,
            workspace=ws32 if mode.shared else None,
            marked=ws32,  # (prep marked the padding rows: their plan rows may hold an earlier call's entries)
            choose_dispatch=mode.shared,
            span_at=layout.span,
            walk=walk,
            early=pdl,
        )
    return plan


def swap_in(
    state: HotBufferState, top_k_tokens: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, speculative: bool | None = None, launch_records: LaunchCache | None = None,
) -> MissPlan:  # fmt: skip
    """HiSparse swap-in (docs/kernels.md §2-§3): resolve ``top_k_tokens`` into ``top_k_device_locs``, admit misses into
    LRU hot slots, record the plan and copy the missing rows from ``host_cache``.

    Speculative when ``top_k_tokens`` is ``[B, S, K]``: the ``S*K`` occurrences form one working set, each distinct
    miss is copied once, overflow goes to the state's ``scratch_locs`` rows, then ``-1`` (counted). Single-step when it
    is ``[B, K]`` (the state's scratch rows are not used).

    Parameters
    ----------
    state : HotBufferState
        Read and written (``device_buffer_tokens``, ``lru_slots``): the engine's hot-buffer tables.
    top_k_tokens : Tensor
        Read. int32 ``[B, K]`` or ``[B, S, K]``: token ids; anything outside ``[0, that step's length)`` resolves to
        ``-1``.
    top_k_device_locs : Tensor
        Written. int32, ``top_k_tokens``' shape: the device row serving each token (``-1`` for none; ``0`` on the
        speculative path's padding rows).
    req_pool_indices : Tensor
        Read. int32/int64 ``[>= B]``: the request slot of each batch row.
    seq_lens : Tensor
        Read. int32/int64 ``[>= B]`` (single-step) or ``[>= B*S]``, the length at each draft step, request-major
        (``seq_lens[b*S + s]``).
    host_cache : Tensor
        Read. ``[host_rows, item]`` KV rows, pinned host memory (read zero-copy) or on the device.
    device_buffer : Tensor
        Written (the rows of missed tokens). ``[device_rows, item]``, ``host_cache``'s dtype, on the device.
    num_real_reqs : Tensor, optional
        Read on the device. ``[1]`` int32: batch rows from it on are CUDA-graph padding (``None``: all are real).
    plan : MissPlan, optional
        Written: entries ``[0, count[b])`` and ``count[:B]``; ``[>= B, >= S*K]`` (allocated per call if ``None``).
        A row is a set of copies: in host-row order above ``FLAT_COPY_MAX_BATCH`` rows, in miss order otherwise.
    workspace : Tensor, optional
        Read and written, int64 ``[>= B, >= swap_in_workspace_columns(S, K)]`` (allocated per call if ``None``).
        Keep one for your calls and write nothing into it: new, it goes through ``kvplan.forget_tables`` once (its
        memory may be an earlier workspace's, vouching for overwritten tables); after a call its hash tables carry
        epoch tags so that later calls need not clear them (``kvplan.workspace``).
        Afterwards it holds the call's record of plan entries that share a host row: pass it to
        :func:`kvplan.kernels.copy_planned` with the plan to replay each distinct host row from the host once.
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: hits, overflow, rows and bytes copied.
    speculative : bool, optional
        ``None``: from ``top_k_tokens``' rank. ``True``/``False`` insists on a path: a tensor of the other rank is
        refused with the engines' message (``speculative top_k_tokens must have shape [batch, steps, top_k].``).
    launch_records : LaunchCache, optional
        Where a checked call's launches are recorded, so that a later call laid out alike relaunches them (a pool
        passes its own: its ``stats()`` count them and a growth drops them); default: this module's ``LAUNCHES``.

    Returns
    -------
    MissPlan
        The plan written: ``plan`` itself when given. Given ``plan`` and ``workspace`` the call allocates nothing and
        never synchronises (CUDA-graph capturable).

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type, shape, dtype, device or layout, named in the message; nothing is written.
    """
    written = run_swap_in(
        swap_in_call(
            speculative,
            state,
            top_k_tokens,
            top_k_device_locs,
            req_pool_indices,
            seq_lens,
            host_cache,
            device_buffer,
            num_real_reqs,
            plan,
            workspace,
            counters,
        ),  # fmt: skip
        records=launch_records,
    )
    return written if plan is None else plan
