"""kvplan's kernels as ``torch.library`` custom ops (namespace ``kvplan``), so compiled engine steps do not break.

A raw Triton launch with Python-side checks in the middle of a ``torch.compile``d step is a graph break (or a
recompile per shape). Registered as custom ops, the kernels are opaque nodes with a declared schema: dynamo records
them without tracing their Python, fake tensors propagate shapes through them, and functionalization knows exactly
which arguments each one writes. The real implementation is the plain launch in ``kvplan.kernels`` (checks
included), so a compiled step and an eager one run the same code on the device.

``torch.ops.kvplan.{swap_in, swap_in_spec, copy_planned, materialize}`` take their arguments positionally or by name;
the functions here have the keyword signatures of ``kvplan.kernels`` and call them. A custom op cannot return an
alias of an input, so the ``materialize`` op writes ``k_out``/``v_out`` and returns nothing; :func:`materialize`
allocates them when they are ``None`` and returns ``(k_out, v_out)`` like the kernel. See ``docs/compile.md``.

Importing this module imports the kernels (and Triton): set ``TRITON_INTERPRET`` before it when running on CPU.
"""

from typing import Optional

import torch
from torch import Tensor

from kvplan import kernels
from kvplan.counters import REPLAY_COPY_BASE
from kvplan.validate import check_materialize

__all__ = ["copy_planned", "materialize", "swap_in", "swap_in_spec"]

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
COPY_PLANNED_MUTATES = ("device_buffer", "counters")
MATERIALIZE_MUTATES = ("k_out", "v_out")

# The ops' parameters are positional-or-keyword (the schema the dispatcher sees); the Python-level functions below
# are keyword-only, as in kvplan.kernels. infer_schema reads the annotations, so this module keeps them evaluated
# (no `from __future__ import annotations`) and spells optional tensors Optional[Tensor], which every torch
# version's infer_schema maps to `Tensor?`.


@torch.library.custom_op("kvplan::swap_in", mutates_args=SWAP_IN_MUTATES)
def _swap_in_op(
    top_k_tokens: Tensor,
    device_buffer_tokens: Tensor,
    host_cache_locs: Tensor,
    device_buffer_locs: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    lru_slots: Tensor,
    num_real_reqs: Optional[Tensor] = None,
    miss_src: Optional[Tensor] = None,
    miss_dst: Optional[Tensor] = None,
    miss_count: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
    counters: Optional[Tensor] = None,
) -> None:
    kernels.swap_in(
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
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        workspace=workspace,
        counters=counters,
    )


@torch.library.custom_op("kvplan::swap_in_spec", mutates_args=SWAP_IN_MUTATES)
def _swap_in_spec_op(
    top_k_tokens: Tensor,
    device_buffer_tokens: Tensor,
    host_cache_locs: Tensor,
    device_buffer_locs: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    lru_slots: Tensor,
    num_real_reqs: Optional[Tensor] = None,
    scratch_locs: Optional[Tensor] = None,
    miss_src: Optional[Tensor] = None,
    miss_dst: Optional[Tensor] = None,
    miss_count: Optional[Tensor] = None,
    workspace: Optional[Tensor] = None,
    counters: Optional[Tensor] = None,
) -> None:
    kernels.swap_in_spec(
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


@torch.library.custom_op("kvplan::copy_planned", mutates_args=COPY_PLANNED_MUTATES)
def _copy_planned_op(
    miss_src: Tensor,
    miss_dst: Tensor,
    miss_count: Tensor,
    num_real_reqs: Optional[Tensor],
    host_cache: Tensor,
    device_buffer: Tensor,
    counters: Optional[Tensor] = None,
    counter_base: int = REPLAY_COPY_BASE,
) -> None:
    kernels.copy_planned(
        miss_src=miss_src,
        miss_dst=miss_dst,
        miss_count=miss_count,
        num_real_reqs=num_real_reqs,
        host_cache=host_cache,
        device_buffer=device_buffer,
        counters=counters,
        counter_base=counter_base,
    )


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
    check_positions: bool = False,
) -> None:
    kernels.materialize(
        kv,
        k_norm_weight,
        eps,
        cos_sin_cache,
        positions,
        num_kv_heads,
        head_dim,
        rotary_dim,
        k_out=k_out,
        v_out=v_out,
        check_positions=check_positions,
    )


# Fake implementations: the ops return nothing and only write arguments in place, so shape propagation has nothing
# to compute. (Argument errors surface when the real launch runs, exactly as in eager mode.)


@_swap_in_op.register_fake
def _swap_in_fake(*args, **kwargs) -> None:
    return None


