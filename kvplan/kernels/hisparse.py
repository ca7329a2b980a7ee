"""HiSparse swap-in in Triton (docs/kernels.md §2-§3): one batch row resolved by many programs, in three kernels
(four above small batches).

A row's ``N = S*K`` occurrences are split into chunks of ``occ_chunk`` and its ``HOT`` LRU positions into chunks of
``hot_chunk``; every launch runs several programs per row (grid axis 0: chunk or role, axis 1: batch row), so batch 1
fills the GPU instead of one SM. What one program decides, others read from the row's workspace (regions in
``kvplan.kernels.workspace``):

1. ``_prep_kernel``: resolve what needs no table (padding and short rows entirely; invalid occurrences, the newest
   token of the single-step path, tail hits of the speculative path), mark the rest *wanted*, clear the row's hash
   table and counters.
2. ``_insert_kernel``: wanted occurrences insert ``token << 32 | occurrence`` into the table (open addressing; a
   lane reads a window of entries, then claims the first free one with a compare-and-swap); an entry keeps its
   token's first occurrence (``atomic_min`` on the packed key).
3. ``_place_kernel``, one launch whose programs take *tickets* in the order they start and wait only on lower
   tickets: dynamic tickets with a chained look-back, as in single-pass prefix scans (Merrill and Garland). The
   forward-progress assumption is the usual one: a program that has started keeps being scheduled, so a wait on a
   lower ticket ends whatever the GPU schedules and however few programs fit at once (the interpreter runs the
   programs in order, which is one such schedule).
   - *hot chunks* (the first tickets): every LRU position looks its slot's token up; a found token is a hit. The
     entry keeps the least recently used such position and its slot (``atomic_min`` of ``position << 16 | slot``);
     each position gets its hit bit, each chunk publishes its count of evictable positions.
   - *occurrence chunks*: once every hot chunk has published, first occurrences of tokens no slot holds are misses;
     backed ones (host row ``>= 0``) are ranked within the chunk and the chunk publishes its count. The lower
     chunks' counts give each miss its rank ``m`` in first-occurrence order; the ``m``-th evictable position (found
     from the hot chunks' counts and hit bits) is its slot, then scratch rows, then ``-1``. Outputs, the filled
     slots' tokens and the plan entry (or the miss list the sort reads) are written; at small batches the chunk then
     copies its own rows (zero-copy, so the copy is spread over every program of every row).
   - *finish programs* (the last tickets, one per hot chunk): once every occurrence chunk has counted its misses,
     each moves its chunk's positions to the new order (``evictables[M:] ++ evictables[:M] ++ hits``) from the
     workspace copy of the old row; the first also writes ``miss_count`` and counts the overflow.
4. ``_sort_plan_kernel``, above ``FUSED_COPY_MAX_BATCH``: the occurrence chunks wrote their misses to the workspace
   instead of the plan; each miss's plan entry is the number of misses before it in ``(host row, m)`` order, so the
   plan row is in host-row order and every copy of it (``kvplan.kernels.copy``'s ordered copy, which then moves the
   rows, and each replay) reads the host cache in address order. At small batches the place launch writes the plan
   in miss order and copies each chunk's rows as soon as they are placed: all of a row's misses are in flight at
   once there, and an ordered copy after the resolve would only add its latency.

Each result is deterministic (the table layout is not, but nothing observable depends on it). Every state access is
masked against its table: out-of-range ``rid``, tokens, LRU entries and rows never touch memory outside the tensors,
with the outcomes the reference defines.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
import triton
import triton.language as tl

from kvplan.calls import SwapInCall, swap_in_call
from kvplan.counters import HITS, OVERFLOW, SWAP_IN_COPY_BASE
from kvplan.kernels.copy import COPY_LAUNCH, CopyLaunch, add_copy_counters, copy_plan_rows, launch_copy
from kvplan.kernels.launch_cache import LaunchCache, Recorder, as_words, device_guard, next_pow2, row_word_dtype
from kvplan.kernels.workspace import (
    HOT_CHUNK_MIN,
    OCC_CHUNK_MIN,
    swap_in_workspace_columns,
    swap_in_workspace_regions,
)
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import SwapInDims, check_swap_in

__all__ = ["ResolveLaunch", "swap_in", "swap_in_spec"]

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_COPY_BASE = tl.constexpr(SWAP_IN_COPY_BASE)
_NONE = tl.constexpr(0x7FFFFFFF)  # "no hot slot holds this token" in the table's hot region
_HASH = tl.constexpr(0x61C88647)  # odd multiplier (2**32 / golden ratio, negated): Fibonacci hashing
_WINDOW = tl.constexpr(8)  # table entries one probe round reads per lane
_TAIL_BLOCK = tl.constexpr(64)  # tail slots compared per step of the tail search
_CLEAR_BLOCK = tl.constexpr(512)  # table entries one prep program clears per step
_FLAGS_BLOCK = tl.constexpr(1024)  # per-call flag words prep clears per step
SORT_SLICE = 32  # misses one program of the plan sort places
_SORT_SLICE = tl.constexpr(SORT_SLICE)
_SORT_TILE = tl.constexpr(128)  # misses each of them is compared with at a time
_PUBLISHED = tl.constexpr(1 << 30)  # flag bit of a published count
_FUSED_COPY_ROWS = 16  # rows per tile of the fused copy


@attrs.frozen
class ResolveLaunch:
    """Launch shape of the resolve: occurrences and LRU positions per program, warps per program, and whether the
    place launch copies the rows itself (``None``: when the batch is at most ``FUSED_COPY_MAX_BATCH``)."""

    occ_chunk: int = 128
    hot_chunk: int = 256
    num_warps: int = 8
    fused_copy: bool | None = None


RESOLVE_LAUNCH = ResolveLaunch()
# Up to this batch the place launch copies each chunk's rows as soon as they are placed: with all of a row's misses in
# flight at once, an ordered copy after the resolve would only add its latency. Above it the ordered copy wins
# (H200, 4.6 GB host cache: batch 8, 6256 rows, 136 µs ordered vs 165 µs in the resolve's order).
FUSED_COPY_MAX_BATCH = 2


class ResolveShape(NamedTuple):
    """A resolve's compile-time sizes, passed to the kernels as one constant."""

    steps: int  # S (1 on the single-step path)
    top_k: int  # K
    hot: int  # HOT LRU slots per request
    tail: int  # P tail slots per request
    occ_chunk: int  # occurrences per program
    hot_chunk: int  # LRU positions per program (a multiple of 32)
    occ_chunks: int  # programs per row over the occurrences: cdiv(S*K, occ_chunk)
    hot_chunks: int  # programs per row over the LRU positions: cdiv(HOT, hot_chunk)
    occ_block: int  # next power of two >= occ_chunks (the occurrence chunks' counts as one block)
    hot_block: int  # next power of two >= hot_chunks (the hot chunks' counts as one block)


