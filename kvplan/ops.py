"""kvplan's kernels as ``torch.library`` custom ops (namespace ``kvplan``), so compiled engine steps do not break.

A raw Triton launch with Python-side checks in the middle of a ``torch.compile``d step is a graph break (or a
recompile per shape). Registered as custom ops, the kernels are opaque nodes with a declared schema: dynamo records
them without tracing their Python, fake tensors propagate shapes through them, and functionalization knows exactly
which arguments each one writes. The real implementation is the plain launch in ``kvplan.kernels`` (checks
included), so a compiled step and an eager one run the same code on the device.

A ``launch_records`` given to a function here (a pool's) records its eager launches for relaunch; traced calls
record into the kernels' own ``LAUNCHES``.

The functions here have the signatures of ``kvplan.kernels`` (the hot-buffer state and the plan as records) and are
the one route from the pool down to the kernels: eagerly they call ``kvplan.kernels`` directly (the same code without
the dispatcher's round trip); while dynamo traces (``torch.compiler.is_compiling()``) they call the ops, whose
schemas are flat: ``torch.ops.kvplan.swap_in`` takes the fields of ``kvplan.calls.SwapInCall`` in order with the
plan as its three tensors (``SwapInCall.flat()``), ``copy_planned`` the plan's three tensors, ``materialize`` the
kernel's arguments. A custom op cannot return an alias of an input, so the ops return nothing: :func:`swap_in`
returns the plan it was given, and :func:`materialize` allocates missing outputs and returns ``(k_out, v_out)`` like
the kernel. See ``docs/compile.md``.

Importing this module imports the kernels (and Triton): set ``TRITON_INTERPRET`` before it when running on CPU.
"""

from typing import Optional

import torch
from torch import Tensor

from kvplan.calls import SwapInCall, swap_in_blocks_call, swap_in_call
from kvplan.config import plain_int
from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels import copy as _copy
from kvplan.kernels import fused_kv as _fused_kv
from kvplan.kernels import hisparse as _hisparse
from kvplan.kernels.copy import run_copy
from kvplan.kernels.fused_kv import kv_outputs, run_materialize
from kvplan.kernels.hisparse import run_swap_in
from kvplan.kernels.launch_cache import LaunchCache
from kvplan.plan import MissPlan, new_plan_tensors, traceable_plan
from kvplan.state import HotBufferState
from kvplan.validate import check_materialize

__all__ = ["copy_planned", "materialize", "swap_in", "swap_in_blocks"]

# What the swap-in kernels can write (resolve: outputs, hot state, plan, scratch, counters; copy: device rows).
# Read-only: top_k_tokens, host_cache_locs, device_buffer_locs, host_cache, req_pool_indices, seq_lens,
# num_real_reqs, scratch_locs.
SWAP_IN_MUTATES = (
    "top_k_device_locs",
    "device_buffer_tokens",
    "lru_slots",
    "device_buffer",
    "miss_src",
    "miss_dst",
    "miss_count",
    "workspace",
    "counters",
)
# The block front end (docs/kernels.md §2a) writes the V rows too; its copy of a plan into K and V caches likewise.
SWAP_IN_BLOCKS_MUTATES = (*SWAP_IN_MUTATES, "device_buffer_v")
COPY_PLANNED_MUTATES = ("device_buffer", "counters")
COPY_PLANNED_KV_MUTATES = ("device_buffer", "device_buffer_v", "counters")
MATERIALIZE_MUTATES = ("k_out", "v_out")

# infer_schema reads the annotations, so this module keeps them evaluated (no `from __future__ import annotations`)
# and spells optional tensors Optional[Tensor], which every torch version's infer_schema maps to `Tensor?`.


@torch.library.custom_op("kvplan::swap_in", mutates_args=SWAP_IN_MUTATES)
def _swap_in_op(
    speculative: bool,
    device_buffer_tokens: Tensor,
    device_buffer_locs: Tensor,
    lru_slots: Tensor,
    host_cache_locs: Tensor,
    scratch_locs: Optional[Tensor],
    top_k_tokens: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    num_real_reqs: Optional[Tensor],
    miss_src: Optional[Tensor],
    miss_dst: Optional[Tensor],
    miss_count: Optional[Tensor],
    workspace: Optional[Tensor],
    counters: Optional[Tensor],
) -> None:
    """The flat schema of ``kvplan.calls.SwapInCall`` (``SwapInCall.flat()``: the plan as its three tensors)."""
    plan = None if miss_src is None else MissPlan(miss_src, miss_dst, miss_count)
    run_swap_in(SwapInCall(
        speculative, device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs, scratch_locs, top_k_tokens,
        top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer, num_real_reqs, plan, workspace,
        counters,
    ))  # fmt: skip


