"""HiSparse swap-in in Triton (kernels.md §2-§3): one batch row resolved by many programs, in five short launches.

A row's ``N = S*K`` occurrences are split into chunks of ``CH`` and its ``HOT`` LRU positions into chunks of ``HCH``;
every phase runs one program per chunk of every row, so batch 1 fills the GPU instead of one SM. What one phase
decides, the next reads from the row's workspace (regions in ``kvplan.kernels.layout``):

1. **prep**: clear the row's hash table; resolve what needs no table (padding and short rows entirely; invalid
   occurrences, the newest token of the single-step path, tail hits of the speculative path) and mark the rest
   *wanted*.
2. **insert**: wanted occurrences insert their token into the table (open addressing, compare-and-swap); each
   table entry keeps its token's first occurrence (``atomic_min``), each occurrence its entry.
3. **hot**: every LRU position looks its slot's token up; a found token is a hit. The entry keeps the least recently
   used such position and its slot (``atomic_min`` of ``position << 16 | slot``), each position its hit bit, each
   chunk its count of evictable positions.
4. **rank**: first occurrences of tokens no slot holds are the misses; backed ones (a host row ``>= 0``) get their
   rank within their chunk and each chunk its count. Hot chunks list their evictable slots by global LRU rank (a
   prefix of the chunk counts), as far as a miss can reach (rank ``< N``).
5. **place**: each occurrence reads its token's row: the hit slot's, or for the ``m``-th backed miss (rank = prefix
   of chunk counts + rank in chunk) the ``m``-th evictable slot, then scratch rows, then ``-1``. First occurrences
   record the plan entry and the slot's new token, then copy their chunk's plan rows from the host (zero-copy,
   spread over all programs). One program per row rewrites the LRU row (``evictables[M:] ++ evictables[:M] ++
   hits``), holding it whole in registers so the rewrite can be in place.

Every phase is a separate launch: programs of one launch never wait on each other, so the kernels run the same
under Triton's interpreter, never deadlock and stay CUDA-graph capturable. Each result is deterministic (the table
layout is not, but nothing observable depends on it). Every state access is masked against its table: out-of-range
``rid``, tokens, LRU entries and rows never touch memory outside the tensors, with the outcomes the reference
defines.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvplan.counters import HITS, OVERFLOW, SWAP_IN_COPY_BASE
from kvplan.kernels import checks
from kvplan.kernels._launch import as_words, device_guard, next_pow2, row_word_dtype
from kvplan.kernels.copy import COPY_LAUNCH, CopyLaunch, add_copy_counters, copy_plan_rows, launch_copy
from kvplan.kernels.layout import HOT_CHUNK_MIN, OCC_CHUNK_MIN, swap_in_workspace_columns, swap_in_workspace_layout

__all__ = ["ResolveLaunch", "swap_in", "swap_in_spec"]

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_COPY_BASE = tl.constexpr(SWAP_IN_COPY_BASE)
_NONE = tl.constexpr(0x7FFFFFFF)  # "no hot slot holds this token" in the table's hot region
_HASH = tl.constexpr(0x61C88647)  # odd multiplier (2**32 / golden ratio, negated): Fibonacci hashing
_WINDOW = tl.constexpr(4)  # table entries one probe round reads per lane
_TAIL_BLOCK = tl.constexpr(16)  # tail slots compared per step of the tail search


@attrs.frozen
class ResolveLaunch:
    """Launch shape of the resolve phases: occurrences and LRU positions per program, warps per program, and
    whether the place phase copies the rows itself (else a separate copy launch does)."""

    occ_chunk: int = 256
    hot_chunk: int = 256
    num_warps: int = 4
    fused_copy: bool = True


RESOLVE_LAUNCH = ResolveLaunch()


# ---------------------------------------------------------------------------------------------------------------------
# Hash table of a row's wanted tokens (keys >= 0, -1 empty; linear probing, never deleted within a call)


@triton.jit
def _hash(key, LOG_TB: tl.constexpr):
    """Fibonacci hash of int32 keys to ``[0, 2**LOG_TB)``: the top bits of ``key * _HASH`` (mod 2**32)."""
    mixed = (key * _HASH).to(tl.uint32, bitcast=True)
    return (mixed >> (32 - LOG_TB)).to(tl.int32)


@triton.jit
def _probe_window(keys_ptr, key, pending, pos, LOG_TB: tl.constexpr):
    """One probe round: the first of ``_WINDOW`` entries from ``pos`` that holds ``key`` or is empty.
    Returns (its offset in the window, ``_WINDOW`` when none; its entry index; its value)."""
    w = tl.arange(0, _WINDOW)
    idx = (pos[:, None] + w[None, :]) & ((1 << LOG_TB) - 1)
    # .cg: read the table from L2, where other programs' compare-and-swaps land, not from a stale L1 line
    cur = tl.load(keys_ptr + idx, mask=pending[:, None], other=-2, cache_modifier=".cg")
    stop = (cur == key[:, None]) | (cur == -1)
    first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
    at = (pos + first) & ((1 << LOG_TB) - 1)
    value = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
    return first, at, value


@triton.jit
def _table_insert(keys_ptr, key, active, LOG_TB: tl.constexpr):
    """Insert ``key`` for every active lane (duplicates share an entry); returns each lane's entry (-1 inactive)."""
    pos = _hash(key, LOG_TB)
    entry = tl.full(key.shape, -1, tl.int32)
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        first, at, value = _probe_window(keys_ptr, key, pending, pos, LOG_TB)
        stopped = pending & (first < _WINDOW)
        claim = stopped & (value == -1)
        # lanes that claim nothing compare against -3, which no entry holds: their CAS writes nothing
        old = tl.atomic_cas(keys_ptr + at, tl.where(claim, -1, -3), key)
        done = (stopped & (value == key)) | (claim & ((old == -1) | (old == key)))
        entry = tl.where(done, at, entry)
        # a lost race (another key took the empty entry) resumes just after it; a full window after the window
        pos = tl.where(stopped, at + 1, pos + _WINDOW)
        pending = pending & ~done
    return entry


