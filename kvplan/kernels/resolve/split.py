"""The split Triton resolve: prep, insert and place launches of many programs per row.
Names: the kernel glossary, ``kvplan/kernels/glossary.py``."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvplan.kernels.resolve.records import ResolveArgs, ResolveShape
from kvplan.kernels.resolve.stages import (
    _insert_chunk,
    _place_stage,
    _prep_chunk,
    _row_of,
)
from kvplan.kernels.resolve.tables import _end_epoch
from kvplan.runtime.launch_replay import Recorder

# ---------------------------------------------------------------------------------------------------------------------
# The split resolve: prep, insert and place launches of many programs per row


_PREP_INTS = ["tok_strides", "out_strides", "batch_indexing", "state_stride", "ws_stride"]


@triton.jit(do_not_specialize=_PREP_INTS)
def _prep_kernel(
    # pointers
    tokens_ptr,  # top_k_tokens (_prep_chunk says what each tensor is)
    out_ptr,  # top_k_device_locs
    rpi_ptr,  # the batch rows: req_pool_indices, seq_lens, num_real_reqs (read by _row_of, which says what)
    seq_ptr,
    num_real_ptr,
    dbt_ptr,  # [R, HOT + P] int32 device_buffer_tokens
    dbl_ptr,  # [R, HOT + P] int32 device_buffer_locs
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,  # [B, LAYOUT.words] int32 workspace rows (not touched when S*K == 0)
    # strides
    tok_strides,  # top_k_tokens' and top_k_device_locs' strides
    out_strides,
    state_stride,  # device_buffer_tokens' and _locs' row stride
    ws_stride,  # the workspace's row stride
    # sizes
    batch_indexing,  # the batch rows' strides, B and R (BatchIndexing), read by _row_of
    # compile-time: the path, the shapes, the plan's mode, flags
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    HAS_NUM_REAL: tl.constexpr,
    CHECK_NEWEST: tl.constexpr,  # (_prep_chunk says what)
):
    """Grid ``_prep_grid``, ``(occ_chunks, B)``: the prep stage of chunk ``program_id(0)`` of row ``program_id(1)``."""
    _prep_chunk(
        tl.program_id(0), tl.program_id(1), tokens_ptr, tok_strides, out_ptr, out_strides, rpi_ptr, seq_ptr,
        num_real_ptr, batch_indexing, dbt_ptr, dbl_ptr, state_stride, count_ptr, ws_ptr, ws_stride, SPEC, SHAPE, LAYOUT,
        MODE, HAS_NUM_REAL, CHECK_NEWEST,
    )  # fmt: skip


def _prep_grid(shape: ResolveShape, batch: int) -> tuple[int, int]:
    """Axis 0: occurrence chunk, axis 1: batch row."""
    return (shape.occ_chunks, batch)


def _launch_prep(recorder: Recorder, a: ResolveArgs) -> None:
    """The split resolve's first launch (it never starts early: nothing of the call runs before it)."""
    call = a.call
    recorder.launch(
        _prep_kernel, _prep_grid(a.shape, a.dims.batch),
        tokens_ptr=a.tokens, tok_strides=a.tokens.stride(), out_ptr=a.out, out_strides=a.out.stride(),
        rpi_ptr=call.req_pool_indices, seq_ptr=call.seq_lens, num_real_ptr=a.num_real,
        batch_indexing=a.batch_indexing, dbt_ptr=call.device_buffer_tokens, dbl_ptr=call.device_buffer_locs,
        state_stride=call.device_buffer_tokens.stride(0), count_ptr=a.plan.count, ws_ptr=a.ws32,
        ws_stride=a.ws_stride,
        SPEC=call.speculative, CHECK_NEWEST=a.check_newest(), **a.flags(),
    )  # fmt: skip


_INSERT_INTS = ["tok_strides", "batch_indexing", "ws_stride"]


@triton.jit(do_not_specialize=_INSERT_INTS)
def _insert_kernel(
    # pointers
    tokens_ptr,  # [B, S, K] int32 top_k_tokens
    rpi_ptr,  # the batch rows: req_pool_indices, seq_lens, num_real_reqs (read by _row_of, which says what)
    seq_ptr,
    num_real_ptr,
    ws_ptr,  # [B, LAYOUT.words] int32 workspace rows (the table)
    # strides
    tok_strides,  # top_k_tokens' strides
    ws_stride,  # the workspace's row stride
    # sizes
    batch_indexing,  # the batch rows' strides, B and R (BatchIndexing), read by _row_of
    # compile-time: the shapes, flags
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
        tokens_ptr=a.tokens, tok_strides=a.tokens.stride(), rpi_ptr=call.req_pool_indices, seq_ptr=call.seq_lens,
        num_real_ptr=a.num_real, batch_indexing=a.batch_indexing, ws_ptr=a.ws32, ws_stride=a.ws_stride,
        SHAPE=a.shape, LAYOUT=a.layout, HAS_NUM_REAL=call.num_real_reqs is not None, num_warps=a.warps, **a.early(),
    )  # fmt: skip


_PLACE_INTS = [
    "tok_strides", "out_strides", "batch_indexing", "table_strides", "table_sizes", "plan_stride", "ws_stride"
]  # fmt: skip


@triton.jit(do_not_specialize=_PLACE_INTS)
def _place_kernel(
    # pointers
    tokens_ptr,  # [B, S, K] int32 top_k_tokens
    out_ptr,  # [B, S, K] int32 top_k_device_locs (written)
    rpi_ptr,  # the batch rows: req_pool_indices, seq_lens, num_real_reqs (read by _row_of, which says what)
    seq_ptr,
    num_real_ptr,
    dbt_ptr,  # [R, HOT + P] int32 device_buffer_tokens, row stride table_strides[0]
    dbl_ptr,  # [R, HOT + P] int32 device_buffer_locs, row stride table_strides[0]
    lru_ptr,  # [R, HOT] int16 lru_slots, row stride table_strides[1]
    hcl_ptr,  # [R, max_len] int64 host_cache_locs, row stride table_strides[2]
    scratch_ptr,  # [R, scratch] int32 scratch_locs, row stride table_strides[3] (read when SPEC)
    src_ptr,  # [>= B, >= S*K] int64 miss_src (written unless MODE.sorted)
    dst_ptr,  # [>= B, >= S*K] int32 miss_dst (written unless MODE.sorted)
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,  # [B, LAYOUT.words] int32 workspace rows
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    # strides
    tok_strides,  # top_k_tokens' and top_k_device_locs' strides
    out_strides,
    table_strides,  # the state tables' row strides (above)
    plan_stride,  # miss_src's and miss_dst's row stride
    ws_stride,  # the workspace's row stride
    # sizes
    batch_indexing,  # the batch rows' strides, B and R (BatchIndexing), read by _row_of
    table_sizes,  # (max_len, scratch)
    # compile-time: the path, the shapes, the plan's mode, flags
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
        tokens_ptr=a.tokens, tok_strides=a.tokens.stride(), out_ptr=a.out, out_strides=a.out.stride(),
        rpi_ptr=call.req_pool_indices, seq_ptr=call.seq_lens, num_real_ptr=a.num_real,
        batch_indexing=a.batch_indexing, **a.table_args(), src_ptr=a.plan.src, dst_ptr=a.plan.dst,
        plan_stride=a.plan.src.stride(0), count_ptr=a.plan.count, ws_ptr=a.ws32, ws_stride=a.ws_stride,
        counters_ptr=a.counters,
        SPEC=call.speculative, HAS_COUNTERS=call.counters is not None, **a.flags(), **a.early(),
    )  # fmt: skip