@_swap_in_spec_op.register_fake
def _swap_in_spec_fake(*args, **kwargs) -> None:
    return None


@_copy_planned_op.register_fake
def _copy_planned_fake(*args, **kwargs) -> None:
    return None


@_materialize_op.register_fake
def _materialize_fake(*args, **kwargs) -> None:
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The keyword API of kvplan.kernels, through the ops. They call the OpOverload (torch.ops.kvplan.<name>.default):
# it traces to the same graph node as the decorated function and skips that wrapper's extra Python per eager call.


def swap_in(
    *,
    top_k_tokens: Tensor,
    device_buffer_tokens: Tensor,
    host_cache_locs: Tensor,
    device_buffer_locs: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    lru_slots: Tensor,
    num_real_reqs: Tensor | None = None,
    miss_src: Tensor | None = None,
    miss_dst: Tensor | None = None,
    miss_count: Tensor | None = None,
    workspace: Tensor | None = None,
    counters: Tensor | None = None,
) -> None:
    """:func:`kvplan.kernels.swap_in` through ``torch.ops.kvplan.swap_in`` (traceable by ``torch.compile``)."""
    torch.ops.kvplan.swap_in.default(
        top_k_tokens,
        device_buffer_tokens,
        host_cache_locs,
        device_buffer_locs,
        host_cache,
        device_buffer,
        top_k_device_locs,
        req_pool_indices,
        seq_lens,
        lru_slots,
        num_real_reqs,
        miss_src,
        miss_dst,
        miss_count,
        workspace,
        counters,
    )


def swap_in_spec(
    *,
    top_k_tokens: Tensor,
    device_buffer_tokens: Tensor,
    host_cache_locs: Tensor,
    device_buffer_locs: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    lru_slots: Tensor,
    num_real_reqs: Tensor | None = None,
    scratch_locs: Tensor | None = None,
    miss_src: Tensor | None = None,
    miss_dst: Tensor | None = None,
    miss_count: Tensor | None = None,
    workspace: Tensor | None = None,
    counters: Tensor | None = None,
) -> None:
    """:func:`kvplan.kernels.swap_in_spec` through ``torch.ops.kvplan.swap_in_spec``."""
    torch.ops.kvplan.swap_in_spec.default(
        top_k_tokens,
        device_buffer_tokens,
        host_cache_locs,
        device_buffer_locs,
        host_cache,
        device_buffer,
        top_k_device_locs,
        req_pool_indices,
        seq_lens,
        lru_slots,
        num_real_reqs,
        scratch_locs,
        miss_src,
        miss_dst,
        miss_count,
        workspace,
        counters,
    )


def copy_planned(
    *,
    miss_src: Tensor,
    miss_dst: Tensor,
    miss_count: Tensor,
    num_real_reqs: Tensor | None,
    host_cache: Tensor,
    device_buffer: Tensor,
    counters: Tensor | None = None,
    counter_base: int = REPLAY_COPY_BASE,
) -> None:
    """:func:`kvplan.kernels.copy_planned` through ``torch.ops.kvplan.copy_planned``."""
    torch.ops.kvplan.copy_planned.default(
        miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, counters, counter_base
    )


def materialize(
    kv: Tensor,
    k_norm_weight: Tensor,
    eps: Tensor,
    cos_sin_cache: Tensor,
    positions: Tensor,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    k_out: Tensor | None = None,
    v_out: Tensor | None = None,
    check_positions: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`kvplan.kernels.materialize` through ``torch.ops.kvplan.materialize``: returns ``(k_out, v_out)``,
    the given tensors or new ``[Lyr, T, H, D]`` ones (allocated here: the op itself only writes its outputs)."""
    if k_out is None or v_out is None:
        # validate before reading kv's shape, so a bad kv reports the spec's message, not an IndexError
        check_materialize(
            kv,
            k_norm_weight,
            eps,
            cos_sin_cache,
            positions,
            num_kv_heads,
            head_dim,
            rotary_dim,
            k_out=k_out,
            v_out=v_out,
        )
        shape = (kv.shape[1], kv.shape[0], num_kv_heads, head_dim)
        if k_out is None:
            k_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
        if v_out is None:
            v_out = torch.empty(shape, dtype=kv.dtype, device=kv.device)
    torch.ops.kvplan.materialize.default(
        kv,
        k_norm_weight,
        eps,
        cos_sin_cache,
        positions,
        num_kv_heads,
        head_dim,
        rotary_dim,
        k_out,
        v_out,
        check_positions,
    )
    return k_out, v_out
