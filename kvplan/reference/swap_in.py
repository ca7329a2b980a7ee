"""Plain-PyTorch oracle of the HiSparse swap-in kernels (docs/kernels.md §1-§4).

The Triton kernels are compared with these functions exactly: outputs, ``device_buffer_tokens``, ``lru_slots``, plan
entries ``[0, miss_count)``, ``miss_count``, device rows and counters. The reference favours clarity over speed but
stays vectorised per batch row (no per-token Python loops), so the GPU suite can run it at production shapes
(K=2048, HOT=4096, S=4, batch 64). It works on whatever device the tensors live on: per-row decisions are made on CPU
copies of the small per-row state, host rows are gathered where ``host_cache_locs`` lives, and every result is
written back in place into the caller's tensors. It synchronises with the device freely; it is not capture-safe.

Arguments are checked by the kernels' own checks (``kvplan.validate.arguments``, ``launch=False``: any device, any
host memory), so both refuse the same calls with the same messages, before anything is written. Values are not
checked (that would be the kernel's host sync); instead every broken value precondition has one defined outcome
below, never an ``IndexError``.

Defined behaviour beyond the preconditions
------------------------------------------
The spec leaves results unspecified when these preconditions break; kvplan defines them so the kernel can mirror
the reference (each one is what masked loads and stores give naturally):

1. ``rid = req_pool_indices[b]`` outside ``[0, R)``: the row is handled as a padding row of its path
   (single-step: outputs ``-1``, ``miss_count[b]`` untouched; speculative: outputs ``0``, ``miss_count[b] = 0``).
   A padding row copies nothing, whatever its plan row holds from an earlier call, and nor does a replay given the
   swap-in's workspace (``copy_planned(..., workspace=)``, as ``pool.replay`` passes it).
2. A token ``t >= host_cache_locs.shape[1]`` has no host row: it is unbacked (output ``-1``, no slot, no copy,
   not counted).
3. An ``lru_slots`` entry ``s`` outside ``[0, HOT)`` is an empty slot backed by device row ``-1``: never a hit,
   evictable in its LRU position; a miss that takes it outputs ``-1``, writes no token, and records the plan entry
   ``(host row, -1)`` (counted in ``miss_count``, its copy skipped by rule 4). The entry's value moves through the
   LRU update unchanged.
4. A copy whose host row is outside ``[0, host_cache.shape[0])`` or whose device row is outside
   ``[0, device_buffer.shape[0])`` is skipped (by ``swap_in`` and ``copy_planned``) and not
   counted in ``misses_copied``/``bytes_moved``. The output and the plan still show the row the state named.
5. Speculative short row, token ``t >= W`` valid at its step: output ``-1``.
6. Single-step long row with more backed misses than evictable slots (only possible when a token sits in two hot
   slots or ``lru_slots`` is not a permutation): the misses beyond the evictables output ``-1`` and count as
   ``overflow``, as speculative misses beyond the scratch rows do.
7. ``copy_planned``: ``miss_count[r]`` is clamped to ``[0, miss_src.shape[1]]``; ``num_real_reqs[0]`` to ``[0, B]``
   (also in ``swap_in``).

8. A wanted token held by several hot slots: each of those slots is a hit, the least recently used one serves the
   token's occurrences, and ``hits`` counts the token once.
9. Rows of 0 bytes (``host_cache``/``device_buffer`` of shape ``[n, 0]``): nothing moves, so no copy is counted in
   ``misses_copied``/``bytes_moved`` or ``replayed_rows``/``replayed_bytes`` (the counters measure copy traffic);
   resolution, the cache state, the plan and ``miss_count`` are as for any row width.
10. The block front end (:func:`swap_in_blocks`, docs/kernels.md §2a): a block id ``< 0`` (``-1`` or any other) names
   no token, nor does one whose tokens would pass the int32 range (``> 2**31 // sparse_block_size - 1``): each of its
   places outputs ``-1``. The tokens of a block at or past a row's length are invalid tokens (output ``-1``), however
   large the id. With V rows, rule 4 skips a copy's K and V rows together, and rule 9 holds for both.
11. Single-step long row whose slot ``HOT`` names another token (``device_buffer_tokens[rid, HOT]`` a token ``>= 0``
    other than ``L - 1``, a forgotten ``write_tail``; an empty slot, ``< 0``, names none): the newest token outputs
    ``-1`` (not looked up, not copied, not counted).
    The block front end (rule 10) likewise, for the place of the newest token. ``check_newest=False`` (the SGLang
    adapters') keeps SGLang's rule: ``device_buffer_locs[rid, HOT]`` whatever slot ``HOT`` holds.

Other broken preconditions (two real rows sharing a ``rid``, ``lru_slots`` rows repeating an entry) never read or
write out of bounds, but their results are unspecified.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvplan.calls import SwapInCall, swap_in_blocks_call, swap_in_call
from kvplan.counters import HITS, OVERFLOW, REPLAY_COPY_BASE, SWAP_IN_COPY_BASE
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import SwapInDims, check_copy, check_swap_in
from kvplan.workspace import PADDING, SHARED

__all__ = ["swap_in", "swap_in_blocks", "copy_planned", "expand_blocks"]

_CPU = torch.device("cpu")
_I64 = torch.int64
_TOKEN_MAX = (1 << 31) - 1  # tokens are int32: a block whose tokens would pass it names none of them


def swap_in(
    state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *, num_real_reqs: Tensor | None = None,
    plan: MissPlan | None = None, counters: Tensor | None = None, speculative: bool | None = None,
    check_newest: bool = True,
) -> MissPlan:  # fmt: skip
    """HiSparse swap-in (docs/kernels.md §2-§3): the arguments of :func:`kvplan.kernels.swap_in` but the workspace,
    and the same return: the plan written (``plan``, or one allocated like the kernel's). Its plan rows are in miss
    order; a plan row is a set of copies, so compare plans with ``MissPlan.row_copies``."""
    call = swap_in_call(
        speculative, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
        num_real_reqs, plan, counters=counters, check_newest=check_newest,
    )  # fmt: skip
    dims = check_swap_in(call, launch=False)
    if plan is None:
        plan = MissPlan.allocate(dims.batch, dims.occurrences, top_k_tokens.device)
        call = call._replace(plan=plan)
    _run(call, dims)
    return plan


def swap_in_blocks(
    state: HotBufferState, top_k_blocks: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache_k: Tensor, host_cache_v: Tensor, device_buffer_k: Tensor, device_buffer_v: Tensor,
    *, sparse_block_size: int, num_real_reqs: Tensor | None = None, plan: MissPlan | None = None,
    counters: Tensor | None = None, check_newest: bool = True,
) -> MissPlan:  # fmt: skip
    """Block-selection swap-in of K and V rows (docs/kernels.md §2a): the arguments of
    :func:`kvplan.kernels.swap_in_blocks` but the workspace, and the same return. ``top_k_blocks`` ``[B, NB]`` is
    expanded by :func:`expand_blocks` to the token list ``[B, NB * sparse_block_size]``, which the single-step rules
    of §2 resolve (without the short row's ``min(L, K)`` cut-off; ``check_newest`` as :func:`swap_in`'s, rule 11); each
    miss copies its K row and its V row."""
    call = swap_in_blocks_call(
        state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, host_cache_v,
        device_buffer_k, device_buffer_v, sparse_block_size, num_real_reqs, plan, counters=counters,
        check_newest=check_newest,
    )  # fmt: skip
    dims = check_swap_in(call, launch=False)
    if plan is None:
        plan = MissPlan.allocate(dims.batch, dims.occurrences, top_k_blocks.device)
        call = call._replace(plan=plan)
    _run(call, dims)
    return plan


def expand_blocks(top_k_blocks: Tensor, sparse_block_size: int) -> Tensor:
    """The token list of a block selection (CPU int64 ``[B, NB * sparse_block_size]``): block ``n`` of a row names
    tokens ``n * sparse_block_size + j``, ``j < sparse_block_size``, in that order; a negative id (``-1``: no block)
    names none, each of its places ``-1``, and so does a block whose tokens would pass the int32 range. Tokens at or
    past a row's length are then invalid as any token is (docs/kernels.md §2a)."""
    blocks = top_k_blocks.to(_CPU, _I64)
    tokens = blocks[:, :, None] * sparse_block_size + torch.arange(sparse_block_size, dtype=_I64)
    named = (blocks[:, :, None] >= 0) & (blocks[:, :, None] <= (_TOKEN_MAX + 1) // sparse_block_size - 1)
    return torch.where(named, tokens, -1).reshape(blocks.shape[0], -1)


def copy_planned(
    plan: MissPlan,
    host_cache: Tensor,
    device_buffer: Tensor,
    *,
    num_real_reqs: Tensor | None = None,
    counters: Tensor | None = None,
    counter_base: int = REPLAY_COPY_BASE,
    workspace: Tensor | None = None,
    host_cache_v: Tensor | None = None,
    device_buffer_v: Tensor | None = None,
) -> None:
    """Replay a miss plan (docs/kernels.md §4): host row ``plan.src[r, m]`` -> device row ``plan.dst[r, m]``.

    Rows ``r < num_real_reqs[0]`` (all rows when ``None``), ``m < plan.count[r]``; out-of-range rows are skipped.
    ``counter_base`` picks the counters the copy adds to (the swap-in's own copy or a replay's). ``workspace`` (the
    swap-in's, whose record lets the kernel read a shared host row once) changes which rows are copied in one way
    only: a row the swap-in marked padding (row word ``SHARED`` holds ``kvplan.workspace.PADDING``) copies nothing,
    whatever its count says (a single-step padding row's ``miss_count`` keeps an earlier step's value). With
    ``host_cache_v``/``device_buffer_v`` each entry also copies its V row (the rows counted once, the bytes of both).
    """
    # the kernels' own checks, without the launch-only ones (the reference runs on any device)
    check_copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters,
               counter_base=counter_base, launch=False, workspace=workspace, host_cache_v=host_cache_v,
               device_buffer_v=device_buffer_v)  # fmt: skip
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    batch, columns = miss_src.shape
    rows = _real_rows(num_real_reqs, batch)
    counts = miss_count[:rows].to(_I64).clamp(0, columns)
    if workspace is not None and rows and workspace.shape[1]:
        marks = workspace[:rows].view(torch.int32)[:, SHARED].to(_CPU)
        counts = torch.where(marks.to(counts.device) == PADDING, 0, counts)
    taken = torch.arange(columns, device=counts.device)[None, :] < counts[:, None]
    src = miss_src[:rows].to(_I64)[taken.to(miss_src.device)].to(_CPU)
    dst = miss_dst[:rows].to(_I64)[taken.to(miss_dst.device)].to(_CPU)
    copied = _copy_rows(src, dst, host_cache, device_buffer)
    if host_cache_v is not None:
        _copy_rows(src, dst, host_cache_v, device_buffer_v)
    _add_copy_counters(counters, counter_base, copied, _copy_row_bytes(host_cache, host_cache_v))


# --------------------------------------------------------------------------------------------------------------------
# One call: checks, per-row resolution on CPU copies, write-back.


class _RowResult(NamedTuple):
    """What resolving one long row decided (CPU, int64)."""

    out: Tensor  # [N] device row per occurrence, -1 where unresolved
    hot_tokens: Tensor  # [HOT] new tokens of the hot slots
    lru: Tensor  # [HOT] new LRU order
    src: Tensor  # plan host rows, admitted then scratch
    dst: Tensor  # plan device rows
    hits: int
    overflow: int


def _run(call: SwapInCall, dims: SwapInDims) -> None:
    tokens = call.top_k_tokens
    plan = call.plan
    batch, steps, top_k = dims.batch, dims.steps, dims.top_k
    num_reqs, width, hot = dims.requests, dims.width, dims.hot
    occurrences = steps * top_k
    block = call.sparse_block_size
    if block is None:
        toks = tokens.reshape(batch, occurrences).to(_CPU, _I64)
    else:  # the block front end: the selection's token list, then the single-step rules
        toks = expand_blocks(tokens, block)
    lens = call.seq_lens[: batch * steps].to(_CPU, _I64).reshape(batch, steps)
    rids = call.req_pool_indices[:batch].to(_CPU, _I64)
    real = _real_rows(call.num_real_reqs, batch)
    active = [b for b in range(real) if 0 <= int(rids[b]) < num_reqs]

    out = torch.full((batch, occurrences), 0 if call.speculative else -1, dtype=_I64)
    counts = torch.zeros(batch, dtype=_I64)
    srcs: list[Tensor] = []
    dsts: list[Tensor] = []
    plan_rows: list[int] = []
    long_rids: list[int] = []
    new_hot: list[Tensor] = []
    new_lru: list[Tensor] = []
    hits = overflow = 0

    state_rows = torch.tensor([int(rids[b]) for b in active], dtype=_I64)
    row_tokens = _rows_cpu(call.device_buffer_tokens, state_rows)
    row_locs = _rows_cpu(call.device_buffer_locs, state_rows)
    row_lru = _rows_cpu(call.lru_slots, state_rows)
    row_scratch = _rows_cpu(call.scratch_locs, state_rows) if call.scratch_locs is not None else None

    for i, b in enumerate(active):
        rid = int(rids[b])
        tok, locs = toks[b], row_locs[i]
        step_len = lens[b].repeat_interleave(top_k)  # length visible at each occurrence's step
        valid = (tok >= 0) & (tok < step_len)
        last_len = int(lens[b, -1])
        if last_len <= hot:  # short row: token t lives at slot t
            usable = valid & (tok < width)
            if not call.speculative and block is None:  # (a block selection has no cut-off: §2a)
                usable &= torch.arange(occurrences) < min(last_len, top_k)
            out[b] = torch.where(usable, locs[tok.clamp(0, width - 1)], -1)
            continue
        if call.speculative:  # tail: lowest tail slot j holding t with a real row
            tail_tokens, tail_locs = row_tokens[i, hot:], locs[hot:]
            match = (tok[:, None] == tail_tokens[None, :]) & (tail_locs >= 0)[None, :] & valid[:, None]
            resolved = match.any(dim=1)
            pre = tail_locs[match.to(torch.int8).argmax(dim=1)]
        else:  # the newest token lives at slot HOT (rule 11: unless slot HOT names another token)
            resolved = valid & (tok == last_len - 1)
            newest_row = locs[hot]
            held = int(row_tokens[i, hot])  # (an empty slot, < 0, names no other token)
            if call.check_newest and held >= 0 and held != last_len - 1:
                newest_row = torch.full_like(newest_row, -1)
            pre = newest_row.expand(occurrences)
        scratch = row_scratch[i] if row_scratch is not None else torch.empty(0, dtype=_I64)
        res = _resolve_long_row(
            tok=tok,
            valid=valid,
            resolved=resolved,
            pre=pre,
            hot_tokens=row_tokens[i, :hot],
            hot_locs=locs[:hot],
            lru=row_lru[i],
            host_cache_locs=call.host_cache_locs,
            rid=rid,
            scratch=scratch,
        )
        out[b] = res.out
        counts[b] = res.src.numel()
        srcs.append(res.src)
        dsts.append(res.dst)
        plan_rows.append(b)
        long_rids.append(rid)
        new_hot.append(res.hot_tokens)
        new_lru.append(res.lru)
        hits += res.hits
        overflow += res.overflow

    # Write back in place; nothing above mutated the caller's tensors.
    call.top_k_device_locs.copy_(out.reshape(call.top_k_device_locs.shape))
    if long_rids:
        idx = torch.tensor(long_rids, dtype=_I64)
        hot_tokens, lru = call.device_buffer_tokens, call.lru_slots
        hot_tokens[idx.to(hot_tokens.device), :hot] = torch.stack(new_hot).to(hot_tokens.device, hot_tokens.dtype)
        lru[idx.to(lru.device)] = torch.stack(new_lru).to(lru.device, lru.dtype)
    if plan is not None:
        _write_plan(plan, call.speculative, active, plan_rows, srcs, dsts, counts)
    src = torch.cat(srcs) if srcs else torch.empty(0, dtype=_I64)
    dst = torch.cat(dsts) if dsts else torch.empty(0, dtype=_I64)
    copied = _copy_rows(src, dst, call.host_cache, call.device_buffer)
    if call.host_cache_v is not None:
        _copy_rows(src, dst, call.host_cache_v, call.device_buffer_v)
    _add_copy_counters(call.counters, SWAP_IN_COPY_BASE, copied, _copy_row_bytes(call.host_cache, call.host_cache_v))
    if call.counters is not None and (hits or overflow):
        call.counters[HITS] += hits
        call.counters[OVERFLOW] += overflow


def _resolve_long_row(
    *,
    tok: Tensor,
    valid: Tensor,
    resolved: Tensor,
    pre: Tensor,
    hot_tokens: Tensor,
    hot_locs: Tensor,
    lru: Tensor,
    host_cache_locs: Tensor,
    rid: int,
    scratch: Tensor,
) -> _RowResult:
    """Steps 2-5 of §2 / 3-6 of §3 for one row whose earlier rules gave ``resolved`` occurrences the rows ``pre``."""
    hot = lru.numel()
    out = torch.where(resolved, pre, -1)

    # Wanted tokens, distinct, in first-occurrence order; `rank` maps each wanted occurrence to its distinct token.
    positions = torch.nonzero(valid & ~resolved).squeeze(1)
    uniq, inverse = torch.unique(tok[positions], return_inverse=True)
    first = torch.full_like(uniq, tok.numel()).scatter_reduce(0, inverse, positions, "amin")
    order = torch.argsort(first)
    wanted = uniq[order]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())

    # Hot slots in LRU order; an entry outside [0, HOT) is an empty slot backed by row -1.
    live = (lru >= 0) & (lru < hot)
    slot = lru.clamp(0, hot - 1)
    slot_token = torch.where(live, hot_tokens[slot], -1)
    slot_loc = torch.where(live, hot_locs[slot], -1)
    is_hit = live & torch.isin(slot_token, wanted)
    hit_token, by_token = torch.sort(slot_token[is_hit], stable=True)  # stable: LRU-first slot of a token leads
    hit_loc = slot_loc[is_hit][by_token]
    evict, evict_loc = lru[~is_hit], slot_loc[~is_hit]

    found_at = torch.searchsorted(hit_token, wanted).clamp(max=max(hit_token.numel() - 1, 0))
    is_found = hit_token[found_at] == wanted if hit_token.numel() else torch.zeros_like(wanted, dtype=torch.bool)
    wanted_loc = torch.where(is_found, hit_loc[found_at] if hit_loc.numel() else -1, -1)

    # Misses: unbacked ones dropped; then evictables (admitted), scratch rows, overflow, in miss order.
    miss = torch.nonzero(~is_found).squeeze(1)
    host = _host_rows(host_cache_locs, rid, wanted[miss])
    backed = miss[host >= 0]
    host = host[host >= 0]
    admitted = min(backed.numel(), evict.numel())
    scratched = min(backed.numel() - admitted, scratch.numel())
    placed = admitted + scratched
    dst = torch.cat([evict_loc[:admitted], scratch[:scratched]])
    wanted_loc[backed[:placed]] = dst

    new_hot = hot_tokens.clone()
    fill = evict[:admitted]
    writable = (fill >= 0) & (fill < hot)
    new_hot[fill[writable]] = wanted[backed[:admitted]][writable]

    out[positions] = wanted_loc[rank[inverse]]
    return _RowResult(
        out=out,
        hot_tokens=new_hot,
        lru=torch.cat([evict[admitted:], evict[:admitted], lru[is_hit]]),
        src=host[:placed],
        dst=dst,
        hits=int(is_found.sum()),
        overflow=backed.numel() - placed,
    )


