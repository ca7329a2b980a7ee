"""The Triton resolve of one program per row: every stage of the row in order.
Names: the kernel glossary, ``kvplan/kernels/glossary.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.kernels.resolve.records import ResolveArgs, sort_block
from kvplan.kernels.resolve.share import _sort_row
from kvplan.kernels.resolve.stages import _insert_chunk, _place_stage, _prep_chunk, _row_of
from kvplan.kernels.resolve.tables import _end_epoch
from kvplan.runtime.launch_replay import Recorder

# ---------------------------------------------------------------------------------------------------------------------
# One program per row: every stage of the row in order (chunk waits are then always met)

_ROW_INTS = ["tok_strides", "out_strides", "batch_indexing", "state_stride", "table_strides", "table_sizes",
             "plan_stride", "ws_stride"]  # fmt: skip


@triton.jit(do_not_specialize=_ROW_INTS)
def _resolve_row_kernel(
    # pointers (as _place_kernel's)
    tokens_ptr,  # top_k_tokens
    out_ptr,  # top_k_device_locs (written)
    rpi_ptr,  # the batch rows: req_pool_indices, seq_lens, num_real_reqs (read by _row_of, which says what)
    seq_ptr,
    num_real_ptr,
    dbt_ptr,  # the state tables
    dbl_ptr,
    lru_ptr,
    hcl_ptr,
    scratch_ptr,
    src_ptr,  # [>= B, >= S*K] int64 miss_src (written)
    dst_ptr,  # [>= B, >= S*K] int32 miss_dst (written)
    count_ptr,  # [>= B] int32 miss_count (written)
    ws_ptr,  # [B, LAYOUT.words] int32 workspace rows
    counters_ptr,  # [NUM_COUNTERS] int64 (when HAS_COUNTERS)
    # strides
    tok_strides,  # top_k_tokens' and top_k_device_locs' strides
    out_strides,
    table_strides,  # the state tables' row strides (as _place_kernel's)
    plan_stride,  # miss_src's and miss_dst's row stride
    ws_stride,  # the workspace's row stride
    # sizes
    batch_indexing,  # the batch rows' strides, B and R (BatchIndexing), read by _row_of
    table_sizes,  # (max_len, scratch)
    # compile-time: the path, the shapes, the plan's mode, the sort's block, flags
    SPEC: tl.constexpr,
    SHAPE: tl.constexpr,  # ResolveShape
    LAYOUT: tl.constexpr,  # WorkspaceRegions
    MODE: tl.constexpr,  # PlanMode
    SORT_BLOCK: tl.constexpr,  # (misses sorted at once, its log2, the largest host row sorted as itself): _sort_row
    HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
    CHECK_NEWEST: tl.constexpr,  # (_prep_chunk says what)
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
            CHECK_NEWEST,
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
        tokens_ptr=a.tokens, tok_strides=a.tokens.stride(), out_ptr=a.out, out_strides=a.out.stride(),
        rpi_ptr=call.req_pool_indices, seq_ptr=call.seq_lens, num_real_ptr=a.num_real,
        batch_indexing=a.batch_indexing, **a.table_args(), src_ptr=a.plan.src, dst_ptr=a.plan.dst,
        plan_stride=a.plan.src.stride(0), count_ptr=a.plan.count, ws_ptr=a.ws32, ws_stride=a.ws_stride,
        counters_ptr=a.counters,
        SPEC=call.speculative, SORT_BLOCK=sort_block(a.dims.occurrences), HAS_COUNTERS=call.counters is not None,
        CHECK_NEWEST=a.check_newest(), **a.flags(),
    )  # fmt: skip
