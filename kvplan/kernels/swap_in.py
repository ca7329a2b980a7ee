"""HiSparse swap-in in Triton (kernels.md §2-§3): one resolve program per batch row, then the full-grid plan copy.

The resolve program decides everything for its row and records the miss plan; the host->device copy is left to
``kvplan.kernels.copy`` (the same kernel plan replay uses), so a small batch still spreads its copy over the GPU.

Resolve, per long row, with ``N = S*K`` occurrences and the row's workspace ``[keys | res | occ]`` (``N`` int64 each):

1. Every wanted occurrence ``o`` of token ``t`` gets the key ``t << 32 | o``; the keys are sorted once, so each
   distinct token is one run (a *group*) whose first key carries its first occurrence.
2. Tail slots (speculative) and hot slots binary-search their token: a found slot records ``(j' << 32 | row)`` at
   the group's first position, ``j' = j`` for tail slot ``j`` and ``P + j`` for LRU position ``j``. Plain stores,
   then an ``atomic_min`` by every slot that lost: the lowest tail slot wins, else the least recently used hot slot,
   deterministically. A group with a tail entry is resolved by the tail and is not wanted, so it makes no hit.
3. Group firsts with nothing recorded are the misses; backed ones flag their first occurrence in ``occ``, and an
   exclusive scan in occurrence order ranks them in first-occurrence order.
4. The new LRU row is written in place (evictables rotated by ``M``, hits last); miss ``m < M`` then reads its slot
   back as ``new_lru[E - M + m]``, later misses take scratch rows or overflow. Plan entries go in miss order.
5. Each key reads its group's row at the group start (a running max of first positions) and scatters it to its
   occurrence's output.

Phases that write workspace or state another thread reads are separated by ``tl.debug_barrier()``. Every state
access is masked against its table: out-of-range ``rid``, tokens, LRU entries and rows never touch memory outside
the tensors, with the outcomes the reference defines.

Cost: one program per row is issue-bound at production shapes (S*K = 8192 keys, HOT = 4096): the bitonic sort is
~60% of its instructions. Measured on an H200: ~345 µs per speculative call at batch 1, where the copy of 782 rows
takes ~20 µs. Spreading one row's resolve over several programs is the way to the 50 µs goal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan.counters import HITS, OVERFLOW, SWAP_IN_COPY_BASE
from kvplan.kernels import checks
from kvplan.kernels._launch import device_guard, next_pow2
from kvplan.kernels.copy import launch_copy
from kvplan.kernels.layout import swap_in_workspace_columns

__all__ = ["swap_in", "swap_in_spec"]

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_CHUNK = 2048  # positions per iteration of the per-key phases (bounds registers at S*K = 8192)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _lower_bound(keys_ptr, n_keys, target, LOG_N: tl.constexpr):
    """First position whose key is >= target among ``keys[0:n_keys]`` (sorted), vectorised over ``target``."""
    pos = tl.full(target.shape, -1, tl.int32)
    for i in tl.static_range(LOG_N):
        cand = pos + (1 << (LOG_N - 1 - i))
        key = tl.load(keys_ptr + cand, mask=cand < n_keys, other=0x7FFFFFFFFFFFFFFF)
        pos = tl.where(key < target, cand, pos)
    return pos + 1


@triton.jit
def _key_at(keys_ptr, p, n_keys):
    """(key, token, occurrence, is first of its group) at sorted positions ``p`` (masked past ``n_keys``)."""
    in_keys = p < n_keys
    key = tl.load(keys_ptr + p, mask=in_keys, other=0x7FFFFFFFFFFFFFFF)
    prev = tl.load(keys_ptr + p - 1, mask=in_keys & (p > 0), other=-1)
    token = key >> 32
    first = in_keys & ((p == 0) | ((prev >> 32) != token))
    return token, (key & 0xFFFFFFFF).to(tl.int32), in_keys, first


# Integer arguments are not specialised on their values (== 1, divisible by 16): one compiled variant per geometry
# instead of one per batch size, pool size and stride class (a production resolve kernel takes ~25 s to compile).
_RUNTIME_INTS = (
    "tok_sb tok_ss tok_sk out_sb out_ss out_sk rpi_s seq_s state_stride lru_stride hcl_stride max_len "
    "scratch_stride scratch_cols num_requests plan_stride ws_stride batch"
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
    SPEC: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    HOT: tl.constexpr,
    P: tl.constexpr,
    N_B: tl.constexpr,
    LOG_N: tl.constexpr,
    HOT_B: tl.constexpr,
    P_B: tl.constexpr,
    CH: tl.constexpr,
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    N: tl.constexpr = S * K
    NONE: tl.constexpr = 1 << 62
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    occ = tl.arange(0, N_B)
    in_occ = occ < N
    out_ptrs = out_ptr + b64 * out_sb + (occ // K) * out_ss + (occ % K) * out_sk

    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    rid = tl.load(rpi_ptr + b64 * rpi_s).to(tl.int64)
    live = (b < n_real) & (rid >= 0) & (rid < num_requests)
    if live:
        row = rid * state_stride
        tok = tl.load(tokens_ptr + b64 * tok_sb + (occ // K) * tok_ss + (occ % K) * tok_sk, mask=in_occ, other=-1)
        if SPEC:
            step_len = tl.load(seq_ptr + (b64 * S + occ // K) * seq_s, mask=in_occ, other=0).to(tl.int64)
            last_len = tl.load(seq_ptr + (b64 * S + S - 1) * seq_s).to(tl.int64)
        else:
            step_len = tl.load(seq_ptr + b64 * seq_s).to(tl.int64)
            last_len = step_len
        valid = in_occ & (tok >= 0) & (tok < step_len)
        if last_len <= HOT:
            # short row: token t lives at slot t
            if SPEC:
                usable = valid & (tok < HOT + P)
            else:
                usable = valid & (occ < last_len)
            locs = tl.load(dbl_ptr + row + tok, mask=usable, other=-1)
            tl.store(out_ptrs, locs, mask=in_occ)
            tl.store(count_ptr + b, 0)
        else:
            _resolve_long_row(
                tok,
                valid,
                last_len,
                out_ptrs,
                row,
                dbt_ptr,
                dbl_ptr,
                lru_ptr + rid * lru_stride,
                hcl_ptr + rid * hcl_stride,
                max_len,
                scratch_ptr + rid * scratch_stride,
                scratch_cols,
                src_ptr + b64 * plan_stride,
                dst_ptr + b64 * plan_stride,
                count_ptr + b,
                ws_ptr + b64 * ws_stride,
                counters_ptr,
                out_ptr + b64 * out_sb,
                out_ss,
                out_sk,
                SPEC,
                K,
                N,
                HOT,
                P,
                N_B,
                LOG_N,
                HOT_B,
                P_B,
                CH,
                NONE,
                HAS_COUNTERS,
            )
    else:
        # padding row (or a rid outside the pool, handled as one)
        if SPEC:
            tl.store(out_ptrs, tl.zeros([N_B], tl.int32), mask=in_occ)
            tl.store(count_ptr + b, 0)
        else:
            tl.store(out_ptrs, tl.full([N_B], -1, tl.int32), mask=in_occ)


@triton.jit
def _resolve_long_row(
    tok,
    valid,
    last_len,
    out_ptrs,
    row,
    dbt_ptr,
    dbl_ptr,
    lru_row,
    hcl_row,
    max_len,
    scratch_row,
    scratch_cols,
    src_row,
    dst_row,
    count_at,
    ws,
    counters_ptr,
    out_row,
    out_ss,
    out_sk,
    SPEC: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    HOT: tl.constexpr,
    P: tl.constexpr,
    N_B: tl.constexpr,
    LOG_N: tl.constexpr,
    HOT_B: tl.constexpr,
    P_B: tl.constexpr,
    CH: tl.constexpr,
    NONE: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):
    keys_ws = ws
    res_ws = ws + N
    occ_ws = ws + 2 * N
    occ = tl.arange(0, N_B)
    lanes = tl.arange(0, CH)

    # -- 1. wanted occurrences -> sorted keys; the newest token (single-step) and invalid ones resolve directly
    if SPEC:
        wanted = valid
    else:
        newest = valid & (tok == last_len - 1)
        newest_loc = tl.load(dbl_ptr + row + HOT)
        tl.store(out_ptrs, tl.full([N_B], 0, tl.int32) + newest_loc, mask=newest)
        wanted = valid & ~newest
    tl.store(out_ptrs, tl.full([N_B], -1, tl.int32), mask=(occ < N) & ~valid)
    n_keys = tl.sum(wanted.to(tl.int32), axis=0)
    keys = tl.where(wanted, (tok.to(tl.int64) << 32) | occ.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    tl.store(keys_ws + occ, tl.sort(keys), mask=occ < N)
    for c in tl.static_range(0, N_B, CH):
        p = c + lanes
        tl.store(res_ws + p, tl.full([CH], NONE, tl.int64), mask=p < N)
        tl.store(occ_ws + p, tl.zeros([CH], tl.int64), mask=p < N)
    tl.debug_barrier()

    # -- 2. tail and hot slots find their token's group and record themselves at its first position
    j = tl.arange(0, HOT_B)
    in_hot = j < HOT
    lru = tl.load(lru_row + j, mask=in_hot, other=-1)
    slot = lru.to(tl.int32)
    slot_live = in_hot & (slot >= 0) & (slot < HOT)
    hot_tok = tl.load(dbt_ptr + row + slot, mask=slot_live, other=-1)
    hot_loc = tl.load(dbl_ptr + row + slot, mask=slot_live, other=-1)
    g_hot = _lower_bound(keys_ws, n_keys, hot_tok.to(tl.int64) << 32, LOG_N)
    key_hot = tl.load(keys_ws + g_hot, mask=slot_live & (g_hot < n_keys), other=-1)
    hot_found = slot_live & (g_hot < n_keys) & ((key_hot >> 32) == hot_tok)
    hot_entry = ((P + j).to(tl.int64) << 32) | (hot_loc.to(tl.int64) & 0xFFFFFFFF)
    tl.store(res_ws + g_hot, hot_entry, mask=hot_found)
    if SPEC:
        jt = tl.arange(0, P_B)
        tail_tok = tl.load(dbt_ptr + row + HOT + jt, mask=jt < P, other=-1)
        tail_loc = tl.load(dbl_ptr + row + HOT + jt, mask=jt < P, other=-1)
        g_tail = _lower_bound(keys_ws, n_keys, tail_tok.to(tl.int64) << 32, LOG_N)
        tail_ok = (jt < P) & (tail_loc >= 0) & (g_tail < n_keys)
        key_tail = tl.load(keys_ws + g_tail, mask=tail_ok, other=-1)
        tail_found = tail_ok & ((key_tail >> 32) == tail_tok)
        tail_entry = (jt.to(tl.int64) << 32) | (tail_loc.to(tl.int64) & 0xFFFFFFFF)
        tl.store(res_ws + g_tail, tail_entry, mask=tail_found)
    tl.debug_barrier()
    # slots that lost a plain store to a larger entry of the same group take the minimum
    seen = tl.load(res_ws + g_hot, mask=hot_found, other=0)
    tl.atomic_min(res_ws + g_hot, hot_entry, mask=hot_found & (hot_entry < seen))
    if SPEC:
        seen_tail = tl.load(res_ws + g_tail, mask=tail_found, other=0)
        tl.atomic_min(res_ws + g_tail, tail_entry, mask=tail_found & (tail_entry < seen_tail))
    tl.debug_barrier()
    # entries may have been lowered by atomics (performed in L2): read them from L2, not a stale L1 line
    recorded = tl.load(res_ws + g_hot, mask=hot_found, other=0, cache_modifier=".cg")
    is_hit = hot_found & ((recorded >> 32) >= P)  # a group resolved by the tail is not wanted
    evict = in_hot & ~is_hit
    evict_i = evict.to(tl.int32)
    hit_i = is_hit.to(tl.int32)
    n_evict = tl.sum(evict_i, axis=0)
    evict_rank = tl.cumsum(evict_i, axis=0) - evict_i
    hit_rank = tl.cumsum(hit_i, axis=0) - hit_i

    # -- 3. misses: group firsts with nothing recorded; backed ones flag their first occurrence
    hits = 0
    for c in tl.static_range(0, N_B, CH):
        p = c + lanes
        token, first_occ, in_keys, first = _key_at(keys_ws, p, n_keys)
        entry = tl.load(res_ws + p, mask=first, other=NONE, cache_modifier=".cg")
        hits += tl.sum((first & (entry != NONE) & ((entry >> 32) >= P)).to(tl.int32), axis=0)
        miss = first & (entry == NONE)
        host = tl.load(hcl_row + token, mask=miss & (token < max_len), other=-1)
        tl.store(occ_ws + first_occ, tl.full([CH], 1, tl.int64), mask=miss & (host >= 0))
    tl.debug_barrier()

    # ranks in first-occurrence order: exclusive scan of the flags, chunk by chunk
    n_backed = 0
    for c in tl.static_range(0, N_B, CH):
        q = c + lanes
        flag = tl.load(occ_ws + q, mask=q < N, other=0).to(tl.int32)
        rank = n_backed + tl.cumsum(flag, axis=0) - flag
        tl.store(occ_ws + q, rank.to(tl.int64), mask=flag != 0)
        n_backed += tl.sum(flag, axis=0)
    admitted_n = tl.minimum(n_backed, n_evict)
    if SPEC:
        placed_n = admitted_n + tl.minimum(n_backed - admitted_n, scratch_cols)
    else:
        placed_n = admitted_n

    # -- 4. new LRU order in place: evictables[M:], evictables[:M], hits (old row read above, barriers since)
    new_pos = tl.where(
        evict,
        tl.where(evict_rank >= admitted_n, evict_rank - admitted_n, n_evict - admitted_n + evict_rank),
        n_evict + hit_rank,
    )
    tl.store(lru_row + new_pos, lru, mask=in_hot)
    tl.debug_barrier()

    for c in tl.static_range(0, N_B, CH):
        p = c + lanes
        token, first_occ, in_keys, first = _key_at(keys_ws, p, n_keys)
        entry = tl.load(res_ws + p, mask=first, other=NONE, cache_modifier=".cg")
        miss = first & (entry == NONE)
        host = tl.load(hcl_row + token, mask=miss & (token < max_len), other=-1)
        backed = miss & (host >= 0)
        m = tl.load(occ_ws + first_occ, mask=backed, other=0).to(tl.int32)
        admitted = backed & (m < admitted_n)
        fill = tl.load(lru_row + (n_evict - admitted_n + m), mask=admitted, other=-1).to(tl.int32)
        fill_ok = admitted & (fill >= 0) & (fill < HOT)
        dev_row = tl.load(dbl_ptr + row + fill, mask=fill_ok, other=-1)
        tl.store(dbt_ptr + row + fill, token.to(tl.int32), mask=fill_ok)
        placed = backed & (m < placed_n)
        if SPEC:
            scratched = placed & ~admitted
            scratch = tl.load(scratch_row + (m - n_evict), mask=scratched, other=-1)
            dev_row = tl.where(scratched, scratch, dev_row)
        tl.store(src_row + m, host, mask=placed)
        tl.store(dst_row + m, dev_row, mask=placed)
        # the group's row: recorded slot (low 32 bits, sign-extended), placed row, or -1
        final = tl.where(entry != NONE, (entry << 32) >> 32, tl.where(placed, dev_row.to(tl.int64), -1))
        tl.store(res_ws + p, final, mask=first)
    tl.store(count_at, placed_n)
    if HAS_COUNTERS:
        tl.atomic_add(counters_ptr + _HITS, hits.to(tl.int64))
        tl.atomic_add(counters_ptr + _OVERFLOW, (n_backed - placed_n).to(tl.int64))
    tl.debug_barrier()

    # -- 5. every key reads its group's row at the group start and writes its occurrence's output
    start = 0
    for c in tl.static_range(0, N_B, CH):
        p = c + lanes
        token, first_occ, in_keys, first = _key_at(keys_ws, p, n_keys)
        group = tl.maximum(tl.associative_scan(tl.where(first, p, 0), 0, _max_combine), start)
        start = tl.max(group, axis=0)
        value = tl.load(res_ws + group, mask=in_keys, other=-1)
        dest = out_row + (first_occ // K) * out_ss + (first_occ % K) * out_sk
        tl.store(dest, value.to(tl.int32), mask=in_keys)


def _resolve_warps(n_block: int, hot_block: int) -> int:
    """Warps of a resolve program. The program is issue-bound (one per row, mostly integer compare/select work):
    at production shapes 8 warps issue fewer instructions in all than 16 (fewer cross-warp sort and scan steps) and
    measured faster on the H200 (345 vs 361 µs per speculative call at batch 1), while 255 registers hold the
    8192 keys with only a few bytes spilled."""
    return 4 if max(n_block, hot_block) <= 256 else 8


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
    num_warps: int | None = None,
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
    device = top_k_tokens.device
    if miss_src is None:
        miss_src = torch.empty(batch, n, dtype=torch.int64, device=device)
        miss_dst = torch.empty(batch, n, dtype=torch.int32, device=device)
        miss_count = torch.empty(batch, dtype=torch.int32, device=device)
    if workspace is None:
        columns = swap_in_workspace_columns(dims.steps, dims.top_k)
        workspace = torch.empty(batch, columns, dtype=torch.int64, device=device)
    n_block = next_pow2(n)
    chunk = min(n_block, _CHUNK)
    tokens_3d = top_k_tokens if speculative else top_k_tokens.unsqueeze(1)
    out_3d = top_k_device_locs if speculative else top_k_device_locs.unsqueeze(1)
    # unused pointers get a valid tensor of the right kind; the kernel never reads them
    scratch = device_buffer_locs if scratch_locs is None else scratch_locs
    with device_guard(device):
        _resolve_kernel[(batch,)](
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
            workspace,
            workspace.stride(0),
            miss_count if num_real_reqs is None else num_real_reqs,
            workspace if counters is None else counters,
            batch,
            SPEC=speculative,
            S=dims.steps,
            K=dims.top_k,
            HOT=dims.hot,
            P=dims.tail,
            N_B=n_block,
            LOG_N=n_block.bit_length() - 1,
            HOT_B=next_pow2(dims.hot),
            P_B=next_pow2(dims.tail),
            CH=chunk,
            HAS_NUM_REAL=num_real_reqs is not None,
            HAS_COUNTERS=counters is not None,
            num_warps=num_warps or _resolve_warps(n_block, next_pow2(dims.hot)),
        )
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
