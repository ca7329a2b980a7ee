"""The swap-in's launch planner: from a call's shapes, its device and what its plan will show, which resolve and which
copy run. The rules live here and nowhere else; ``kvplan bench swap_in`` prints each call's decision (``str(plan)``)
and tests call :func:`plan_swap_in` directly.

Resolves (docs/kernels.md, "8. How the kernels work"):

- ``onchip``: one CUDA block per batch row, the row's tables in shared memory (``kvplan.kernels.onchip``), whenever
  the device, the sizes and ``cuda-core`` allow it: its cost is flat in batch up to a wave of blocks;
- ``split``: the Triton resolve with many programs per row (prep, insert, place), below ``PER_ROW_MIN_BATCH``;
- ``per_row``: the Triton resolve with one program per row, from ``PER_ROW_MIN_BATCH``.

The Triton resolves are the portable path (the CPU interpreter, GPUs without the on-chip build). ``ResolveLaunch``'s
``resolve`` field, else the environment variable ``KVPLAN_RESOLVE`` (``auto``, ``onchip``, ``triton``), forces one;
forcing ``onchip`` where it cannot run raises :class:`OnChipUnavailable` naming why.

Plans and copies: up to ``FLAT_COPY_MAX_BATCH`` rows the plan stays in miss order and a flat copy moves it with every
row in flight (after the on-chip resolve, each plan row once its block has published it: ``row_ready``); above it
each plan row is sorted by host row (a single-step plan keeps miss order and leaves its host-row order in the
workspace for the swap-in's own copy), entries claim their host rows in one table for the call when that table can
name them all (``shared``: after the on-chip resolve its blocks claim them as they write their plan rows, with no
launch of their own), and the ordered copy reads the host in address order once every row's claims are made.
"""

from __future__ import annotations

import os

import attrs
import torch

from kvplan.runtime.device import num_sms
from kvplan.workspace import HOST_ROW_LIMIT, swap_in_workspace_regions

__all__ = [
    "FLAT_COPY_MAX_BATCH",
    "PER_ROW_MIN_BATCH",
    "OFFSET_LIMIT",
    "RESOLVE_ENV",
    "OnChipUnavailable",
    "SwapInLaunchPlan",
    "plan_swap_in",
]

# Up to this batch the plan stays in miss order and a flat copy moves it with every row in flight: sorting and sharing
# host rows would only add their launches' latency (docs/benchmarks.md, "Flat copy"). Above it the sorted plan, shared
# host rows and the ordered copy.
FLAT_COPY_MAX_BATCH = 4
# From this batch the Triton resolve runs one program per row (docs/benchmarks.md, "Per-row resolve"): the batch alone
# fills the GPU, and the split resolve's chained launches and waits cost more than they spread.
PER_ROW_MIN_BATCH = 96
# Plan offsets (batch * plan row stride) the call's host-row table can name.
OFFSET_LIMIT = 1 << 24
RESOLVE_ENV = "KVPLAN_RESOLVE"
RESOLVES = ("auto", "onchip", "triton")


class OnChipUnavailable(RuntimeError):
    """The on-chip resolve was forced where it cannot run; the message says why."""


@attrs.frozen
class SwapInLaunchPlan:
    """What runs one swap-in: the resolve (``onchip``, ``split``, ``per_row``), the plan's order (``sorted``; with
    ``apart`` a single-step plan stays in miss order and its host-row order goes to the workspace), whether entries
    share host rows (``shared``), the copy (``flat``, ``ordered``), whether the copy takes each row as the on-chip
    resolve publishes it (``row_ready``: it starts on a row when that row's misses are known, not when every row's
    are), whether the sort and share launch follows the resolve (``share_launch``: after the Triton resolves, and
    after the on-chip one unless its blocks claimed their entries' host rows themselves; then the copy writes row 0's
    format word, or without one a launch of one program: ``format_launch``), and why the resolve was chosen."""

    resolve: str
    sorted: bool
    shared: bool
    apart: bool
    copy: str
    why: str
    onchip: object = attrs.field(default=None, eq=False, repr=False)  # the on-chip build's OnChipConfig
    row_ready: bool = False
    share_launch: bool = False  # the sort and share launch follows the resolve
    format_launch: bool = False  # one program writes row 0's format word (on-chip claims, no copy after them)

    @property
    def copy_writes_format(self) -> bool:
        """Whether the swap-in's copy writes row 0's format word: after on-chip claims, when the copy follows."""
        return self.onchip is not None and self.onchip.share and not self.format_launch

    def __str__(self) -> str:
        plan = "miss order"
        if self.sorted:
            plan = "sorted" + (", apart" if self.apart else "") + (", shared" if self.shared else "")
        if self.sorted and self.shared and not self.share_launch:
            plan += " on chip"
        copy = self.copy + (" per row" if self.row_ready else "")
        return f"resolve={self.resolve} plan=({plan}) copy={copy} [{self.why}]"


