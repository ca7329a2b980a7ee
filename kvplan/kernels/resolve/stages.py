"""The Triton resolve's stages of one chunk of a row (prep, insert, and the place stage's hot, occurrence and
finish roles), shared by the split kernels and the one-program-per-row kernel.
Names: the kernel glossary, ``kvplan/kernels/glossary.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.kernels.resolve.constants import _FLAGS_BLOCK, _HITS, _LOW_MASK, _NONE, _OVERFLOW, _TAIL_BLOCK
from kvplan.kernels.resolve.tables import (
    _begin_epoch,
    _clear_table,
    _lookup,
    _popcount,
    _publish,
    _select_bit,
    _stamp,
    _table_find,
    _table_insert,
    _wait_counts,
    _words,
)


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


@triton.jit
def _token_at(tok_row, tok_strides, step, col, mask, other, BLOCK: tl.constexpr):
    """The token of occurrence ``(step, col)`` of a batch row (``tok_row``: that row of ``top_k_tokens``). With
    ``BLOCK > 0`` (the block front end, docs/kernels.md §2a) the row holds block ids and the token is expanded from
    the id covering column ``col``: ``id * BLOCK + col % BLOCK``, ``-1`` for a negative id or one whose tokens would
    pass the int32 range (``kvplan.reference.expand_blocks``)."""
    if BLOCK > 0:
        LAST: tl.constexpr = (1 << 31) // BLOCK - 1  # the highest block id whose tokens are all int32
        block = tl.load(tok_row + step * tok_strides[1] + (col // BLOCK) * tok_strides[2], mask=mask, other=-1)
        tok = tl.where((block >= 0) & (block <= LAST), block * BLOCK + col % BLOCK, -1)
    else:
        tok = tl.load(tok_row + step * tok_strides[1] + col * tok_strides[2], mask=mask, other=other)
    return tok


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
    CHECK_NEWEST: tl.constexpr,  # single-step: slot HOT serves the newest token unless it names another token
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
    tok = _token_at(tokens_ptr + b64 * tok_strides[0], tok_strides, step, col, in_occ, -1, SHAPE.block)
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
        elif SHAPE.block > 0:  # a block selection: every valid token (no min(L, K) cut-off, §2a)
            usable = valid
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
            # the newest token lives at slot HOT (CHECK_NEWEST: -1 when slot HOT names another token)
            resolved = valid & (tok == last_len - 1)
            newest_row = tl.load(dbl_row + HOT)
            if CHECK_NEWEST:
                held = tl.load(dbt_row + HOT).to(tl.int64)
                newest_row = tl.where((held < 0) | (held == last_len - 1), newest_row, -1)
            pre = tl.zeros([CH], tl.int32) + newest_row
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
    tok = _token_at(tokens_ptr + b64 * tok_strides[0], tok_strides, occ // K, occ % K, wanted, 0, SHAPE.block)
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
    tok = _token_at(tok_row, tok_strides, occ // K, occ % K, wanted, 0, SHAPE.block)
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