class RowCopy(NamedTuple):
    """How KV rows are moved (as integer words): the compile-time half of a copy."""

    host_stride: int  # host_cache row pitch, in words
    dev_stride: int  # device_buffer row pitch, in words
    words: int  # words per row
    block: int  # next power of two >= words
    rows: int  # rows per copy tile


# ---------------------------------------------------------------------------------------------------------------------
# Hash table of a row's wanted tokens: int64 entries ``token << 32 | first occurrence`` (tokens >= 0), -1 empty;
# linear probing, nothing deleted within a call.


@triton.jit
def _hash(token, LOG_TB: tl.constexpr):
    """Fibonacci hash of int32 tokens to ``[0, 2**LOG_TB)``: the top bits of ``token * _HASH`` (mod 2**32)."""
    mixed = (token * _HASH).to(tl.uint32, bitcast=True)
    return (mixed >> (32 - LOG_TB)).to(tl.int32)


@triton.jit
def _table_insert(keys_ptr, token, occ, active, LOG_TB: tl.constexpr):
    """Insert ``token`` with occurrence ``occ`` for every active lane. Returns each lane's entry (-1 inactive) and
    whether the lane claimed it (one lane per entry). Lanes of one token share its entry, which keeps their smallest
    occurrence. Each round reads a window of entries (a claimed entry never changes token, so a token or a free
    entry seen there is final up to the compare-and-swap that claims it)."""
    packed = (token.to(tl.int64) << 32) | occ.to(tl.int64)
    w = tl.arange(0, _WINDOW)
    wrap = (1 << LOG_TB) - 1
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    claimed_any = token < -1  # all False
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        cur = tl.load(keys_ptr + ((pos[:, None] + w[None, :]) & wrap), mask=pending[:, None], other=-1,
                      cache_modifier=".cg")  # fmt: skip
        stop = ((cur >> 32) == token[:, None]) | (cur == -1)
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        at = (pos + first) & wrap
        seen = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        trying = pending & (first < _WINDOW)
        empty = trying & (seen == -1)
        # lanes not claiming compare against -2, which no entry holds: their compare-and-swap writes nothing
        old = tl.atomic_cas(keys_ptr + at, tl.where(empty, -1, -2).to(tl.int64), packed)
        claimed = empty & (old == -1)
        same = (trying & ~empty) | (empty & ~claimed & ((old >> 32) == token))
        holder = tl.where(empty, old, seen)
        tl.atomic_min(keys_ptr + at, packed, mask=same & ((holder & 0xFFFFFFFF) > occ))
        done = claimed | same
        entry = tl.where(done, at, entry)
        claimed_any = claimed_any | claimed
        lost = empty & ~done  # another token took the free entry first: look again from there
        pos = tl.where(pending & ~trying, pos + _WINDOW, tl.where(lost, at, pos))
        pending = pending & ~done
    return entry, claimed_any