# --------------------------------------------------------------------------------------------------------------------
# Helpers: checks, gathers and copies.


def _real_rows(num_real_reqs: Tensor | None, batch: int) -> int:
    if num_real_reqs is None:
        return batch
    return min(max(int(num_real_reqs.reshape(-1)[0]), 0), batch)


def _rows_cpu(table: Tensor, rows: Tensor) -> Tensor:
    """``table[rows]`` as a CPU int64 copy."""
    return table[rows.to(table.device)].to(_CPU, _I64)


def _host_rows(host_cache_locs: Tensor, rid: int, tokens: Tensor) -> Tensor:
    """``host_cache_locs[rid, t]`` per token (CPU int64); ``-1`` for ``t`` beyond the table (rule 2)."""
    rows = torch.full_like(tokens, -1)
    inside = tokens < host_cache_locs.shape[1]
    if bool(inside.any()):
        index = tokens[inside].to(host_cache_locs.device)
        rows[inside] = host_cache_locs[rid].index_select(0, index).to(_CPU, _I64)
    return rows


def _write_plan(
    plan: MissPlan,
    speculative: bool,
    active: list[int],
    plan_rows: list[int],
    srcs: list[Tensor],
    dsts: list[Tensor],
    counts: Tensor,
) -> None:
    """Entries ``[0, miss_count)`` of each row; single-step leaves padding and out-of-range rows' counts untouched."""
    miss_src, miss_dst, miss_count = plan.src, plan.dst, plan.count
    batch = counts.numel()
    written = torch.arange(batch) if speculative else torch.tensor(active, dtype=_I64)
    if written.numel():
        miss_count[written.to(miss_count.device)] = counts[written].to(miss_count.device, miss_count.dtype)
    rows = [torch.full((s.numel(),), b, dtype=_I64) for b, s in zip(plan_rows, srcs)]
    cols = [torch.arange(s.numel()) for s in srcs]
    if rows and sum(s.numel() for s in srcs):
        r, c = torch.cat(rows), torch.cat(cols)
        miss_src[r.to(miss_src.device), c.to(miss_src.device)] = torch.cat(srcs).to(miss_src.device, miss_src.dtype)
        miss_dst[r.to(miss_dst.device), c.to(miss_dst.device)] = torch.cat(dsts).to(miss_dst.device, miss_dst.dtype)


def _copy_rows(src: Tensor, dst: Tensor, host_cache: Tensor, device_buffer: Tensor) -> int:
    """Copy whole rows ``host_cache[src] -> device_buffer[dst]`` bit-exactly, skipping out-of-range pairs (rule 4)
    and every pair when rows hold no bytes (rule 9); returns the rows copied."""
    if host_cache.shape[1] == 0:
        return 0
    keep = (src >= 0) & (src < host_cache.shape[0]) & (dst >= 0) & (dst < device_buffer.shape[0])
    src, dst = src[keep], dst[keep]
    if src.numel():
        rows = host_cache[src.to(host_cache.device)].to(device_buffer.device)
        device_buffer[dst.to(device_buffer.device)] = rows
    return src.numel()


def _copy_row_bytes(host_cache: Tensor, host_cache_v: Tensor | None) -> int:
    """Bytes one copy moves: its K row, and its V row when there is one."""
    row = host_cache.shape[1] * host_cache.element_size()
    return row if host_cache_v is None else 2 * row


def _add_copy_counters(counters: Tensor | None, base: int, rows: int, row_bytes: int) -> None:
    if counters is None or rows == 0:
        return
    counters[base] += rows
    counters[base + 1] += rows * row_bytes