@torch.library.custom_op("kvplan::swap_in_blocks", mutates_args=SWAP_IN_BLOCKS_MUTATES)
def _swap_in_blocks_op(
    speculative: bool,
    device_buffer_tokens: Tensor,
    device_buffer_locs: Tensor,
    lru_slots: Tensor,
    host_cache_locs: Tensor,
    scratch_locs: Optional[Tensor],
    top_k_tokens: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    num_real_reqs: Optional[Tensor],
    miss_src: Optional[Tensor],
    miss_dst: Optional[Tensor],
    miss_count: Optional[Tensor],
    workspace: Optional[Tensor],
    counters: Optional[Tensor],
    sparse_block_size: int,
    host_cache_v: Optional[Tensor],
    device_buffer_v: Optional[Tensor],
) -> None:
    """The flat schema of a block-selection ``SwapInCall`` (``SwapInCall.flat_blocks()``): ``top_k_tokens`` holds
    the block ids, ``host_cache``/``device_buffer`` the K rows."""
    plan = None if miss_src is None else MissPlan(miss_src, miss_dst, miss_count)
    run_swap_in(SwapInCall(
        speculative, device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs, scratch_locs, top_k_tokens,
        top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer, num_real_reqs, plan, workspace,
        counters, sparse_block_size, host_cache_v, device_buffer_v,
    ))  # fmt: skip


@torch.library.custom_op("kvplan::copy_planned_kv", mutates_args=COPY_PLANNED_KV_MUTATES)
def _copy_planned_kv_op(
    miss_src: Tensor,
    miss_dst: Tensor,
    miss_count: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    host_cache_v: Optional[Tensor],
    device_buffer_v: Optional[Tensor],
    num_real_reqs: Optional[Tensor],
    counters: Optional[Tensor],
    counter_base: int,
    workspace: Optional[Tensor] = None,
) -> None:
    """``copy_planned`` of K and V rows in one pass (``host_cache``/``device_buffer``: the K rows)."""
    plan = MissPlan(miss_src, miss_dst, miss_count)
    run_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, counter_base=counter_base,
        workspace=workspace, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v,
    )  # fmt: skip


@torch.library.custom_op("kvplan::copy_planned", mutates_args=COPY_PLANNED_MUTATES)
def _copy_planned_op(
    miss_src: Tensor,
    miss_dst: Tensor,
    miss_count: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    num_real_reqs: Optional[Tensor],
    counters: Optional[Tensor],
    counter_base: int,
    workspace: Optional[Tensor] = None,
) -> None:
    plan = MissPlan(miss_src, miss_dst, miss_count)
    run_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, counter_base=counter_base,
        workspace=workspace,
    )  # fmt: skip


@torch.library.custom_op("kvplan::materialize", mutates_args=MATERIALIZE_MUTATES)
def _materialize_op(
    kv: Tensor,
    k_norm_weight: Tensor,
    eps: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    k_out: Tensor,
    v_out: Tensor,
    check_positions: bool,
) -> None:
    run_materialize(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out,
        check_positions,
    )  # fmt: skip


# Fake implementations: the ops return nothing and only write arguments in place, so shape propagation has nothing
# to compute. (Argument errors surface when the real launch runs, exactly as in eager mode.)


@_swap_in_op.register_fake
def _swap_in_fake(*args, **kwargs) -> None:
    return None


@_copy_planned_op.register_fake
def _copy_planned_fake(*args, **kwargs) -> None:
    return None


@_swap_in_blocks_op.register_fake
def _swap_in_blocks_fake(*args, **kwargs) -> None:
    return None


@_copy_planned_kv_op.register_fake
def _copy_planned_kv_fake(*args, **kwargs) -> None:
    return None


@_materialize_op.register_fake
def _materialize_fake(*args, **kwargs) -> None:
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The API of kvplan.kernels, through the ops. They call the OpOverload (torch.ops.kvplan.<name>.default): it traces
# to the same graph node as the decorated function and skips that wrapper's extra Python per eager call.


def swap_in(
    state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *, num_real_reqs: Optional[Tensor] = None,
    plan: Optional[MissPlan] = None, workspace: Optional[Tensor] = None, counters: Optional[Tensor] = None,
    speculative: Optional[bool] = None, launch_records: Optional[LaunchCache] = None,
) -> MissPlan:  # fmt: skip
    """:func:`kvplan.kernels.swap_in`; while dynamo traces, through ``torch.ops.kvplan.swap_in``. Returns the plan
    written: ``plan``, or one allocated here when not given (the op itself cannot return what it allocates)."""
    if not torch.compiler.is_compiling():
        return _hisparse.swap_in(
            state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs=num_real_reqs, plan=plan, workspace=workspace, counters=counters, speculative=speculative,
            launch_records=launch_records,
        )  # fmt: skip
    call = swap_in_call(
        speculative, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
        num_real_reqs, plan, workspace, counters,
    )  # fmt: skip
    if plan is None and isinstance(top_k_tokens, Tensor) and top_k_tokens.dim() >= 2:
        # (a refused rank is left to the op's checks, which name it)
        batch, columns, device = top_k_tokens.shape[0], top_k_tokens[0].numel(), top_k_tokens.device
        plan = traceable_plan(
            *new_plan_tensors(batch, columns, device), None
        )  # (dynamo cannot trace MissPlan's __init__)
        call = call._replace(plan=plan)
    torch.ops.kvplan.swap_in.default(*call.flat())
    return plan