def requested_resolve(launch_resolve: str | None) -> str:
    """The resolve asked for: ``launch_resolve`` when given, else ``KVPLAN_RESOLVE`` (default ``auto``)."""
    asked = launch_resolve if launch_resolve is not None else os.environ.get(RESOLVE_ENV, "").strip().lower() or "auto"
    if asked not in RESOLVES:
        source = "ResolveLaunch.resolve" if launch_resolve is not None else RESOLVE_ENV
        raise ValueError(f"{source} must be one of {', '.join(RESOLVES)}, got {asked!r}")
    return asked


def plan_swap_in(call, dims, launch, plan_stride: int, copies: bool = True) -> SwapInLaunchPlan:
    """The launches of a checked call (``call``: ``SwapInCall``, ``dims``: its ``SwapInDims``, ``launch``: the
    ``ResolveLaunch`` overrides, ``plan_stride``: the plan's row stride, ``copies``: whether the swap-in's own copy
    follows; benchmarks time the resolve alone without it)."""
    batch = dims.batch
    sort = launch.sorted_plan if launch.sorted_plan is not None else batch > FLAT_COPY_MAX_BATCH
    share = (
        sort
        and launch.shared_rows is not False
        and call.host_cache.shape[1] > 0
        and call.host_cache.shape[0] <= HOST_ROW_LIMIT
        and batch * max(plan_stride, dims.occurrences) <= OFFSET_LIMIT
    )
    apart = bool(sort) and not call.speculative
    copy = "ordered" if sort else "flat"
    asked = requested_resolve(getattr(launch, "resolve", None))
    why_not = None
    if asked != "triton" and dims.occurrences:
        # a plan in miss order goes to the copy row by row (a sorted plan's copy needs the call's claims first)
        row_ready = not sort and getattr(launch, "row_ready", True)
        # a shared plan's entries claim their host rows in the resolve when its blocks run as one wave (a block then
        # claims into rows whose blocks have taken their epoch: each distinct host row read once), else in the share
        # launch. Row 0's format word, which every block read, is written after them all: by the share launch, by
        # the copy, or without a copy by a launch of one program
        claims = bool(share) and batch <= num_sms(call.top_k_tokens.device)
        config, why_not = _onchip_build(call, dims, bool(sort), apart, row_ready, claims)
        if why_not is None:
            why = f"{asked}: on-chip"
            return SwapInLaunchPlan("onchip", bool(sort), bool(share), apart, copy, why, config, row_ready,
                                    bool(sort) and not claims, claims and not copies)  # fmt: skip
        if asked == "onchip":
            raise OnChipUnavailable(f"the on-chip resolve was forced ({RESOLVE_ENV} or ResolveLaunch) but {why_not}")
    per_row = launch.per_row if launch.per_row is not None else batch >= PER_ROW_MIN_BATCH
    resolve = "per_row" if per_row else "split"
    why = "triton forced" if asked == "triton" else (why_not or "no occurrences")
    return SwapInLaunchPlan(resolve, bool(sort), bool(share), apart, copy, why, share_launch=bool(sort) or per_row)


def _onchip_build(call, dims, sort: bool, apart: bool, ready: bool, claims: bool) -> tuple[object, str | None]:
    """The on-chip build this call needs, and why it cannot run (None when it can)."""
    device = call.top_k_tokens.device
    if device.type != "cuda":
        return None, f"device {device} is not a CUDA device"
    from kvplan.kernels.onchip.compiler import OnChipConfig
    from kvplan.kernels.onchip.launch import unavailable

    config = OnChipConfig(
        steps=dims.steps, top_k=dims.top_k, hot=dims.hot, tail=dims.tail, speculative=bool(call.speculative),
        sorted=sort, apart=apart, epochs=sort, rpi64=call.req_pool_indices.dtype == torch.int64,
        seq64=call.seq_lens.dtype == torch.int64, has_num_real=call.num_real_reqs is not None,
        has_counters=call.counters is not None, layout=swap_in_workspace_regions(dims.steps, dims.top_k),
        block=getattr(call, "sparse_block_size", None) or 0,
        check_newest=bool(call.check_newest) and not call.speculative,
        dense_tokens=_dense_rows(call.top_k_tokens), dense_out=_dense_rows(call.top_k_device_locs), ready=ready,
        share=claims,
    )  # fmt: skip
    return config, unavailable(device, config)


def _dense_rows(t: torch.Tensor) -> bool:
    """Whether each batch row of ``t`` (``[B, K]`` or ``[B, S, K]``) is dense: its element ``i`` at offset ``i``."""
    return t.stride(-1) == 1 and (t.dim() == 2 or t.shape[1] == 1 or t.stride(1) == t.shape[2])
