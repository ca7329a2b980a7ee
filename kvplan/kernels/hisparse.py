"""HiSparse swap-in in Triton (docs/kernels.md §2-§3): one batch row resolved by many programs, in three launches.

A row's ``N = S*K`` occurrences are split into chunks of ``CH`` and its ``HOT`` LRU positions into chunks of ``HCH``;
every launch runs several programs per row, so batch 1 fills the GPU instead of one SM. What one program decides,
others read from the row's workspace (regions in ``kvplan.kernels.layout``):

1. **prep**: clear the row's hash table and counters; resolve what needs no table (padding and short rows entirely;
   invalid occurrences, the newest token of the single-step path, tail hits of the speculative path) and mark the
   rest *wanted*.
2. **insert**: wanted occurrences insert ``token << 32 | occurrence`` into the table (open addressing, one
   compare-and-swap per probe); an entry keeps its token's first occurrence (``atomic_min`` on the packed key).
3. **place**, one launch whose programs take tickets in the order they start and wait only on lower tickets (so
   nothing deadlocks, whatever the GPU schedules, and the interpreter runs it in order):
   - *hot chunks* (the first tickets): every LRU position looks its slot's token up; a found token is a hit. The
     entry keeps the least recently used such position and its slot (``atomic_min`` of ``position << 16 | slot``);
     each position gets its hit bit, each chunk publishes its count of evictable positions.
   - *occurrence chunks*: once every hot chunk has published, first occurrences of tokens no slot holds are misses;
     backed ones (host row ``>= 0``) are ranked within the chunk and the chunk publishes its count. Waiting for the
     lower chunks' counts gives each miss its rank ``m`` in first-occurrence order; the ``m``-th evictable position
     (found from the hot chunks' counts and hit bits) is its slot, then scratch rows, then ``-1``. Outputs, plan
     entries and the filled slots' tokens are written, then the chunk's plan rows are copied from the host
     (zero-copy, so the copy is spread over every program of every row).
   - *the LRU programs* (the last tickets, one per hot chunk): once every occurrence chunk has counted its misses,
     each moves its chunk's positions to the new order (``evictables[M:] ++ evictables[:M] ++ hits``) from the
     workspace copy of the old row; the first also writes ``miss_count`` and counts the overflow.

Each result is deterministic (the table layout is not, but nothing observable depends on it). Every state access is
masked against its table: out-of-range ``rid``, tokens, LRU entries and rows never touch memory outside the tensors,
with the outcomes the reference defines.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvplan.calls import SwapInCall, swap_in_call
from kvplan.counters import HITS, OVERFLOW, SWAP_IN_COPY_BASE
from kvplan.kernels._launch import LaunchCache, Recorder, as_words, device_guard, next_pow2, row_word_dtype
from kvplan.kernels.copy import COPY_LAUNCH, CopyLaunch, add_copy_counters, copy_plan_rows, launch_copy
from kvplan.kernels.layout import HOT_CHUNK_MIN, OCC_CHUNK_MIN, swap_in_workspace_columns, swap_in_workspace_layout
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import SwapInDims, check_swap_in

__all__ = ["ResolveLaunch", "swap_in", "swap_in_spec"]

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_COPY_BASE = tl.constexpr(SWAP_IN_COPY_BASE)
_NONE = tl.constexpr(0x7FFFFFFF)  # "no hot slot holds this token" in the table's hot region
_HASH = tl.constexpr(0x61C88647)  # odd multiplier (2**32 / golden ratio, negated): Fibonacci hashing
_WINDOW = tl.constexpr(4)  # table entries one lookup round reads per lane
_TAIL_BLOCK = tl.constexpr(64)  # tail slots compared per step of the tail search
_PUBLISHED = tl.constexpr(1 << 30)  # flag bit of a published count


@attrs.frozen
class ResolveLaunch:
    """Launch shape of the resolve: occurrences and LRU positions per program, warps per program, and whether
    the place launch copies the rows itself (else a separate copy launch does)."""

    occ_chunk: int = 128
    hot_chunk: int = 256
    num_warps: int = 8
    fused_copy: bool = True


RESOLVE_LAUNCH = ResolveLaunch()


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
    """Insert ``token`` with occurrence ``occ`` for every active lane; returns each lane's entry (-1 inactive).
    Lanes of one token share its entry, which keeps their smallest occurrence."""
    packed = (token.to(tl.int64) << 32) | occ.to(tl.int64)
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        at = pos & ((1 << LOG_TB) - 1)
        # settled lanes compare against -2, which no entry holds: their compare-and-swap writes nothing
        old = tl.atomic_cas(keys_ptr + at, tl.where(pending, -1, -2).to(tl.int64), packed)
        claimed = pending & (old == -1)
        same = pending & ((old >> 32) == token)
        tl.atomic_min(keys_ptr + at, packed, mask=same & ((old & 0xFFFFFFFF) > occ))
        done = claimed | same
        entry = tl.where(done, at, entry)
        pending = pending & ~done
        pos += 1
    return entry


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


# ---------------------------------------------------------------------------------------------------------------------
# The three launches share one kernel (``PHASE``) and one argument list; each compiles its own variant.

# Integer arguments are not specialised on their values: one compiled variant per geometry, not per batch size.
_RUNTIME_INTS = (
    "tok_sb tok_ss tok_sk out_sb out_ss out_sk rpi_s seq_s state_stride lru_stride hcl_stride max_len "
    "scratch_stride scratch_cols num_requests plan_stride ws_stride batch n_host n_dev row_bytes"
).split()


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _resolve_kernel(
    tokens_ptr,
    tok_sb,
    tok_ss,
    tok_sk,
    out_ptr,
    out_sb,
    out_ss,
    out_sk,
    rpi_ptr,
    rpi_s,
    seq_ptr,
    seq_s,
    dbt_ptr,
    dbl_ptr,
    state_stride,
    lru_ptr,
    lru_stride,
    hcl_ptr,
    hcl_stride,
    max_len,
    scratch_ptr,
    scratch_stride,
    scratch_cols,
    num_requests,
    src_ptr,
    dst_ptr,
    plan_stride,
    count_ptr,
    ws_ptr,
    ws_stride,
    num_real_ptr,
    counters_ptr,
    batch,
    host_ptr,
    dev_ptr,
    n_host,
    n_dev,
    row_bytes,
    PHASE: tl.constexpr,
    SPEC: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    HOT: tl.constexpr,
    P: tl.constexpr,
    CH: tl.constexpr,
    NOC: tl.constexpr,
    NOC_B: tl.constexpr,
    HCH: tl.constexpr,
    NHC: tl.constexpr,
    NHC_B: tl.constexpr,
    HB: tl.constexpr,
    LOG_TB: tl.constexpr,
    CLEAR: tl.constexpr,
    KEYS: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    MISS_RANK: tl.constexpr,
    OLD_LRU: tl.constexpr,
    HIT_BITS: tl.constexpr,
    HOT_CNT: tl.constexpr,
    OCC_CNT: tl.constexpr,
    SYNC: tl.constexpr,
    COUNTS_B: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    FUSED_COPY: tl.constexpr,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    COPY_ROWS: tl.constexpr,
):
    N: tl.constexpr = S * K
    c = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    rid = tl.load(rpi_ptr + b64 * rpi_s).to(tl.int64)
    live = (b < n_real) & (rid >= 0) & (rid < num_requests)
    if SPEC:
        last_len = tl.load(seq_ptr + (b64 * S + S - 1) * seq_s).to(tl.int64)
    else:
        last_len = tl.load(seq_ptr + b64 * seq_s).to(tl.int64)
    long_row = live & (last_len > HOT)
    row = rid * state_stride
    ws = ws_ptr + b64 * ws_stride
    keys = (ws + KEYS).to(tl.pointer_type(tl.int64), bitcast=True)
    tok_row = tokens_ptr + b64 * tok_sb
    out_row = out_ptr + b64 * out_sb
    lru_row = lru_ptr + rid * lru_stride

    if PHASE == 1:
        _prep(
            tok_row,
            tok_ss,
            tok_sk,
            out_row,
            out_ss,
            out_sk,
            seq_ptr,
            seq_s,
            b64,
            dbt_ptr + row,
            dbl_ptr + row,
            count_ptr + b,
            ws,
            keys,
            live,
            long_row,
            last_len,
            c,
            SPEC,
            S,
            K,
            HOT,
            P,
            CH,
            NOC,
            LOG_TB,
            CLEAR,
            HOTE,
            OCC_E,
            HOT_CNT,
            SYNC,
            COUNTS_B,
        )
    elif long_row:
        if PHASE == 2:
            occ = c * CH + tl.arange(0, CH)
            wanted = (occ < N) & (tl.load(ws + OCC_E + occ, mask=occ < N, other=-1) == -2)
            tok = tl.load(tok_row + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=wanted, other=0)
            entry = _table_insert(keys, tok, occ, wanted, LOG_TB)
            tl.store(ws + OCC_E + occ, entry, mask=wanted)
        else:
            ticket = tl.atomic_add(ws + SYNC, 1)  # programs are roles in the order they start
            if ticket < NHC:
                _hot_chunk(dbt_ptr + row, lru_row, ws, keys, ticket, HOT, HCH, LOG_TB, HOTE, OLD_LRU, HIT_BITS, HOT_CNT)
            elif ticket < NHC + NOC:
                _place_chunk(
                    tok_row,
                    tok_ss,
                    tok_sk,
                    out_row,
                    out_ss,
                    out_sk,
                    dbt_ptr + row,
                    dbl_ptr + row,
                    lru_row,
                    hcl_ptr + rid * hcl_stride,
                    max_len,
                    scratch_ptr + rid * scratch_stride,
                    scratch_cols,
                    src_ptr + b64 * plan_stride,
                    dst_ptr + b64 * plan_stride,
                    ws,
                    keys,
                    counters_ptr,
                    ticket - NHC,
                    host_ptr,
                    dev_ptr,
                    n_host,
                    n_dev,
                    row_bytes,
                    SPEC,
                    K,
                    N,
                    HOT,
                    CH,
                    NOC_B,
                    HCH,
                    NHC,
                    NHC_B,
                    HOTE,
                    OCC_E,
                    MISS_RANK,
                    HIT_BITS,
                    HOT_CNT,
                    OCC_CNT,
                    OLD_LRU,
                    HAS_COUNTERS,
                    FUSED_COPY,
                    HOST_STRIDE,
                    DEV_STRIDE,
                    WORDS,
                    BLOCK_W,
                    COPY_ROWS,
                )
            else:
                _rewrite_lru(
                    lru_row,
                    ws,
                    count_ptr + b,
                    counters_ptr,
                    scratch_cols,
                    ticket - NHC - NOC,
                    SPEC,
                    HOT,
                    HCH,
                    NOC,
                    NOC_B,
                    NHC,
                    NHC_B,
                    OLD_LRU,
                    HIT_BITS,
                    HOT_CNT,
                    OCC_CNT,
                    HAS_COUNTERS,
                )


@triton.jit
def _prep(
    tok_row,
    tok_ss,
    tok_sk,
    out_row,
    out_ss,
    out_sk,
    seq_ptr,
    seq_s,
    b64,
    dbt_row,
    dbl_row,
    count_at,
    ws,
    keys,
    live,
    long_row,
    last_len,
    c,
    SPEC: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    HOT: tl.constexpr,
    P: tl.constexpr,
    CH: tl.constexpr,
    NOC: tl.constexpr,
    LOG_TB: tl.constexpr,
    CLEAR: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    HOT_CNT: tl.constexpr,
    SYNC: tl.constexpr,
    COUNTS_B: tl.constexpr,
):
    """Launch 1: everything that needs no table; the table and counters cleared; wanted occurrences marked -2."""
    N: tl.constexpr = S * K
    occ = c * CH + tl.arange(0, CH)
    in_occ = occ < N
    if K > 0:
        step, col = occ // K, occ % K
    else:  # no occurrences (every lane masked): no division by zero
        step, col = occ, occ
    out_ptrs = out_row + step * out_ss + col * out_sk
    tok = tl.load(tok_row + step * tok_ss + col * tok_sk, mask=in_occ, other=-1)
    if SPEC:
        step_len = tl.load(seq_ptr + (b64 * S + step) * seq_s, mask=in_occ, other=0).to(tl.int64)
    else:
        step_len = last_len
    valid = in_occ & (tok >= 0) & (tok < step_len)
    if not live:
        # padding row (or a rid outside the pool, handled as one): §3 writes 0 and a zero count, §2 only -1
        if SPEC:
            tl.store(out_ptrs, tl.zeros([CH], tl.int32), mask=in_occ)
            if c == 0:
                tl.store(count_at, 0)
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
            tl.store(count_at, 0)
    elif N == 0:
        # nothing to resolve: no misses, the LRU order unchanged (the workspace has no columns)
        if c == 0:
            tl.store(count_at, 0)
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
        tl.store(ws + OCC_E + occ, tl.where(wanted, -2, -1), mask=in_occ)
        # clear this program's share of the table (the workspace holds anything before the call)
        TB: tl.constexpr = 1 << LOG_TB
        start = c * CLEAR
        while start < TB:
            e = start + tl.arange(0, CLEAR)
            tl.store(keys + e, tl.full([CLEAR], -1, tl.int64), mask=e < TB)
            tl.store(ws + HOTE + e, tl.full([CLEAR], _NONE, tl.int32), mask=e < TB)
            start += NOC * CLEAR
        if c == 0:
            # every count unpublished, the ticket and LRU-read counters at zero
            w = tl.arange(0, COUNTS_B)
            tl.store(ws + HOT_CNT + w, tl.zeros([COUNTS_B], tl.int32), mask=w < SYNC + 1 - HOT_CNT)


@triton.jit
def _hot_chunk(
    dbt_row,
    lru_row,
    ws,
    keys,
    hc,
    HOT: tl.constexpr,
    HCH: tl.constexpr,
    LOG_TB: tl.constexpr,
    HOTE: tl.constexpr,
    OLD_LRU: tl.constexpr,
    HIT_BITS: tl.constexpr,
    HOT_CNT: tl.constexpr,
):
    """Place launch, hot chunk ``hc``: LRU positions look their slot's token up; hits recorded and counted; the
    old LRU order kept in the workspace (the LRU programs rewrite ``lru_slots`` while others still need it)."""
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    raw = tl.load(lru_row + j, mask=in_hot, other=-1)
    tl.store(_old_lru(ws, OLD_LRU) + j, raw, mask=in_hot)
    slot = raw.to(tl.int32)
    slot_live = in_hot & (slot >= 0) & (slot < HOT)
    token = tl.load(dbt_row + slot, mask=slot_live, other=-1)
    entry = _table_find(keys, token, slot_live & (token >= 0), LOG_TB)
    hit = entry >= 0
    tl.atomic_min(ws + HOTE + entry, (j << 16) | slot, mask=hit)
    # the chunk's hit bits: one int32 word per 32 positions (distinct bits, so their sum is their OR)
    bits = tl.where(hit, 1, 0) << (j % 32)
    words = tl.sum(tl.reshape(bits, [HCH // 32, 32]), axis=1)
    tl.store(ws + HIT_BITS + hc * (HCH // 32) + tl.arange(0, HCH // 32), words)
    _publish(ws + HOT_CNT + hc, tl.sum((in_hot & ~hit).to(tl.int32), axis=0))


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
def _place_chunk(
    tok_row,
    tok_ss,
    tok_sk,
    out_row,
    out_ss,
    out_sk,
    dbt_row,
    dbl_row,
    lru_row,
    hcl_row,
    max_len,
    scratch_row,
    scratch_cols,
    src_row,
    dst_row,
    ws,
    keys,
    counters_ptr,
    oc,
    host_ptr,
    dev_ptr,
    n_host,
    n_dev,
    row_bytes,
    SPEC: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    HOT: tl.constexpr,
    CH: tl.constexpr,
    NOC_B: tl.constexpr,
    HCH: tl.constexpr,
    NHC: tl.constexpr,
    NHC_B: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    MISS_RANK: tl.constexpr,
    HIT_BITS: tl.constexpr,
    HOT_CNT: tl.constexpr,
    OCC_CNT: tl.constexpr,
    OLD_LRU: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    FUSED_COPY: tl.constexpr,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    COPY_ROWS: tl.constexpr,
):
    """Place launch, occurrence chunk ``oc``: misses ranked, slots and rows chosen, outputs and plan written, then
    the chunk's rows copied."""
    hot_counts = _wait_counts(ws + HOT_CNT, NHC, NHC_B)  # every hot chunk has looked its tokens up
    n_evict = tl.sum(hot_counts, axis=0)
    n_evict_before = tl.cumsum(hot_counts, axis=0) - hot_counts
    occ = oc * CH + tl.arange(0, CH)
    in_occ = occ < N
    entry = tl.load(ws + OCC_E + occ, mask=in_occ, other=-1)
    wanted = entry >= 0
    first_occ = (tl.load(keys + entry, mask=wanted, other=-1, cache_modifier=".cg") & 0xFFFFFFFF).to(tl.int32)
    held_by = tl.load(ws + HOTE + entry, mask=wanted, other=_NONE, cache_modifier=".cg")
    held = wanted & (held_by != _NONE)
    # misses at their first occurrence: backed ones ranked within the chunk
    first = wanted & (first_occ == occ)
    miss = first & ~held
    tok = tl.load(tok_row + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=wanted, other=0)
    host = tl.load(hcl_row + tok, mask=miss & (tok < max_len), other=-1)
    flag = (miss & (host >= 0)).to(tl.int32)
    in_chunk = tl.cumsum(flag, axis=0) - flag
    tl.store(ws + MISS_RANK + occ, tl.where(flag != 0, in_chunk, -1), mask=in_occ)
    _publish(ws + OCC_CNT + oc, tl.sum(flag, axis=0))
    if HAS_COUNTERS:
        hits = tl.sum((first & held).to(tl.int32), axis=0)
        if hits > 0:
            tl.atomic_add(counters_ptr + _HITS, hits.to(tl.int64))
    # ranks in first-occurrence order: the misses of lower chunks first (a token's first occurrence is never in a
    # later chunk than its other occurrences)
    occ_counts = _wait_counts(ws + OCC_CNT, oc, NOC_B)
    missed = wanted & ~held
    rank_there = tl.load(ws + MISS_RANK + first_occ, mask=missed, other=-1, cache_modifier=".cg")
    backed = missed & (rank_there >= 0)
    occ_before = tl.cumsum(occ_counts, axis=0) - occ_counts  # exact for chunks <= oc, which is all we read
    m = _lookup(occ_before, tl.where(backed, first_occ // CH, 0)) + rank_there
    admitted = backed & (m < n_evict)
    if SPEC:
        placed_n = n_evict + scratch_cols
    else:
        placed_n = n_evict
    placed = backed & (m < placed_n)
    position = _evictable(ws, m, n_evict_before, hot_counts, admitted, HOT, HCH, HIT_BITS)
    fill = tl.load(_old_lru(ws, OLD_LRU) + position, mask=admitted, other=-1, cache_modifier=".cg").to(tl.int32)
    fill_ok = admitted & (fill >= 0) & (fill < HOT)
    miss_loc = tl.load(dbl_row + fill, mask=fill_ok, other=-1)
    if SPEC:
        scratched = placed & ~admitted
        miss_loc = tl.where(scratched, tl.load(scratch_row + (m - n_evict), mask=scratched, other=-1), miss_loc)
    hit_loc = tl.load(dbl_row + (held_by & 0xFFFF), mask=held, other=-1)
    loc = tl.where(held, hit_loc, tl.where(placed, miss_loc, -1))
    tl.store(out_row + (occ // K) * out_ss + (occ % K) * out_sk, loc, mask=wanted)
    # the token's first occurrence records the plan entry and the filled slot's new token
    owner = placed & first
    tl.store(src_row + m, host, mask=owner)
    tl.store(dst_row + m, loc, mask=owner)
    tl.store(dbt_row + fill, tok, mask=owner & fill_ok)
    if FUSED_COPY:
        # this chunk's plan entries are consecutive: [misses of lower chunks, + its own), cut where placing stops
        lo = tl.sum(occ_counts, axis=0)
        hi = tl.minimum(lo + tl.sum(flag, axis=0), placed_n)
        tl.debug_barrier()  # the plan entries above were written by other threads of this program
        copied = copy_plan_rows(
            host_ptr,
            dev_ptr,
            src_row,
            dst_row,
            lo,
            hi,
            COPY_ROWS,
            n_host,
            n_dev,
            HOST_STRIDE,
            DEV_STRIDE,
            WORDS,
            BLOCK_W,
            COPY_ROWS,
        )
        if HAS_COUNTERS:
            add_copy_counters(counters_ptr, _COPY_BASE, copied, row_bytes)


@triton.jit
def _rewrite_lru(
    lru_row,
    ws,
    count_at,
    counters_ptr,
    scratch_cols,
    hc,
    SPEC: tl.constexpr,
    HOT: tl.constexpr,
    HCH: tl.constexpr,
    NOC: tl.constexpr,
    NOC_B: tl.constexpr,
    NHC: tl.constexpr,
    NHC_B: tl.constexpr,
    OLD_LRU: tl.constexpr,
    HIT_BITS: tl.constexpr,
    HOT_CNT: tl.constexpr,
    OCC_CNT: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Place launch, last tickets: hot chunk ``hc``'s positions move to the new order evictables[M:] ++
    evictables[:M] ++ hits, once every occurrence chunk has counted its misses (``M`` needs them all). The old
    order is read from the workspace copy, so chunks rewrite ``lru_slots`` in place without waiting on each other."""
    hot_counts = _wait_counts(ws + HOT_CNT, NHC, NHC_B)
    n_evict = tl.sum(hot_counts, axis=0)
    n_backed = tl.sum(_wait_counts(ws + OCC_CNT, NOC, NOC_B), axis=0)
    admitted_n = tl.minimum(n_backed, n_evict)
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    evict = in_hot & ~_hit_flags(ws, j, HIT_BITS)
    evict_i = evict.to(tl.int32)
    evict_rank = (
        tl.sum(tl.where(tl.arange(0, NHC_B) < hc, hot_counts, 0), axis=0) + tl.cumsum(evict_i, axis=0) - evict_i
    )
    new_pos = tl.where(
        evict,
        tl.where(evict_rank >= admitted_n, evict_rank - admitted_n, n_evict - admitted_n + evict_rank),
        n_evict + j - evict_rank,
    )
    slot = tl.load(_old_lru(ws, OLD_LRU) + j, mask=in_hot, other=0, cache_modifier=".cg")
    tl.store(lru_row + new_pos, slot, mask=in_hot)
    if hc == 0:
        if SPEC:
            placed_n = admitted_n + tl.minimum(n_backed - admitted_n, scratch_cols)
        else:
            placed_n = admitted_n
        tl.store(count_at, placed_n)
        if HAS_COUNTERS:
            overflow = n_backed - placed_n
            if overflow > 0:
                tl.atomic_add(counters_ptr + _OVERFLOW, overflow.to(tl.int64))


@triton.jit
def _old_lru(ws, OLD_LRU: tl.constexpr):
    """The workspace copy of the row's old ``lru_slots`` (int16)."""
    return (ws + OLD_LRU).to(tl.pointer_type(tl.int16), bitcast=True)


@triton.jit
def _hit_flags(ws, j, HIT_BITS: tl.constexpr):
    """Whether LRU positions ``j`` hold a wanted token (the hot chunks' published bits)."""
    return ((tl.load(ws + HIT_BITS + j // 32, cache_modifier=".cg") >> (j % 32)) & 1) != 0


# ---------------------------------------------------------------------------------------------------------------------
# Launch


_LAUNCHES = LaunchCache()


def _swap_in(
    call: SwapInCall,
    launch: ResolveLaunch | None = None,
    copy_launch: CopyLaunch | None = None,
    copy: bool = True,
) -> MissPlan:
    """Check, resolve and copy; returns the plan written. ``launch``/``copy_launch`` override the tuned launch shapes
    and ``copy=False`` skips the host->device copy (both for benchmarks: a call without its copy breaks the
    contract). A call laid out like a checked one that allocated nothing is replayed (``kvplan.kernels._launch``)."""
    allocates = call.miss_src is None or call.workspace is None
    key = None if allocates else _LAUNCHES.key((*call, launch, copy_launch, copy))
    if _LAUNCHES.replay(key, call.top_k_tokens):
        return MissPlan(call.miss_src, call.miss_dst, call.miss_count)
    dims = check_swap_in(call)
    recorder = Recorder()
    plan = _launch_swap_in(call, dims, recorder, launch, copy_launch, copy)
    _LAUNCHES.remember(key, recorder)
    return plan


def _launch_swap_in(
    call: SwapInCall,
    dims: SwapInDims,
    recorder: Recorder,
    launch: ResolveLaunch | None,
    copy_launch: CopyLaunch | None,
    copy: bool,
) -> MissPlan:
    """The launches of a checked call (allocating the plan and workspace when not given)."""
    miss_src, miss_dst, miss_count, workspace = call.miss_src, call.miss_dst, call.miss_count, call.workspace
    batch, n = dims.batch, dims.occurrences
    launch = launch or RESOLVE_LAUNCH
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
    layout = swap_in_workspace_layout(dims.steps, dims.top_k)
    # int64 rows read as int32 words (unit column stride checked); without occurrences only the prep launch runs,
    # which then never touches the workspace (it may have no columns): any int32 tensor stands in
    ws32 = workspace.view(torch.int32) if n else miss_count
    occ_chunk = min(next_pow2(n), max(launch.occ_chunk, OCC_CHUNK_MIN))
    hot_chunk = max(HOT_CHUNK_MIN, min(next_pow2(dims.hot), launch.hot_chunk))
    noc = triton.cdiv(max(n, 1), occ_chunk)
    nhc = triton.cdiv(dims.hot, hot_chunk)
    fused = copy and launch.fused_copy and call.host_cache.shape[1] > 0
    word = row_word_dtype(call.host_cache, call.device_buffer)
    host_words, dev_words = as_words(call.host_cache, word), as_words(call.device_buffer, word)
    copy_rows = min((copy_launch or COPY_LAUNCH).rows_per_program, next_pow2(max(n, 1)))
    tokens_3d = call.top_k_tokens if call.speculative else call.top_k_tokens.unsqueeze(1)
    out_3d = call.top_k_device_locs if call.speculative else call.top_k_device_locs.unsqueeze(1)
    # unused pointers get a valid tensor of the right kind; the kernel never reads them
    scratch = call.device_buffer_locs if call.scratch_locs is None else call.scratch_locs
    args = (
        tokens_3d,
        tokens_3d.stride(0),
        tokens_3d.stride(1),
        tokens_3d.stride(2),
        out_3d,
        out_3d.stride(0),
        out_3d.stride(1),
        out_3d.stride(2),
        call.req_pool_indices,
        call.req_pool_indices.stride(0),
        call.seq_lens,
        call.seq_lens.stride(0),
        call.device_buffer_tokens,
        call.device_buffer_locs,
        call.device_buffer_tokens.stride(0),
        call.lru_slots,
        call.lru_slots.stride(0),
        call.host_cache_locs,
        call.host_cache_locs.stride(0),
        dims.max_len,
        scratch,
        scratch.stride(0),
        dims.scratch,
        dims.requests,
        miss_src,
        miss_dst,
        miss_src.stride(0),
        miss_count,
        ws32,
        ws32.stride(0) if n else 0,
        miss_count if call.num_real_reqs is None else call.num_real_reqs,
        miss_src if call.counters is None else call.counters,
        batch,
        host_words,
        dev_words,
        host_words.shape[0],
        dev_words.shape[0],
        call.host_cache.shape[1] * call.host_cache.element_size(),
    )
    constants = dict(
        SPEC=call.speculative,
        S=dims.steps,
        K=dims.top_k,
        HOT=dims.hot,
        P=dims.tail,
        CH=occ_chunk,
        NOC=noc,
        NOC_B=next_pow2(noc),
        HCH=hot_chunk,
        NHC=nhc,
        NHC_B=next_pow2(nhc),
        HB=next_pow2(dims.hot),
        LOG_TB=layout.table_size.bit_length() - 1,
        CLEAR=next_pow2(triton.cdiv(layout.table_size, noc)),
        KEYS=layout.keys,
        HOTE=layout.hot,
        OCC_E=layout.occ_entry,
        MISS_RANK=layout.miss_rank,
        OLD_LRU=layout.old_lru,
        HIT_BITS=layout.hit_bits,
        HOT_CNT=layout.hot_counts,
        OCC_CNT=layout.occ_counts,
        SYNC=layout.sync,
        COUNTS_B=next_pow2(layout.sync + 1 - layout.hot_counts),
        HAS_NUM_REAL=call.num_real_reqs is not None,
        HAS_COUNTERS=call.counters is not None,
        HOST_STRIDE=host_words.stride(0),
        DEV_STRIDE=dev_words.stride(0),
        WORDS=host_words.shape[1],
        BLOCK_W=next_pow2(host_words.shape[1]),
        COPY_ROWS=copy_rows,
        num_warps=launch.num_warps,
    )
    grids = {1: noc, 2: noc, 3: nhc + noc + nhc} if n else {1: 1}
    with device_guard(device):
        for phase, programs in grids.items():
            # only the place launch copies: the others share one compiled variant whatever the copy does
            recorder.launch(
                _resolve_kernel, (programs, batch), *args, PHASE=phase, FUSED_COPY=fused and phase == 3, **constants
            )
    if copy and not fused:
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


_PARAMETERS = """
    Parameters
    ----------
    state : HotBufferState
        Read and written (``device_buffer_tokens``, ``lru_slots``): the engine's hot-buffer tables, docs/kernels.md §1.
    top_k_tokens : Tensor
        Read. int32 ``{tokens}``: token ids; anything outside ``[0, that step's length)`` resolves to ``-1``.
    top_k_device_locs : Tensor
        Written. int32, ``top_k_tokens``' shape: the device row serving each token (``-1`` for none).
    req_pool_indices : Tensor
        Read. int32/int64 ``[>= B]``: the request slot ``rid`` of each batch row.
    seq_lens : Tensor
        Read. int32/int64 ``{lens}``.
    host_cache : Tensor
        Read. ``[host_rows, item]`` KV rows, pinned host memory (read zero-copy) or on the device.
    device_buffer : Tensor
        Written (the rows of missed tokens). ``[device_rows, item]``, ``host_cache``'s dtype, on the device.
    num_real_reqs : Tensor, optional
        Read on the device. ``[1]`` int32: batch rows from it on are CUDA-graph padding (``None``: all are real).
    plan : MissPlan, optional
        Written: entries ``[0, count[b])`` and ``count[:B]``; ``[>= B, >= {columns}]`` (allocated per call if ``None``).
    workspace : Tensor, optional
        Overwritten scratch, int64 ``[>= B, >= swap_in_workspace_columns({steps})]`` (allocated per call if ``None``).
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: hits, overflow, rows and bytes copied.

    Returns the plan written (``plan`` itself when given). Given ``plan`` and ``workspace`` it allocates nothing and
    never synchronises (CUDA-graph capturable).
"""


def swap_in(
    state: HotBufferState, top_k_tokens: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> MissPlan:  # fmt: skip
    """Single-step swap-in (docs/kernels.md §2): resolve ``top_k_tokens [B, K]`` into ``top_k_device_locs``, admit
    misses into LRU hot slots, record the plan and copy the missing rows from ``host_cache``. The state's scratch rows
    are not used (a state with or without them works).
    """
    written = _swap_in(
        swap_in_call(
            False, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs, plan, workspace, counters,
        )  # fmt: skip
    )
    return written if plan is None else plan


def swap_in_spec(
    state: HotBufferState, top_k_tokens: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> MissPlan:  # fmt: skip
    """Speculative swap-in (docs/kernels.md §3): the ``S*K`` occurrences of ``top_k_tokens [B, S, K]`` form one
    working set; each distinct miss is copied once, overflow goes to the state's ``scratch_locs`` rows, then ``-1``
    (counted).
    """
    written = _swap_in(
        swap_in_call(
            True, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs, plan, workspace, counters,
        )  # fmt: skip
    )
    return written if plan is None else plan


swap_in.__doc__ += _PARAMETERS.format(tokens="[B, K]", lens="[>= B]: each row's length", columns="K", steps="1, K")
swap_in_spec.__doc__ += _PARAMETERS.format(
    tokens="[B, S, K]",
    lens="[>= B*S]: the length at each draft step, request-major (``seq_lens[b*S + s]``)",
    columns="S*K",
    steps="S, K",
)
