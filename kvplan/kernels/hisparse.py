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
  copy with every row in flight (``kvplan.kernels.plan_copy``);
- up to ``PER_ROW_MIN_BATCH``: the same resolve with many programs per row, then a sort and share launch, then the
  ordered copy of host rows and the copy of shared rows;
- from ``PER_ROW_MIN_BATCH``: one program per row takes every stage 1-4 in order (the batch alone fills the GPU, and
  the chained launches and waits of the split resolve cost more than they spread), then the share launch and the
  same copies.

The tables' compare-and-swaps and ``atomic_min``s, the claims and the counters are relaxed atomics: each decides
by one location alone (its atomicity and per-location coherence), and what another program reads of them is ordered
by a later launch or by a count published after a barrier (``_publish``, a release; ``_wait_counts``, acquires), as
for plain stores. The default ``acq_rel`` would fence every round of a probe loop on the program's earlier stores
(docs/benchmarks.md, "Relaxed atomics").

Each result is deterministic (the order of table entries is not, and neither is which entry of a shared host row
reads the host, but nothing observable depends on either). Every state access is masked against its table:
out-of-range ``rid``, tokens, LRU entries and rows never touch memory outside the tensors, with the outcomes the
reference defines.

Names: the kernel glossary, ``kvplan/kernels/glossary.py``.
"""

from __future__ import annotations

import attrs
import torch
import triton

from kvplan.calls import SwapInCall, refuse_stale_tails, swap_in_blocks_call, swap_in_call
from kvplan.counters import SWAP_IN_COPY_BASE
from kvplan.kernels.onchip.launch import launch_resolve as launch_onchip
from kvplan.kernels.plan_copy.launch import COPY_LAUNCH, FLAT_COPY_LAUNCH, CopyLaunch, launch_copy
from kvplan.kernels.planner import plan_swap_in
from kvplan.kernels.resolve.per_row import _launch_resolve_row
from kvplan.kernels.resolve.records import BatchIndexing, PlanMode, ResolveArgs, ResolveShape
from kvplan.kernels.resolve.share import _launch_format_word, _launch_sort_plan
from kvplan.kernels.resolve.split import _insert_kernel, _launch_insert, _launch_place, _launch_prep
from kvplan.plan import MissPlan
from kvplan.runtime.device import dependent_launch, device_guard
from kvplan.runtime.launch_replay import UNRECORDED, LaunchCache, Recorder
from kvplan.state import HotBufferState
from kvplan.validate.arguments import SwapInDims, check_swap_in
from kvplan.workspace import (
    HOT_CHUNK_MIN,
    OCC_CHUNK_MIN,
    forget_tables,
    format_word,
    next_pow2,
    swap_in_workspace_columns,
    swap_in_workspace_regions,
)

__all__ = ["ResolveLaunch", "swap_in", "swap_in_blocks"]


@attrs.frozen
class ResolveLaunch:
    """Launch shape of the resolve. The split resolve (many programs per row): occurrences and LRU positions per
    program and warps per program; the resolve of one program per row: the same three (``row_*``); which of them
    (``per_row``; ``None``: by ``PER_ROW_MIN_BATCH``), whether the plan is sorted (``sorted_plan``; ``None``: above
    ``FLAT_COPY_MAX_BATCH``), whether a sorted plan's entries share host rows (``shared_rows``; ``None``: when the
    call's table can name every host row and plan offset; ``False`` measures what sharing costs), which resolve
    runs (``resolve``: ``"onchip"``, ``"triton"``, ``"auto"``; ``None``: ``KVPLAN_RESOLVE``, else auto) and whether
    the flat copy after the on-chip resolve takes each row as soon as it is published (``row_ready``; ``False``
    measures the copy after the whole resolve). The rules are ``kvplan.kernels.planner``'s."""

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
    row_ready: bool = True


RESOLVE_LAUNCH = ResolveLaunch()


# ---------------------------------------------------------------------------------------------------------------------
# Launch


def run_swap_in(
    call: SwapInCall,
    launch: ResolveLaunch | None = None,
    copy_launch: CopyLaunch | None = None,
    copy: bool = True,
    records: LaunchCache | None = None,
) -> MissPlan:
    """Check, resolve and copy one call (every entry point's launch: :func:`swap_in`, the custom op, the pool, the
    benchmarks); returns the plan written. ``launch``/``copy_launch`` override the tuned launch shapes and
    ``copy=False`` skips the host->device copy (both for benchmarks: a call without its copy breaks the contract).
    With ``records`` (a pool's), a call laid out like a checked one that allocated nothing is launched again from its
    record (``kvplan.runtime.launch_replay``); without, every call is checked and launched, nothing recorded."""
    launch = launch or RESOLVE_LAUNCH  # keyed as launched (tests and benchmarks swap the defaults)
    copy_launch = copy_launch or COPY_LAUNCH
    if records is None:
        return _launch_swap_in(call, check_swap_in(call), UNRECORDED, launch, copy_launch, copy)
    allocates = call.plan is None or call.workspace is None
    key = None if allocates else records.key((*call.flat_blocks(), launch, copy_launch, copy))
    if records.relaunch(key, call.top_k_tokens):
        return call.plan
    dims = check_swap_in(call)
    recorder = Recorder()
    plan = _launch_swap_in(call, dims, recorder, launch, copy_launch, copy)
    records.remember(key, recorder)
    return plan