@triton.jit
def _table_find(keys_ptr, key, active, LOG_TB: tl.constexpr):
    """The entry holding ``key`` for every active lane, -1 when absent (the table is complete: read only)."""
    pos = _hash(key, LOG_TB)
    entry = tl.full(key.shape, -1, tl.int32)
    pending = active
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        first, at, value = _probe_window(keys_ptr, key, pending, pos, LOG_TB)
        stopped = pending & (first < _WINDOW)
        entry = tl.where(stopped & (value == key), at, entry)
        pos += _WINDOW
        pending = pending & ~stopped
    return entry


# ---------------------------------------------------------------------------------------------------------------------
# The five phases share one kernel (``PHASE``) and one argument list; each launch compiles its own variant.

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
    FIRST: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    MISS_RANK: tl.constexpr,
    EVICT_LIST: tl.constexpr,
    HIT_BITS: tl.constexpr,
    EVICT_CNT: tl.constexpr,
    MISS_CNT: tl.constexpr,
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
    out_row = out_ptr + b64 * out_sb

    if PHASE == 1:
        _prep(
            tokens_ptr + b64 * tok_sb,
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
            KEYS,
            FIRST,
            HOTE,
            OCC_E,
        )
    elif long_row:
        if PHASE == 2:
            occ = c * CH + tl.arange(0, CH)
            wanted = (occ < N) & (tl.load(ws + OCC_E + occ, mask=occ < N, other=-1) == -2)
            tok = tl.load(tokens_ptr + b64 * tok_sb + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=wanted, other=0)
            entry = _table_insert(ws + KEYS, tok, wanted, LOG_TB)
            tl.store(ws + OCC_E + occ, entry, mask=wanted)
            tl.atomic_min(ws + FIRST + entry, occ, mask=wanted)
        elif PHASE == 3:
            _hot_lookup(
                dbt_ptr + row, lru_ptr + rid * lru_stride, ws, c, HOT, HCH, LOG_TB, KEYS, HOTE, HIT_BITS, EVICT_CNT
            )
        elif PHASE == 4:
            if c < NOC:
                _rank_misses(
                    tokens_ptr + b64 * tok_sb,
                    tok_ss,
                    tok_sk,
                    hcl_ptr + rid * hcl_stride,
                    max_len,
                    ws,
                    counters_ptr,
                    c,
                    K,
                    N,
                    CH,
                    FIRST,
                    HOTE,
                    OCC_E,
                    MISS_RANK,
                    MISS_CNT,
                    HAS_COUNTERS,
                )
            else:
                _list_evictables(
                    lru_ptr + rid * lru_stride, ws, c - NOC, N, HOT, HCH, NHC_B, EVICT_LIST, HIT_BITS, EVICT_CNT
                )
        else:
            hot_chunks = tl.arange(0, NHC_B)
            n_evict = tl.sum(tl.load(ws + EVICT_CNT + hot_chunks, mask=hot_chunks < NHC, other=0), axis=0)
            chunks = tl.arange(0, NOC_B)
            miss_cnt = tl.load(ws + MISS_CNT + chunks, mask=chunks < NOC, other=0)
            n_backed = tl.sum(miss_cnt, axis=0)
            admitted_n = tl.minimum(n_backed, n_evict)
            if SPEC:
                placed_n = admitted_n + tl.minimum(n_backed - admitted_n, scratch_cols)
            else:
                placed_n = admitted_n
            if c < NOC:
                _place(
                    tokens_ptr + b64 * tok_sb,
                    tok_ss,
                    tok_sk,
                    out_row,
                    out_ss,
                    out_sk,
                    dbt_ptr + row,
                    dbl_ptr + row,
                    hcl_ptr + rid * hcl_stride,
                    max_len,
                    scratch_ptr + rid * scratch_stride,
                    src_ptr + b64 * plan_stride,
                    dst_ptr + b64 * plan_stride,
                    ws,
                    counters_ptr,
                    c,
                    chunks,
                    miss_cnt,
                    admitted_n,
                    placed_n,
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
                    FIRST,
                    HOTE,
                    OCC_E,
                    MISS_RANK,
                    EVICT_LIST,
                    HAS_COUNTERS,
                    FUSED_COPY,
                    HOST_STRIDE,
                    DEV_STRIDE,
                    WORDS,
                    BLOCK_W,
                    COPY_ROWS,
                )
            else:
                _rewrite_lru(lru_ptr + rid * lru_stride, ws, n_evict, admitted_n, HOT, HB, HIT_BITS)
                tl.store(count_ptr + b, placed_n)
                if HAS_COUNTERS:
                    overflow = n_backed - placed_n
                    if overflow > 0:
                        tl.atomic_add(counters_ptr + _OVERFLOW, overflow.to(tl.int64))


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
    KEYS: tl.constexpr,
    FIRST: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
):
    """Phase 1: everything that needs no table; the table cleared; wanted occurrences marked ``-2``."""
    N: tl.constexpr = S * K
    occ = c * CH + tl.arange(0, CH)
    in_occ = occ < N
    out_ptrs = out_row + (occ // K) * out_ss + (occ % K) * out_sk
    tok = tl.load(tok_row + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=in_occ, other=-1)
    if SPEC:
        step_len = tl.load(seq_ptr + (b64 * S + occ // K) * seq_s, mask=in_occ, other=0).to(tl.int64)
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
    else:
        if SPEC:
            # the tail: the lowest tail slot j holding t with a real row, searched _TAIL_BLOCK slots at a time
            best = tl.full([CH], 0x7FFFFFFFFFFFFFFF, tl.int64)
            for j0 in tl.static_range(0, P, _TAIL_BLOCK):
                j = j0 + tl.arange(0, _TAIL_BLOCK)
                tail_tok = tl.load(dbt_row + HOT + j, mask=j < P, other=-1)
                tail_loc = tl.load(dbl_row + HOT + j, mask=j < P, other=-1)
                match = (tok[:, None] == tail_tok[None, :]) & (tail_loc >= 0)[None, :] & valid[:, None]
                packed = (j.to(tl.int64) << 32) | tail_loc.to(tl.int64)
                best = tl.minimum(best, tl.min(tl.where(match, packed[None, :], 0x7FFFFFFFFFFFFFFF), axis=1))
            resolved = best != 0x7FFFFFFFFFFFFFFF
            pre = (best & 0xFFFFFFFF).to(tl.int32)
        else:
            # the newest token lives at slot HOT
            resolved = valid & (tok == last_len - 1)
            pre = tl.zeros([CH], tl.int32) + tl.load(dbl_row + HOT)
        tl.store(out_ptrs, tl.where(resolved, pre, -1), mask=in_occ & ~(valid & ~resolved))
        tl.store(ws + OCC_E + occ, tl.where(valid & ~resolved, -2, -1), mask=in_occ)
        # clear this program's share of the table (the workspace holds anything before the call)
        TB: tl.constexpr = 1 << LOG_TB
        start = c * CLEAR
        while start < TB:
            e = start + tl.arange(0, CLEAR)
            tl.store(ws + KEYS + e, tl.full([CLEAR], -1, tl.int32), mask=e < TB)
            tl.store(ws + FIRST + e, tl.full([CLEAR], 0x7FFFFFFF, tl.int32), mask=e < TB)
            tl.store(ws + HOTE + e, tl.full([CLEAR], _NONE, tl.int32), mask=e < TB)
            start += NOC * CLEAR


@triton.jit
def _hot_lookup(
    dbt_row,
    lru_row,
    ws,
    hc,
    HOT: tl.constexpr,
    HCH: tl.constexpr,
    LOG_TB: tl.constexpr,
    KEYS: tl.constexpr,
    HOTE: tl.constexpr,
    HIT_BITS: tl.constexpr,
    EVICT_CNT: tl.constexpr,
):
    """Phase 3: LRU positions ``[hc*HCH, (hc+1)*HCH)`` look their slot's token up; hits recorded."""
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    slot = tl.load(lru_row + j, mask=in_hot, other=-1).to(tl.int32)
    slot_live = in_hot & (slot >= 0) & (slot < HOT)
    token = tl.load(dbt_row + slot, mask=slot_live, other=-1)
    entry = _table_find(ws + KEYS, token, slot_live & (token >= 0), LOG_TB)
    hit = entry >= 0
    tl.atomic_min(ws + HOTE + entry, (j << 16) | slot, mask=hit)
    # the chunk's hit bits: one int32 word per 32 positions (distinct bits, so their sum is their OR)
    bits = tl.where(hit, 1, 0) << (j % 32)
    words = tl.sum(tl.reshape(bits, [HCH // 32, 32]), axis=1)
    tl.store(ws + HIT_BITS + hc * (HCH // 32) + tl.arange(0, HCH // 32), words)
    tl.store(ws + EVICT_CNT + hc, tl.sum((in_hot & ~hit).to(tl.int32), axis=0))


@triton.jit
def _hit_flags(ws, j, HIT_BITS: tl.constexpr):
    """Whether LRU positions ``j`` hold a wanted token (phase 3's bits)."""
    return ((tl.load(ws + HIT_BITS + j // 32) >> (j % 32)) & 1) != 0


@triton.jit
def _rank_misses(
    tok_row,
    tok_ss,
    tok_sk,
    hcl_row,
    max_len,
    ws,
    counters_ptr,
    c,
    K: tl.constexpr,
    N: tl.constexpr,
    CH: tl.constexpr,
    FIRST: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    MISS_RANK: tl.constexpr,
    MISS_CNT: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    """Phase 4, occurrence chunks: backed misses at their first occurrence get their rank within the chunk."""
    occ = c * CH + tl.arange(0, CH)
    in_occ = occ < N
    entry = tl.load(ws + OCC_E + occ, mask=in_occ, other=-1)
    wanted = entry >= 0
    first = wanted & (tl.load(ws + FIRST + entry, mask=wanted, other=-1) == occ)
    held = tl.load(ws + HOTE + entry, mask=first, other=_NONE) != _NONE
    miss = first & ~held
    tok = tl.load(tok_row + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=miss, other=0)
    host = tl.load(hcl_row + tok, mask=miss & (tok < max_len), other=-1)
    flag = (miss & (host >= 0)).to(tl.int32)
    rank = tl.cumsum(flag, axis=0) - flag
    tl.store(ws + MISS_RANK + occ, tl.where(flag != 0, rank, -1), mask=in_occ)
    tl.store(ws + MISS_CNT + c, tl.sum(flag, axis=0))
    if HAS_COUNTERS:
        hits = tl.sum((first & held).to(tl.int32), axis=0)
        if hits > 0:
            tl.atomic_add(counters_ptr + _HITS, hits.to(tl.int64))


@triton.jit
def _list_evictables(
    lru_row,
    ws,
    hc,
    N: tl.constexpr,
    HOT: tl.constexpr,
    HCH: tl.constexpr,
    NHC_B: tl.constexpr,
    EVICT_LIST: tl.constexpr,
    HIT_BITS: tl.constexpr,
    EVICT_CNT: tl.constexpr,
):
    """Phase 4, hot chunks: evictable slots by LRU rank, the first ``N`` of them (no miss reaches further)."""
    j = hc * HCH + tl.arange(0, HCH)
    in_hot = j < HOT
    evict = in_hot & ~_hit_flags(ws, j, HIT_BITS)
    chunks = tl.arange(0, NHC_B)
    before = tl.sum(tl.load(ws + EVICT_CNT + chunks, mask=chunks < hc, other=0), axis=0)
    flag = evict.to(tl.int32)
    rank = before + tl.cumsum(flag, axis=0) - flag
    listed = evict & (rank < N)
    slot = tl.load(lru_row + j, mask=listed, other=-1).to(tl.int32)
    tl.store(ws + EVICT_LIST + rank, slot, mask=listed)


@triton.jit
def _place(
    tok_row,
    tok_ss,
    tok_sk,
    out_row,
    out_ss,
    out_sk,
    dbt_row,
    dbl_row,
    hcl_row,
    max_len,
    scratch_row,
    src_row,
    dst_row,
    ws,
    counters_ptr,
    c,
    chunks,
    miss_cnt,
    admitted_n,
    placed_n,
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
    FIRST: tl.constexpr,
    HOTE: tl.constexpr,
    OCC_E: tl.constexpr,
    MISS_RANK: tl.constexpr,
    EVICT_LIST: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    FUSED_COPY: tl.constexpr,
    HOST_STRIDE: tl.constexpr,
    DEV_STRIDE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    COPY_ROWS: tl.constexpr,
):
    """Phase 5, occurrence chunks: outputs, plan entries, filled slots' tokens; then this chunk's copies."""
    occ = c * CH + tl.arange(0, CH)
    in_occ = occ < N
    entry = tl.load(ws + OCC_E + occ, mask=in_occ, other=-1)
    wanted = entry >= 0
    first_occ = tl.load(ws + FIRST + entry, mask=wanted, other=-1)
    held_by = tl.load(ws + HOTE + entry, mask=wanted, other=_NONE)
    held = wanted & (held_by != _NONE)
    hit_loc = tl.load(dbl_row + (held_by & 0xFFFF), mask=held, other=-1)
    # misses: rank m = backed misses in earlier chunks + rank within the chunk of the token's first occurrence
    missed = wanted & ~held
    in_chunk = tl.load(ws + MISS_RANK + first_occ, mask=missed, other=-1)
    backed = missed & (in_chunk >= 0)
    earlier = tl.sum(tl.where(chunks[None, :] < (first_occ // CH)[:, None], miss_cnt[None, :], 0), axis=1)
    m = earlier + in_chunk
    admitted = backed & (m < admitted_n)
    placed = backed & (m < placed_n)
    fill = tl.load(ws + EVICT_LIST + m, mask=admitted, other=-1)
    fill_ok = admitted & (fill >= 0) & (fill < HOT)
    miss_loc = tl.load(dbl_row + fill, mask=fill_ok, other=-1)
    if SPEC:
        scratched = placed & ~admitted
        miss_loc = tl.where(scratched, tl.load(scratch_row + (m - admitted_n), mask=scratched, other=-1), miss_loc)
    loc = tl.where(held, hit_loc, tl.where(placed, miss_loc, -1))
    tl.store(out_row + (occ // K) * out_ss + (occ % K) * out_sk, loc, mask=wanted)
    # the token's first occurrence records the plan entry and the filled slot's new token
    owner = placed & (first_occ == occ)
    tok = tl.load(tok_row + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=owner, other=0)
    host = tl.load(hcl_row + tok, mask=owner & (tok < max_len), other=-1)
    tl.store(src_row + m, host, mask=owner)
    tl.store(dst_row + m, loc, mask=owner)
    tl.store(dbt_row + fill, tok, mask=owner & fill_ok)
    if FUSED_COPY:
        # this chunk's plan entries are consecutive: [misses before the chunk, + its own), cut at placed_n
        lo = tl.sum(tl.where(chunks < c, miss_cnt, 0), axis=0)
        hi = tl.minimum(lo + tl.sum(tl.where(chunks == c, miss_cnt, 0), axis=0), placed_n)
        tl.debug_barrier()  # the plan entries above, written by other threads of this program
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
def _rewrite_lru(lru_row, ws, n_evict, admitted_n, HOT: tl.constexpr, HB: tl.constexpr, HIT_BITS: tl.constexpr):
    """Phase 5, one program per row: new LRU order evictables[M:] ++ evictables[:M] ++ hits, in place."""
    j = tl.arange(0, HB)
    in_hot = j < HOT
    hit = in_hot & _hit_flags(ws, j, HIT_BITS)
    evict = in_hot & ~hit
    slot = tl.load(lru_row + j, mask=in_hot, other=0)
    evict_i = evict.to(tl.int32)
    evict_rank = tl.cumsum(evict_i, axis=0) - evict_i
    hit_rank = j - evict_rank
    new_pos = tl.where(
        evict,
        tl.where(evict_rank >= admitted_n, evict_rank - admitted_n, n_evict - admitted_n + evict_rank),
        n_evict + hit_rank,
    )
    tl.debug_barrier()  # the whole old row is read before any of it is overwritten
    tl.store(lru_row + new_pos, slot, mask=in_hot)


# ---------------------------------------------------------------------------------------------------------------------
# Launch


def _swap_in(
    *,
    speculative: bool,
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    scratch_locs: torch.Tensor | None,
    miss_src: torch.Tensor | None,
    miss_dst: torch.Tensor | None,
    miss_count: torch.Tensor | None,
    workspace: torch.Tensor | None,
    counters: torch.Tensor | None,
    launch: ResolveLaunch | None = None,
    copy_launch: CopyLaunch | None = None,
) -> None:
    dims = checks.check_swap_in_args(
        speculative=speculative,
        top_k_tokens=top_k_tokens,
        device_buffer_tokens=device_buffer_tokens,
        host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        lru_slots=lru_slots,
        num_real_reqs=num_real_reqs,
        scratch_locs=scratch_locs,
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        workspace=workspace,
        counters=counters,
    )
    batch, n = dims.batch, dims.occurrences
    if batch == 0:
        return
    launch = launch or RESOLVE_LAUNCH
    device = top_k_tokens.device
    if miss_src is None:
        miss_src = torch.empty(batch, n, dtype=torch.int64, device=device)
        miss_dst = torch.empty(batch, n, dtype=torch.int32, device=device)
        miss_count = torch.empty(batch, dtype=torch.int32, device=device)
    if workspace is None:
        workspace = torch.empty(
            batch, swap_in_workspace_columns(dims.steps, dims.top_k), dtype=torch.int64, device=device
        )
    layout = swap_in_workspace_layout(dims.steps, dims.top_k)
    ws32 = workspace.view(torch.int32)  # int64 rows read as int32 words (unit column stride checked)
    occ_chunk = min(next_pow2(n), max(launch.occ_chunk, OCC_CHUNK_MIN))
    hot_chunk = max(HOT_CHUNK_MIN, min(next_pow2(dims.hot), launch.hot_chunk))
    noc = triton.cdiv(max(n, 1), occ_chunk)
    nhc = triton.cdiv(dims.hot, hot_chunk)
    fused = launch.fused_copy and host_cache.shape[1] > 0
    word = row_word_dtype(host_cache, device_buffer)
    host_words, dev_words = as_words(host_cache, word), as_words(device_buffer, word)
    copy_rows = min((copy_launch or COPY_LAUNCH).rows_per_program, next_pow2(max(n, 1)))
    tokens_3d = top_k_tokens if speculative else top_k_tokens.unsqueeze(1)
    out_3d = top_k_device_locs if speculative else top_k_device_locs.unsqueeze(1)
    # unused pointers get a valid tensor of the right kind; the kernel never reads them
    scratch = device_buffer_locs if scratch_locs is None else scratch_locs
    args = (
        tokens_3d,
        tokens_3d.stride(0),
        tokens_3d.stride(1),
        tokens_3d.stride(2),
        out_3d,
        out_3d.stride(0),
        out_3d.stride(1),
        out_3d.stride(2),
        req_pool_indices,
        req_pool_indices.stride(0),
        seq_lens,
        seq_lens.stride(0),
        device_buffer_tokens,
        device_buffer_locs,
        device_buffer_tokens.stride(0),
        lru_slots,
        lru_slots.stride(0),
        host_cache_locs,
        host_cache_locs.stride(0),
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
        ws32.stride(0),
        miss_count if num_real_reqs is None else num_real_reqs,
        miss_src if counters is None else counters,
        batch,
        host_words,
        dev_words,
        host_words.shape[0],
        dev_words.shape[0],
        host_cache.shape[1] * host_cache.element_size(),
    )
    constants = dict(
        SPEC=speculative,
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
        FIRST=layout.first,
        HOTE=layout.hot,
        OCC_E=layout.occ_entry,
        MISS_RANK=layout.miss_rank,
        EVICT_LIST=layout.evict_list,
        HIT_BITS=layout.hit_bits,
        EVICT_CNT=layout.evict_cnt,
        MISS_CNT=layout.miss_cnt,
        HAS_NUM_REAL=num_real_reqs is not None,
        HAS_COUNTERS=counters is not None,
        FUSED_COPY=fused,
        HOST_STRIDE=host_words.stride(0),
        DEV_STRIDE=dev_words.stride(0),
        WORDS=host_words.shape[1],
        BLOCK_W=next_pow2(host_words.shape[1]),
        COPY_ROWS=copy_rows,
        num_warps=launch.num_warps,
    )
    grids = {1: noc, 2: noc, 3: nhc, 4: noc + nhc, 5: noc + 1}
    with device_guard(device):
        for phase, programs in grids.items():
            _resolve_kernel[(programs, batch)](*args, PHASE=phase, **constants)
    if not fused:
        launch_copy(
            miss_src=miss_src,
            miss_dst=miss_dst,
            miss_count=miss_count,
            num_real_reqs=num_real_reqs,
            host_cache=host_cache,
            device_buffer=device_buffer,
            counters=counters,
            counter_base=SWAP_IN_COPY_BASE,
            batch=batch,
            launch=copy_launch,
        )


def swap_in(
    *,
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    num_real_reqs: torch.Tensor | None = None,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Single-step swap-in (kernels.md §2): resolve ``top_k_tokens [B, K]`` into ``top_k_device_locs``, admit
    misses into LRU hot slots, record the plan and copy the missing rows from ``host_cache`` (pinned, zero-copy).

    Given the plan and ``workspace`` (int64 ``[>= B, >= swap_in_workspace_columns(1, K)]``) it allocates nothing and
    never synchronises (CUDA-graph capturable); without them it allocates per call.
    """
    _swap_in(
        speculative=False,
        top_k_tokens=top_k_tokens,
        device_buffer_tokens=device_buffer_tokens,
        host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        lru_slots=lru_slots,
        num_real_reqs=num_real_reqs,
        scratch_locs=None,
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        workspace=workspace,
        counters=counters,
    )


def swap_in_spec(
    *,
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    num_real_reqs: torch.Tensor | None = None,
    scratch_locs: torch.Tensor | None = None,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Speculative swap-in (kernels.md §3): the ``S*K`` occurrences of ``top_k_tokens [B, S, K]`` form one working
    set; each distinct miss is copied once, overflow goes to ``scratch_locs`` rows, then ``-1`` (counted).

    Given the plan and ``workspace`` (int64 ``[>= B, >= swap_in_workspace_columns(S, K)]``) it allocates nothing and
    never synchronises (CUDA-graph capturable); without them it allocates per call.
    """
    _swap_in(
        speculative=True,
        top_k_tokens=top_k_tokens,
        device_buffer_tokens=device_buffer_tokens,
        host_cache_locs=host_cache_locs,
        device_buffer_locs=device_buffer_locs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        lru_slots=lru_slots,
        num_real_reqs=num_real_reqs,
        scratch_locs=scratch_locs,
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        workspace=workspace,
        counters=counters,
    )
