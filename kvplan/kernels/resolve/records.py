"""The records a Triton resolve launch is built from: its compile-time shape, plan mode, batch indexing and
the checked call's arguments (``ResolveArgs``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvplan.calls import SwapInCall
from kvplan.kernels.resolve.constants import ROW_SORT_MAX
from kvplan.plan import MissPlan
from kvplan.validate.arguments import SwapInDims
from kvplan.workspace import next_pow2


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
    block: int = 0  # the block front end (docs/kernels.md §2a): tokens per block id of top_k_tokens (0: token ids)


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

    def table_args(self) -> dict:
        """The state tables, their row strides and sizes (``tables``), by the names of the place and one-program-per-row
        kernels' parameters."""
        names = ("dbt_ptr", "dbl_ptr", "lru_ptr", "hcl_ptr", "scratch_ptr", "table_strides", "table_sizes")
        return dict(zip(names, self.tables, strict=True))

    def flags(self) -> dict:
        """The compile-time flags of the prep, place and one-program-per-row launches."""
        has_num_real = self.call.num_real_reqs is not None
        return dict(SHAPE=self.shape, LAYOUT=self.layout, MODE=self.mode, HAS_NUM_REAL=has_num_real,
                    num_warps=self.warps)  # fmt: skip

    def check_newest(self) -> bool:
        """Single-step calls of the native API: slot HOT serves the newest token unless it names another token
        (the speculative path matches its tail by token anyway, so its builds take ``False``)."""
        return bool(self.call.check_newest) and not self.call.speculative

    def early(self) -> dict:
        """A launch that follows another of the call: it may start early, waiting in the kernel (Hopper and later)."""
        return dict(PDL=self.pdl, launch_pdl=self.pdl)


def sort_block(n: int) -> tuple[int, int, int]:
    """``_sort_row``'s constant for rows of ``n`` occurrences: ``(SB, log2(SB), 2**(62 - log2(SB)) - 1)``."""
    block = min(ROW_SORT_MAX, next_pow2(n))
    log = block.bit_length() - 1
    return block, log, (1 << (62 - log)) - 1