def swap_in_blocks(
    state: HotBufferState, top_k_blocks: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache_k: Tensor, host_cache_v: Tensor, device_buffer_k: Tensor, device_buffer_v: Tensor,
    *, sparse_block_size: int, num_real_reqs: Optional[Tensor] = None, plan: Optional[MissPlan] = None,
    workspace: Optional[Tensor] = None, counters: Optional[Tensor] = None,
    launch_records: Optional[LaunchCache] = None,
) -> MissPlan:  # fmt: skip
    """:func:`kvplan.kernels.swap_in_blocks`; while dynamo traces, through ``torch.ops.kvplan.swap_in_blocks``.
    Returns the plan written: ``plan``, or one allocated here when not given."""
    if not torch.compiler.is_compiling():
        return _hisparse.swap_in_blocks(
            state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, host_cache_v,
            device_buffer_k, device_buffer_v, sparse_block_size=sparse_block_size, num_real_reqs=num_real_reqs,
            plan=plan, workspace=workspace, counters=counters, launch_records=launch_records,
        )  # fmt: skip
    call = swap_in_blocks_call(
        state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, host_cache_v,
        device_buffer_k, device_buffer_v, sparse_block_size, num_real_reqs, plan, workspace, counters,
    )  # fmt: skip
    if plan is None and isinstance(top_k_device_locs, Tensor) and top_k_device_locs.dim() == 2:
        # (a refused shape is left to the op's checks, which name it)
        batch, columns = top_k_device_locs.shape
        plan = traceable_plan(*new_plan_tensors(batch, columns, top_k_device_locs.device), None)
        call = call._replace(plan=plan)
    torch.ops.kvplan.swap_in_blocks.default(*call.flat_blocks())
    return plan


def copy_planned(
    plan: MissPlan,
    host_cache: Tensor,
    device_buffer: Tensor,
    *,
    num_real_reqs: Optional[Tensor] = None,
    counters: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
    launch_records: Optional[LaunchCache] = None,
    host_cache_v: Optional[Tensor] = None,
    device_buffer_v: Optional[Tensor] = None,
    _counter_base: int = REPLAY_COPY_BASE,
) -> None:
    """:func:`kvplan.kernels.copy_planned`; while dynamo traces, through ``torch.ops.kvplan.copy_planned`` (with
    ``host_cache_v``/``device_buffer_v``: ``torch.ops.kvplan.copy_planned_kv``, K and V rows in one pass)."""
    if not torch.compiler.is_compiling():
        _copy.run_copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters,
                       counter_base=_counter_base, workspace=workspace, records=launch_records,
                       host_cache_v=host_cache_v, device_buffer_v=device_buffer_v)  # fmt: skip
        return
    if not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a kvplan.MissPlan, got {type(plan).__name__}.")
    if host_cache_v is not None or device_buffer_v is not None:
        torch.ops.kvplan.copy_planned_kv.default(
            plan.src, plan.dst, plan.count, host_cache, device_buffer, host_cache_v, device_buffer_v, num_real_reqs,
            counters, _counter_base, workspace,
        )  # fmt: skip
        return
    torch.ops.kvplan.copy_planned.default(
        plan.src, plan.dst, plan.count, host_cache, device_buffer, num_real_reqs, counters, _counter_base, workspace
    )


def materialize(
    kv: Tensor, k_norm_weight: Tensor, eps: Tensor, cos_sin_cache: Tensor, positions: Tensor, num_kv_heads: int,
    head_dim: int, rotary_dim: int, k_out: Optional[Tensor] = None, v_out: Optional[Tensor] = None, *,
    check_positions: bool = False, launch_records: Optional[LaunchCache] = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`kvplan.kernels.materialize`; while dynamo traces, through ``torch.ops.kvplan.materialize``. Returns
    ``(k_out, v_out)``, the given tensors or new ``[Lyr, T, H, D]`` ones (allocated here when traced: the op itself
    only writes its outputs)."""
    if not torch.compiler.is_compiling():
        return _fused_kv.materialize(
            kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rotary_dim=rotary_dim, k_out=k_out, v_out=v_out, check_positions=check_positions,
            launch_records=launch_records,
        )  # fmt: skip
    num_kv_heads, head_dim, rotary_dim = (plain_int(v) for v in (num_kv_heads, head_dim, rotary_dim))
    if k_out is None or v_out is None:
        # validate before reading kv's shape, so a bad kv reports the spec's message, not an IndexError
        check_materialize(
            kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
        )
        k_out, v_out = kv_outputs(kv, num_kv_heads, head_dim, k_out, v_out)
    torch.ops.kvplan.materialize.default(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out,
        check_positions,
    )  # fmt: skip
    return k_out, v_out