def resolve_shape(dims: SwapInDims, occ_chunk: int, hot_chunk: int, in_order: bool, block: int = 0) -> ResolveShape:
    """The chunking of a call: ``occ_chunk``/``hot_chunk`` rounded to powers of two within the row's sizes;
    ``block``: tokens per block id of a block selection (0: token ids)."""
    n = dims.occurrences
    occ_chunk = min(next_pow2(n), max(next_pow2(occ_chunk), OCC_CHUNK_MIN))
    hot_chunk = max(HOT_CHUNK_MIN, min(next_pow2(dims.hot), next_pow2(hot_chunk)))
    occ_chunks, hot_chunks = triton.cdiv(max(n, 1), occ_chunk), triton.cdiv(dims.hot, hot_chunk)
    return ResolveShape(dims.steps, dims.top_k, dims.hot, dims.tail, occ_chunk, hot_chunk, occ_chunks, hot_chunks,
                        next_pow2(occ_chunks), next_pow2(hot_chunks), in_order, block)  # fmt: skip


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
    copies = copy and call.host_cache.shape[1] > 0  # the swap-in's own copy follows (the planner's format rule too)
    chosen = plan_swap_in(call, dims, launch, plan_stride, copies=copies)
    per_row = chosen.resolve == "per_row"
    mode = PlanMode(chosen.sorted, chosen.shared, chosen.apart)
    block = call.sparse_block_size or 0
    if per_row:
        shape, warps = resolve_shape(dims, launch.row_occ_chunk, launch.row_hot_chunk, True, block), launch.row_warps
    else:
        shape, warps = resolve_shape(dims, launch.occ_chunk, launch.hot_chunk, False, block), launch.num_warps
    # [B, S, K] (a block selection: [B, 1, NB], each id read for its block's K / NB occurrences)
    tokens = call.top_k_tokens if call.speculative else call.top_k_tokens.unsqueeze(1)
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
            # one block per row resolves, sorts and (a shared plan) claims host rows; the copy after it then writes row
            # 0's format word, which every block read, else the share launch does (and claims, when shared)
            launch_onchip(recorder, args, chosen.onchip)
            if chosen.share_launch:
                _launch_sort_plan(recorder, args, sort=False, row_block=chosen.onchip.sort_block)
            elif chosen.format_launch:
                _launch_format_word(recorder, args)
        else:
            if per_row:
                _launch_resolve_row(recorder, args)
            else:
                _launch_prep(recorder, args)
                if n:
                    _launch_insert(recorder, args)
                    _launch_place(recorder, args)
            if n and chosen.share_launch:
                _launch_sort_plan(recorder, args, sort=not per_row)
    if n and copies:
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
            host_cache_v=call.host_cache_v,
            device_buffer_v=call.device_buffer_v,
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
            # (the on-chip resolve publishes each row of a plan in miss order: the copy takes it at once)
            ready_at=layout.sync if chosen.row_ready else None,
            # (after on-chip claims: row 0's format word, which every block read, once the resolve is done)
            format_word=format_word(layout, ws_stride) if chosen.copy_writes_format else None,
        )
    return plan