@triton.jit
def _table_find(keys_ptr, token, active, LOG_TB: tl.constexpr):
    """The entry holding ``token`` for every active lane, -1 when absent (the table is complete: read only)."""
    w = tl.arange(0, _WINDOW)
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        idx = (pos[:, None] + w[None, :]) & ((1 << LOG_TB) - 1)
        cur = tl.load(keys_ptr + idx, mask=pending[:, None], other=-1, cache_modifier=".cg")
        stop = ((cur >> 32) == token[:, None]) | (cur == -1)
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        value = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        found = pending & (first < _WINDOW) & (value != -1)
        entry = tl.where(found, (pos + first) & ((1 << LOG_TB) - 1), entry)
        pending = pending & (first == _WINDOW)
        pos += _WINDOW
    return entry


# ---------------------------------------------------------------------------------------------------------------------
# Counts published between programs of the place launch (a flag bit marks a published count)


@triton.jit
def _publish(ptr, value):
    """Publish ``value`` at ``ptr`` after everything this program wrote (a barrier, then a release)."""
    tl.debug_barrier()
    tl.atomic_xchg(ptr, value | _PUBLISHED, sem="release")


@triton.jit
def _wait_counts(ptr, count, NB: tl.constexpr):
    """Wait until ``ptr[0:count]`` are all published (they are written by programs with lower tickets, which have
    started and never wait on this one); returns them (0 past ``count``)."""
    idx = tl.arange(0, NB)
    inside = idx < count
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
def _row_of(
    b,  # the batch row
    rpi_ptr,  # [>= B] req_pool_indices (int32/int64), stride rows[0]
    seq_ptr,  # [>= B*S] seq_lens (int32/int64), stride rows[1]; step s of row b at b*S + s
    num_real_ptr,  # [1] int32 num_real_reqs (read when HAS_NUM_REAL)
    rows,  # (req_pool_indices stride, seq_lens stride, B, R): every kernel passes these four the same way
    S: tl.constexpr,
    HOT: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
):
    """Batch row ``b``: its request ``rid``, whether it is real (``live``: below ``num_real_reqs``, ``rid`` inside the
    pool), its last step's length, and whether it is a long row (``len > HOT``, resolved through the table)."""
    rpi_stride, seq_stride, batch, num_requests = rows
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    b64 = b.to(tl.int64)
    rid = tl.load(rpi_ptr + b64 * rpi_stride).to(tl.int64)
    live = (b < n_real) & (rid >= 0) & (rid < num_requests)
    last_len = tl.load(seq_ptr + (b64 * S + S - 1) * seq_stride).to(tl.int64)  # S = 1: row b's length
    return rid, live, last_len, live & (last_len > HOT)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel 1: prep. Grid (occ_chunks, batch).

_PREP_INTS = ["tok_strides", "out_strides", "rows", "state_stride", "ws_stride"]


@triton.jit(do_not_specialize=_PREP_INTS)
def _prep_kernel(
    tokens_ptr, tok_strides,  # [B, S, K] int32 top_k_tokens (S = 1 on the single-step path) and its strides
    out_ptr, out_strides,  # [B, S, K] int32 top_k_device_locs (written) and its strides
    rpi_ptr, seq_ptr, num_real_ptr, rows,  # the batch rows, read by _row_of (which says what each is)
    dbt_ptr, dbl_ptr, state_stride,  # [R, HOT + P] int32 device_buffer_tokens, _locs; their row stride
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr, ws_stride,  # [B, LAYOUT.words] int32 workspace rows (not read when S*K == 0); their row stride
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # kvplan.kernels.workspace.WorkspaceRegions
    HAS_NUM_REAL: tl.constexpr,
):
    """Everything that needs no table; the table and this call's counters cleared; wanted occurrences marked -2."""
    S: tl.constexpr = SHAPE.steps
    K: tl.constexpr = SHAPE.top_k
    HOT: tl.constexpr = SHAPE.hot
    P: tl.constexpr = SHAPE.tail
    CH: tl.constexpr = SHAPE.occ_chunk
    NOC: tl.constexpr = SHAPE.occ_chunks
    N: tl.constexpr = S * K
    c = tl.program_id(0)
    b = tl.program_id(1)
    rid, live, last_len, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, rows, S, HOT, HAS_NUM_REAL)
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
        step_len = tl.load(seq_ptr + (b64 * S + step) * rows[1], mask=in_occ, other=0).to(tl.int64)
    else:
        step_len = last_len
    valid = in_occ & (tok >= 0) & (tok < step_len)
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
        ws = ws_ptr + b64 * ws_stride
        tl.store(ws + LAYOUT.occ_entry + occ, tl.where(wanted, -2, -1), mask=in_occ)
        # clear this program's share of the table (the workspace holds anything before the call); the hot region
        # is set by whoever claims an entry
        keys = _words(ws, LAYOUT.keys, tl.int64)
        TB: tl.constexpr = LAYOUT.table_size
        start = c * _CLEAR_BLOCK
        while start < TB:
            e = start + tl.arange(0, _CLEAR_BLOCK)
            tl.store(keys + e, tl.full([_CLEAR_BLOCK], -1, tl.int64), mask=e < TB)
            start += NOC * _CLEAR_BLOCK
        if c == 0:
            # every count and flag unpublished, the ticket counter at zero
            FLAGS: tl.constexpr = LAYOUT.old_lru - LAYOUT.sync
            for f0 in tl.static_range(0, FLAGS, _FLAGS_BLOCK):
                f = f0 + tl.arange(0, _FLAGS_BLOCK)
                tl.store(ws + LAYOUT.sync + f, tl.zeros([_FLAGS_BLOCK], tl.int32), mask=f < FLAGS)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel 2: insert. Grid (occ_chunks, batch).