def swap_in(
    state: HotBufferState, top_k_tokens: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, speculative: bool | None = None, launch_records: LaunchCache | None = None,
    check_newest: bool = True,
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
        Where a checked call's launches are recorded, so that a later call laid out alike skips its checks and
        relaunches them under the records' policy (``kvplan.runtime.launch_replay``; a pool passes its own: its
        ``stats()`` count them and a growth drops them). ``None`` (the default): every call is checked and launched,
        nothing is recorded.
    check_newest : bool
        Single-step: the newest token (``seq_len - 1``) resolves to slot ``HOT``'s device row unless
        ``device_buffer_tokens[rid, HOT]`` names another token (a forgotten ``write_tail``): then to ``-1``
        (docs/kernels.md §2 rule 11). ``False`` is SGLang's rule, slot ``HOT`` whatever it holds (the adapter's).

    Returns
    -------
    MissPlan
        The plan written: ``plan`` itself when given. Given ``plan`` and ``workspace`` the call allocates nothing and
        never synchronises (CUDA-graph capturable).

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type, shape, dtype, device or layout, named in the message; nothing is written.
    StateCheckError
        A request's tail is known to be stale (``state.append`` backed a newer token than the newest one
        ``state.write_tail`` put at slot ``HOT``: the swap-in would serve another token's row), from the state's host
        records alone, as ``pool.swap_in`` refuses it; nothing is written.
    """
    refuse_stale_tails(state, "kvplan.kernels.swap_in")  # (host records: no device access)
    call = swap_in_call(
        speculative, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
        num_real_reqs, plan, workspace, counters, check_newest,
    )  # fmt: skip
    written = run_swap_in(call, records=launch_records)
    return written if plan is None else plan


def swap_in_blocks(
    state: HotBufferState, top_k_blocks: torch.Tensor, top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, host_cache_k: torch.Tensor, host_cache_v: torch.Tensor,
    device_buffer_k: torch.Tensor, device_buffer_v: torch.Tensor, *, sparse_block_size: int,
    num_real_reqs: torch.Tensor | None = None, plan: MissPlan | None = None, workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None, launch_records: LaunchCache | None = None, check_newest: bool = True,
) -> MissPlan:  # fmt: skip
    """Block-selection swap-in of an MHA layer's K and V rows (docs/kernels.md §2a): the single-step swap-in (§2) of
    the tokens the selected blocks name, each miss copying its K row and its V row.

    Block ``n`` of a row names tokens ``n * sparse_block_size + j`` (``j < sparse_block_size``); a negative id
    (``-1``: no block) names none. The resolve reads each token through the block id that covers it (no token list
    is written); residency, hits, LRU order and eviction are per token, exactly as :func:`swap_in`'s single-step
    path, except that a short row has no ``min(L, K)`` cut-off: every valid token outputs its slot's row.

    Parameters
    ----------
    state : HotBufferState
        Read and written (``device_buffer_tokens``, ``lru_slots``), as :func:`swap_in`.
    top_k_blocks : Tensor
        Read. int32 ``[B, NB]``: block ids; a token at or past the row's length, or of a negative id, outputs ``-1``.
    top_k_device_locs : Tensor
        Written. int32 ``[B, NB * sparse_block_size]``: the device row serving each token of each block, in block
        order (``-1`` for none; every entry of a padding row).
    req_pool_indices, seq_lens : Tensor
        Read. int32/int64 ``[>= B]`` each, as :func:`swap_in`'s single-step path.
    host_cache_k, host_cache_v : Tensor
        Read. ``[host_rows, item]`` K and V rows, same shape, dtype and row stride; pinned host memory (read
        zero-copy) or on the device.
    device_buffer_k, device_buffer_v : Tensor
        Written (the rows of missed tokens). ``[device_rows, item]`` each, the host caches' dtype, same shape and row
        stride, on the device.
    sparse_block_size : int
        Tokens per block id, ``>= 1``. ``HOT >= NB * sparse_block_size`` (the selected tokens) is required.
    num_real_reqs, plan, workspace, counters, launch_records
        As :func:`swap_in` (the plan and workspace for ``top_k = NB * sparse_block_size``: ``[>= B, >= NB *
        sparse_block_size]``). The plan is recorded as for any single-step call: replay it into another layer's K and
        V caches with :func:`kvplan.kernels.copy_planned` (``host_cache_v=``, ``device_buffer_v=``). The counters
        count a miss once and the bytes of both its rows.
    check_newest : bool
        As :func:`swap_in`'s (docs/kernels.md §2 rule 11): the place of the newest token (``seq_len - 1``) resolves to
        slot ``HOT``'s device row unless ``device_buffer_tokens[rid, HOT]`` names another token, else ``-1``.
        ``False`` is SGLang's rule (the adapter ``load_blocks_to_device_buffer_mha``'s).

    Returns
    -------
    MissPlan
        The plan written (``plan`` itself when given; then, with ``workspace``, the call allocates nothing and never
        synchronises).

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type, shape, dtype, device or layout (K and V differing included), named in the
        message; nothing is written.
    StateCheckError
        As :func:`swap_in`: a tail the state's host records know to be stale.
    """
    refuse_stale_tails(state, "kvplan.kernels.swap_in_blocks")  # (host records: no device access)
    call = swap_in_blocks_call(
        state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, host_cache_v,
        device_buffer_k, device_buffer_v, sparse_block_size, num_real_reqs, plan, workspace, counters, check_newest,
    )  # fmt: skip
    written = run_swap_in(call, records=launch_records)
    return written if plan is None else plan