_INSERT_INTS = ["tok_strides", "rows", "ws_stride"]


@triton.jit(do_not_specialize=_INSERT_INTS)
def _insert_kernel(
    tokens_ptr, tok_strides,  # [B, S, K] int32 top_k_tokens and its strides
    rpi_ptr, seq_ptr, num_real_ptr, rows,  # the batch rows, read by _row_of (which says what each is)
    ws_ptr, ws_stride,  # [B, LAYOUT.words] int32 workspace rows (the table); their row stride
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    HAS_NUM_REAL: tl.constexpr,
):
    """Wanted occurrences of long rows into the row's table; each records its entry, each claimer clears the
    entry's hot word."""
    K: tl.constexpr = SHAPE.top_k
    CH: tl.constexpr = SHAPE.occ_chunk
    N: tl.constexpr = SHAPE.steps * K
    c = tl.program_id(0)
    b = tl.program_id(1)
    _, _, _, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, rows, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL)
    if long_row:
        b64 = b.to(tl.int64)
        ws = ws_ptr + b64 * ws_stride
        occ = c * CH + tl.arange(0, CH)
        wanted = (occ < N) & (tl.load(ws + LAYOUT.occ_entry + occ, mask=occ < N, other=-1) == -2)
        tok = tl.load(tokens_ptr + b64 * tok_strides[0] + (occ // K) * tok_strides[1] + (occ % K) * tok_strides[2],
                      mask=wanted, other=0)  # fmt: skip
        LOG_TB: tl.constexpr = LAYOUT.table_size.bit_length() - 1
        entry, claimed = _table_insert(_words(ws, LAYOUT.keys, tl.int64), tok, occ, wanted, LOG_TB)
        tl.store(ws + LAYOUT.occ_entry + occ, entry, mask=wanted)
        tl.store(ws + LAYOUT.hot + entry, tl.full([CH], _NONE, tl.int32), mask=claimed)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel 3: place. Grid (hot_chunks + occ_chunks + hot_chunks, batch); axis 0 is a ticket's role, not a position.

_PLACE_INTS = ["tok_strides", "out_strides", "rows", "table_strides", "table_sizes", "plan_stride", "ws_stride",
               "kv_rows", "row_bytes"]  # fmt: skip


@triton.jit(do_not_specialize=_PLACE_INTS)
def _place_kernel(
    tokens_ptr, tok_strides,  # [B, S, K] int32 top_k_tokens and its strides
    out_ptr, out_strides,  # [B, S, K] int32 top_k_device_locs (written) and its strides
    rpi_ptr, seq_ptr, num_real_ptr, rows,  # the batch rows, read by _row_of (which says what each is)
    dbt_ptr,  # [R, HOT + P] int32 device_buffer_tokens, row stride table_strides[0]
    dbl_ptr,  # [R, HOT + P] int32 device_buffer_locs, row stride table_strides[0]
    lru_ptr,  # [R, HOT] int16 lru_slots, row stride table_strides[1]
    hcl_ptr,  # [R, max_len] int64 host_cache_locs, row stride table_strides[2]
    scratch_ptr,  # [R, scratch] int32 scratch_locs, row stride table_strides[3] (read when SPEC)
    table_strides, table_sizes,  # the four row strides above; (max_len, scratch)
    src_ptr, dst_ptr, plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst (written when FUSED); row stride
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr, ws_stride,  # [B, LAYOUT.words] int32 workspace rows; their row stride
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    host_ptr,  # [n_host, ROW.words] words, pitch ROW.host_stride: host_cache (read when FUSED and COPY)
    dev_ptr,  # [n_dev, ROW.words] words, pitch ROW.dev_stride: device_buffer (written when FUSED and COPY)
    kv_rows, row_bytes,  # (n_host, n_dev); bytes of one KV row
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    ROW: tl.constexpr,  # RowCopy
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    FUSED: tl.constexpr,  # the plan written in miss order here, each chunk's rows copied here (when COPY)
    COPY: tl.constexpr,
):
    NHC: tl.constexpr = SHAPE.hot_chunks
    NOC: tl.constexpr = SHAPE.occ_chunks
    b = tl.program_id(1)
    rid, _, _, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, rows, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL)
    if long_row:
        b64 = b.to(tl.int64)
        ws = ws_ptr + b64 * ws_stride
        ticket = tl.atomic_add(ws + LAYOUT.sync, 1)  # programs are roles in the order they start
        state_row = rid * table_strides[0]
        lru_row = lru_ptr + rid * table_strides[1]
        if ticket < NHC:
            _hot_chunk(dbt_ptr + state_row, lru_row, ws, ticket, SHAPE, LAYOUT)
        elif ticket < NHC + NOC:
            _occurrence_chunk(
                tokens_ptr + b64 * tok_strides[0], tok_strides, out_ptr + b64 * out_strides[0], out_strides,
                dbt_ptr + state_row, dbl_ptr + state_row, lru_row, hcl_ptr + rid * table_strides[2], table_sizes[0],
                scratch_ptr + rid * table_strides[3], table_sizes[1], src_ptr + b64 * plan_stride,
                dst_ptr + b64 * plan_stride, ws, counters_ptr, ticket - NHC, host_ptr,
                dev_ptr, kv_rows, row_bytes, SPEC, SHAPE, LAYOUT, ROW, HAS_COUNTERS, FUSED, COPY,
            )  # fmt: skip
        else:
            _finish_chunk(
                lru_row, count_ptr + b, ws, counters_ptr, table_sizes[1], ticket - NHC - NOC, SPEC, SHAPE, LAYOUT,
                HAS_COUNTERS,
            )  # fmt: skip


@triton.jit
def _hot_chunk(dbt_row, lru_row, ws, hc, SHAPE: tl.constexpr, LAYOUT: tl.constexpr):
    """Place launch, hot chunk ``hc``: LRU positions look their slot's token up; hits recorded and counted; the
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
    entry = _table_find(_words(ws, LAYOUT.keys, tl.int64), token, slot_live & (token >= 0), LOG_TB)
    hit = entry >= 0
    tl.atomic_min(ws + LAYOUT.hot + entry, (j << 16) | slot, mask=hit)
    # the chunk's hit bits: one int32 word per 32 positions (distinct bits, so their sum is their OR)
    bits = tl.where(hit, 1, 0) << (j % 32)
    words = tl.sum(tl.reshape(bits, [HCH // 32, 32]), axis=1)
    tl.store(ws + LAYOUT.hit_bits + hc * (HCH // 32) + tl.arange(0, HCH // 32), words)
    _publish(ws + LAYOUT.hot_counts + hc, tl.sum((in_hot & ~hit).to(tl.int32), axis=0))


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
    lru_row,  # [HOT] this request's lru_slots
    hcl_row,  # [max_len] this request's host_cache_locs
    max_len,
    scratch_row,  # [scratch] this request's scratch_locs
    scratch_cols,
    src_row,  # [>= S*K] int64 this batch row's miss_src (written when FUSED)
    dst_row,  # [>= S*K] int32 this batch row's miss_dst (written when FUSED)
    ws,  # this row's workspace
    counters_ptr,
    oc,
    host_ptr,
    dev_ptr,
    kv_rows,
    row_bytes,
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    ROW: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    FUSED: tl.constexpr,
    COPY: tl.constexpr,
):
    """Place launch, occurrence chunk ``oc``: misses ranked, slots and rows chosen, outputs and the miss list written,
    then (fused copy) the chunk's rows copied."""
    K: tl.constexpr = SHAPE.top_k
    N: tl.constexpr = SHAPE.steps * K
    HOT: tl.constexpr = SHAPE.hot
    CH: tl.constexpr = SHAPE.occ_chunk
    hot_counts = _wait_counts(ws + LAYOUT.hot_counts, SHAPE.hot_chunks, SHAPE.hot_block)  # every hot chunk looked up
    n_evict = tl.sum(hot_counts, axis=0)
    n_evict_before = tl.cumsum(hot_counts, axis=0) - hot_counts
    occ = oc * CH + tl.arange(0, CH)
    in_occ = occ < N
    entry = tl.load(ws + LAYOUT.occ_entry + occ, mask=in_occ, other=-1)
    wanted = entry >= 0
    keys = _words(ws, LAYOUT.keys, tl.int64)
    first_occ = (tl.load(keys + entry, mask=wanted, other=-1, cache_modifier=".cg") & 0xFFFFFFFF).to(tl.int32)
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
    _publish(ws + LAYOUT.occ_counts + oc, tl.sum(flag, axis=0))
    if HAS_COUNTERS:
        hits = tl.sum((first & held).to(tl.int32), axis=0)
        if hits > 0:
            tl.atomic_add(counters_ptr + _HITS, hits.to(tl.int64))
    # ranks in first-occurrence order: the misses of lower chunks first (a token's first occurrence is never in a
    # later chunk than its other occurrences)
    occ_counts = _wait_counts(ws + LAYOUT.occ_counts, oc, SHAPE.occ_block)
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
    hit_loc = tl.load(dbl_row + (held_by & 0xFFFF), mask=held, other=-1)
    loc = tl.where(held, hit_loc, tl.where(placed, miss_loc, -1))
    tl.store(out_row + (occ // K) * out_strides[1] + (occ % K) * out_strides[2], loc, mask=wanted)
    # the token's first occurrence records the miss (host and device row at its rank) and the filled slot's token:
    # in the plan itself when this launch copies (the plan then stays in miss order), else in the miss lists that
    # _sort_plan_kernel writes into the plan in host-row order
    owner = placed & first
    if FUSED:
        miss_host, miss_dst = src_row, dst_row
    else:
        miss_host, miss_dst = _words(ws, LAYOUT.miss_host, tl.int64), ws + LAYOUT.miss_loc
    tl.store(miss_host + m, host, mask=owner)
    tl.store(miss_dst + m, loc, mask=owner)
    tl.store(dbt_row + fill, tok, mask=owner & fill_ok)
    if FUSED and COPY:
        # this chunk's misses are consecutive: [misses of lower chunks, + its own), cut where placing stops
        lo = tl.sum(occ_counts, axis=0)
        hi = tl.minimum(lo + tl.sum(flag, axis=0), placed_n)
        tl.debug_barrier()  # the entries above were written by other threads of this program
        copied = copy_plan_rows(
            host_ptr, dev_ptr, src_row, dst_row, lo, hi, ROW.rows, kv_rows[0], kv_rows[1],
            ROW.host_stride, ROW.dev_stride, ROW.words, ROW.block, ROW.rows,
        )  # fmt: skip
        if HAS_COUNTERS:
            add_copy_counters(counters_ptr, _COPY_BASE, copied, row_bytes)


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
    HAS_COUNTERS: tl.constexpr,
):
    """Place launch, last tickets: hot chunk ``hc``'s positions move to the new order evictables[M:] ++
    evictables[:M] ++ hits, once every occurrence chunk has counted its misses (``M`` needs them all). The old
    order is read from the workspace copy, so chunks rewrite ``lru_slots`` in place without waiting on each other."""
    HOT: tl.constexpr = SHAPE.hot
    HCH: tl.constexpr = SHAPE.hot_chunk
    HB: tl.constexpr = SHAPE.hot_block
    hot_counts = _wait_counts(ws + LAYOUT.hot_counts, SHAPE.hot_chunks, HB)
    n_evict = tl.sum(hot_counts, axis=0)
    n_backed = tl.sum(_wait_counts(ws + LAYOUT.occ_counts, SHAPE.occ_chunks, SHAPE.occ_block), axis=0)
    admitted_n = tl.minimum(n_backed, n_evict)
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    evict = in_hot & ~(((tl.load(ws + LAYOUT.hit_bits + j // 32, cache_modifier=".cg") >> (j % 32)) & 1) != 0)
    evict_i = evict.to(tl.int32)
    evict_rank = (
        tl.sum(tl.where(tl.arange(0, HB) < hc, hot_counts, 0), axis=0) + tl.cumsum(evict_i, axis=0) - evict_i
    )
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
                tl.atomic_add(counters_ptr + _OVERFLOW, overflow.to(tl.int64))


# ---------------------------------------------------------------------------------------------------------------------
# Kernel 4 (when the copy runs after the resolve): the plan in host-row order. Grid (plan slices, batch).

_SORT_INTS = ["rows", "ws_stride", "plan_stride"]


@triton.jit(do_not_specialize=_SORT_INTS)
def _sort_plan_kernel(
    rpi_ptr, seq_ptr, num_real_ptr, rows,  # the batch rows, read by _row_of (which says what each is)
    ws_ptr, ws_stride,  # [B, LAYOUT.words] int32 workspace rows (the miss lists); their row stride
    count_ptr,  # [>= B] int32 miss_count (the place launch wrote it)
    src_ptr, dst_ptr, plan_stride,  # [>= B, >= S*K] int64 miss_src, int32 miss_dst (written); their row stride
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    HAS_NUM_REAL: tl.constexpr,
):
    """Miss ``m`` (host row ``h``) of the row's miss lists goes to plan entry ``#{misses before it in (host row, m)
    order}``, a permutation of ``[0, miss_count)``: every copy of the plan then reads the host cache in address order.
    Program ``(i, b)`` places slice ``i`` of ``_SORT_SLICE`` misses, comparing each with all of them (the copies it
    orders cost far more than the comparisons)."""
    b = tl.program_id(1)
    _, _, _, long_row = _row_of(b, rpi_ptr, seq_ptr, num_real_ptr, rows, SHAPE.steps, SHAPE.hot, HAS_NUM_REAL)
    if long_row:
        placed_n = tl.load(count_ptr + b)
        m = tl.program_id(0) * _SORT_SLICE + tl.arange(0, _SORT_SLICE)
        mine = m < placed_n
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            b64 = b.to(tl.int64)
            ws = ws_ptr + b64 * ws_stride
            miss_host = _words(ws, LAYOUT.miss_host, tl.int64)
            h = tl.load(miss_host + m, mask=mine, other=0)
            before = tl.zeros([_SORT_SLICE], tl.int32)
            other = tl.arange(0, _SORT_TILE)
            while tl.min(other, axis=0) < placed_n:
                h2 = tl.load(miss_host + other, mask=other < placed_n, other=0)
                earlier = (h2[None, :] < h[:, None]) | ((h2[None, :] == h[:, None]) & (other[None, :] < m[:, None]))
                before += tl.sum((earlier & (other < placed_n)[None, :]).to(tl.int32), axis=1)
                other += _SORT_TILE
            row = b64 * plan_stride
            tl.store(src_ptr + row + before, h, mask=mine)
            tl.store(dst_ptr + row + before, tl.load(ws + LAYOUT.miss_loc + m, mask=mine, other=-1), mask=mine)


# ---------------------------------------------------------------------------------------------------------------------
# Launch


LAUNCHES = LaunchCache()  # this module's recorded calls (the benchmarks and tests read its counts)


def run_swap_in(
    call: SwapInCall,
    launch: ResolveLaunch | None = None,
    copy_launch: CopyLaunch | None = None,
    copy: bool = True,
) -> MissPlan:
    """Check, resolve and copy one call (every entry point's launch: :func:`swap_in`, the custom op, the pool, the
    benchmarks); returns the plan written. ``launch``/``copy_launch`` override the tuned launch shapes and
    ``copy=False`` skips the host->device copy (both for benchmarks: a call without its copy breaks the contract). A
    call laid out like a checked one that allocated nothing is launched again from its record
    (``kvplan.kernels.launch_cache``)."""
    launch = launch or RESOLVE_LAUNCH  # keyed as launched (tests and benchmarks swap the defaults)
    copy_launch = copy_launch or COPY_LAUNCH
    allocates = call.miss_src is None or call.workspace is None
    key = None if allocates else LAUNCHES.key((*call, launch, copy_launch, copy))
    if LAUNCHES.relaunch(key, call.top_k_tokens):
        return MissPlan(call.miss_src, call.miss_dst, call.miss_count)
    dims = check_swap_in(call)
    recorder = Recorder()
    plan = _launch_swap_in(call, dims, recorder, launch, copy_launch, copy)
    LAUNCHES.remember(key, recorder)
    return plan


def _launch_swap_in(
    call: SwapInCall,
    dims: SwapInDims,
    recorder: Recorder,
    launch: ResolveLaunch,
    copy_launch: CopyLaunch,
    copy: bool,
) -> MissPlan:
    """The launches of a checked call (allocating the plan and workspace when not given)."""
    miss_src, miss_dst, miss_count, workspace = call.miss_src, call.miss_dst, call.miss_count, call.workspace
    batch, n = dims.batch, dims.occurrences
    device = call.top_k_tokens.device
    if miss_src is None:
        miss_src = torch.empty(batch, n, dtype=torch.int64, device=device)
        miss_dst = torch.empty(batch, n, dtype=torch.int32, device=device)
        miss_count = torch.empty(batch, dtype=torch.int32, device=device)
    plan = MissPlan(miss_src, miss_dst, miss_count)
    if batch == 0:
        return plan
    if workspace is None:
        workspace = torch.empty(
            batch, swap_in_workspace_columns(dims.steps, dims.top_k), dtype=torch.int64, device=device
        )
    layout = swap_in_workspace_regions(dims.steps, dims.top_k)
    # int64 rows read as int32 words (unit column stride checked); without occurrences only the prep launch runs,
    # which then never touches the workspace (it may have no columns): any int32 tensor stands in
    ws32 = workspace.view(torch.int32) if n else miss_count
    occ_chunk = min(next_pow2(n), max(launch.occ_chunk, OCC_CHUNK_MIN))
    hot_chunk = max(HOT_CHUNK_MIN, min(next_pow2(dims.hot), launch.hot_chunk))
    occ_chunks, hot_chunks = triton.cdiv(max(n, 1), occ_chunk), triton.cdiv(dims.hot, hot_chunk)
    shape = ResolveShape(dims.steps, dims.top_k, dims.hot, dims.tail, occ_chunk, hot_chunk, occ_chunks, hot_chunks,
                         next_pow2(occ_chunks), next_pow2(hot_chunks))  # fmt: skip
    has_rows = call.host_cache.shape[1] > 0
    # small batches: the place launch writes the plan in miss order and copies each chunk's rows itself (``copy=False``,
    # for benchmarks, leaves the copy out but keeps the plan's order); else a sort kernel and the ordered copy follow
    fused = (launch.fused_copy if launch.fused_copy is not None else batch <= FUSED_COPY_MAX_BATCH) and has_rows
    word = row_word_dtype(call.host_cache, call.device_buffer)
    host_words, dev_words = as_words(call.host_cache, word), as_words(call.device_buffer, word)
    row = RowCopy(host_words.stride(0), dev_words.stride(0), host_words.shape[1], next_pow2(host_words.shape[1]),
                  min(_FUSED_COPY_ROWS, next_pow2(max(n, 1))))  # fmt: skip
    tokens = call.top_k_tokens if call.speculative else call.top_k_tokens.unsqueeze(1)  # [B, S, K]
    out = call.top_k_device_locs if call.speculative else call.top_k_device_locs.unsqueeze(1)
    rows = (call.req_pool_indices.stride(0), call.seq_lens.stride(0), batch, dims.requests)  # see _row_of
    num_real = miss_count if call.num_real_reqs is None else call.num_real_reqs  # unread stand-ins: a valid tensor
    counters = miss_src if call.counters is None else call.counters
    has_num_real = call.num_real_reqs is not None
    with device_guard(device):
        recorder.launch(
            _prep_kernel, (occ_chunks, batch),  # axis 0: occurrence chunk, axis 1: batch row
            tokens, tokens.stride(), out, out.stride(), call.req_pool_indices, call.seq_lens, num_real, rows,
            call.device_buffer_tokens, call.device_buffer_locs, call.device_buffer_tokens.stride(0), miss_count, ws32,
            ws32.stride(0) if n else 0,
            SPEC=call.speculative, SHAPE=shape, LAYOUT=layout, HAS_NUM_REAL=has_num_real, num_warps=launch.num_warps,
        )  # fmt: skip
        if n:
            recorder.launch(
                _insert_kernel, (occ_chunks, batch),  # axis 0: occurrence chunk, axis 1: batch row
                tokens, tokens.stride(), call.req_pool_indices, call.seq_lens, num_real, rows, ws32, ws32.stride(0),
                SHAPE=shape, LAYOUT=layout, HAS_NUM_REAL=has_num_real, num_warps=launch.num_warps,
            )  # fmt: skip
            scratch = call.device_buffer_locs if call.scratch_locs is None else call.scratch_locs
            recorder.launch(
                _place_kernel, (hot_chunks + occ_chunks + hot_chunks, batch),  # axis 0: ticket role, axis 1: row
                tokens, tokens.stride(), out, out.stride(), call.req_pool_indices, call.seq_lens, num_real, rows,
                call.device_buffer_tokens, call.device_buffer_locs, call.lru_slots, call.host_cache_locs, scratch,
                (call.device_buffer_tokens.stride(0), call.lru_slots.stride(0), call.host_cache_locs.stride(0),
                 scratch.stride(0)),
                (dims.max_len, dims.scratch), miss_src, miss_dst, miss_src.stride(0), miss_count, ws32, ws32.stride(0),
                counters, host_words, dev_words,
                (host_words.shape[0], dev_words.shape[0]), call.host_cache.shape[1] * call.host_cache.element_size(),
                SPEC=call.speculative, SHAPE=shape, LAYOUT=layout, ROW=row, HAS_NUM_REAL=has_num_real,
                HAS_COUNTERS=call.counters is not None, FUSED=fused, COPY=copy, num_warps=launch.num_warps,
            )  # fmt: skip
            if not fused:  # the plan in host-row order, for this copy and every replay
                recorder.launch(
                    _sort_plan_kernel, (triton.cdiv(n, SORT_SLICE), batch),  # axis 0: plan slice, axis 1: row
                    call.req_pool_indices, call.seq_lens, num_real, rows, ws32, ws32.stride(0), miss_count, miss_src,
                    miss_dst, miss_src.stride(0),
                    SHAPE=shape, LAYOUT=layout, HAS_NUM_REAL=has_num_real, num_warps=8,
                )  # fmt: skip
    if n and copy and has_rows and not fused:
        launch_copy(
            plan,
            call.host_cache,
            call.device_buffer,
            num_real_reqs=call.num_real_reqs,
            counters=call.counters,
            counter_base=SWAP_IN_COPY_BASE,
            recorder=recorder,
            batch=batch,
            launch=copy_launch,
        )
    return plan


def swap_in(
    state: HotBufferState, top_k_tokens: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, speculative: bool | None = None,
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
        A row is a set of copies: in host-row order above ``FUSED_COPY_MAX_BATCH`` rows, in miss order otherwise.
    workspace : Tensor, optional
        Overwritten scratch, int64 ``[>= B, >= swap_in_workspace_columns(S, K)]`` (allocated per call if ``None``).
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: hits, overflow, rows and bytes copied.
    speculative : bool, optional
        ``None``: from ``top_k_tokens``' rank. ``True``/``False`` insists on a path: a tensor of the other rank is
        refused with the engines' message (``speculative top_k_tokens must have shape [batch, steps, top_k].``).

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
            speculative, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs, plan, workspace, counters,
        )  # fmt: skip
    )
    return written if plan is None else plan


def swap_in_spec(*args, **kwargs) -> MissPlan:
    """:func:`swap_in` on the speculative path (``speculative=True``): the name SGLang's coordinators call."""
    return swap_in(*args, speculative=True, **kwargs)
