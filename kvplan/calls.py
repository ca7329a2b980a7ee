"""One kernel call's arguments as one record: what every entry point of a kernel (kernels, ops, pool, adapter; the
reference for the swap-in) builds from its arguments once, and hands on whole to the checks and the launch:
:class:`SwapInCall` (the swap-in, from the hot-buffer state and the per-call tensors), :class:`CopyCall` (the plan
copy) and :class:`MaterializeCall` (the fused KV materialize).

``NamedTuple``s rather than attrs classes on purpose: one is built on every eager launch (a tuple costs a fraction
of a microsecond). The plan travels whole, as the ``MissPlan`` it is; only the custom ops' flat schemas
(``kvplan.ops``) lay it out as its three tensors (:meth:`SwapInCall.flat`, :meth:`CopyCall.flat`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvplan.counters import REPLAY_COPY_BASE
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState

__all__ = [
    "CopyCall",
    "MaterializeCall",
    "SwapInCall",
    "check_newest_error",
    "refuse_stale_tails",
    "swap_in_blocks_call",
    "swap_in_call",
]


class SwapInCall(NamedTuple):
    """A swap-in: the state tables (``scratch_locs`` only on the speculative path), the per-call tensors, and the
    plan, workspace and counters it writes (``None`` when not given).

    The block-selection front end (docs/kernels.md §2a) sets the last three fields: ``sparse_block_size`` (``None``:
    ``top_k_tokens`` holds token ids; an int: it holds block ids ``[B, NB]``, each naming that many consecutive tokens,
    and ``top_k_device_locs`` is ``[B, NB * sparse_block_size]``), and the V rows copied beside ``host_cache`` /
    ``device_buffer`` (the K rows) for each miss."""

    speculative: bool
    device_buffer_tokens: Tensor
    device_buffer_locs: Tensor
    lru_slots: Tensor
    host_cache_locs: Tensor
    scratch_locs: Tensor | None
    top_k_tokens: Tensor
    top_k_device_locs: Tensor
    req_pool_indices: Tensor
    seq_lens: Tensor
    host_cache: Tensor
    device_buffer: Tensor
    num_real_reqs: Tensor | None
    plan: MissPlan | None
    workspace: Tensor | None
    counters: Tensor | None
    # single-step: the newest token resolves to slot HOT unless it names another token (then -1); False is
    # SGLang's rule, slot HOT whatever it holds (the adapters': docs/kernels.md §2)
    check_newest: bool = True
    sparse_block_size: int | None = None
    host_cache_v: Tensor | None = None
    device_buffer_v: Tensor | None = None

    def flat(self) -> tuple:
        """The fields up to ``check_newest`` in order with the plan as its three tensors (``None`` each without one):
        the ``kvplan::swap_in`` custom op's schema (the block front end's fields follow in :meth:`flat_blocks`)."""
        plan = self.plan
        tensors = (None, None, None) if plan is None else (plan.src, plan.dst, plan.count)
        return (*self[:_PLAN], *tensors, *self[_PLAN + 1 : _BLOCKS])

    def flat_blocks(self) -> tuple:
        """:meth:`flat`, then ``sparse_block_size``, ``host_cache_v``, ``device_buffer_v``: the
        ``kvplan::swap_in_blocks`` custom op's schema, and the launch record's key (keying the tensors inline, not the
        record field by field)."""
        return (*self.flat(), *self[_BLOCKS:])

    def flat_dict(self) -> dict:
        """:meth:`flat` by name (the plan's tensors as ``miss_src``, ``miss_dst``, ``miss_count``): the
        ``kvplan::swap_in`` op's keyword arguments."""
        return dict(zip(FLAT_FIELDS, self.flat()))

    def flat_blocks_dict(self) -> dict:
        """:meth:`flat_blocks` by name: what the checks name in their messages, and the ``kvplan::swap_in_blocks``
        op's keyword arguments."""
        return dict(zip(BLOCK_FLAT_FIELDS, self.flat_blocks()))


def swap_in_call(
    speculative: bool | None,
    state: HotBufferState,
    top_k_tokens: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    host_cache: Tensor,
    device_buffer: Tensor,
    num_real_reqs: Tensor | None,
    plan: MissPlan | None,
    workspace: Tensor | None = None,
    counters: Tensor | None = None,
    check_newest: bool = True,
) -> SwapInCall:
    """The record of one call; ``TypeError`` naming ``state`` or ``plan`` when they are not kvplan's records.
    ``speculative=None`` takes the path from ``top_k_tokens``' rank (``[B, S, K]`` speculative); an explicit flag is
    kept, so the checks refuse a tensor of the other rank with the engines' message. The single-step path never
    touches scratch rows, so a state's ``scratch_locs`` goes only into a speculative call."""
    if speculative is None:
        speculative = getattr(top_k_tokens, "ndim", 0) == 3
    elif type(speculative) is not bool:  # ("False" is truthy: it would run the speculative path)
        raise TypeError(f"speculative must be a bool or None, got {type(speculative).__name__} {speculative!r}.")
    if type(state) is not HotBufferState and not isinstance(state, HotBufferState):
        raise TypeError(
            f"state must be a kvplan.HotBufferState (the engine's hot-buffer tables), got {type(state).__name__}."
        )
    if error := check_newest_error(check_newest):
        raise error
    if plan is not None and not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a kvplan.MissPlan or None, got {type(plan).__name__}.")
    return SwapInCall(
        speculative=speculative,
        device_buffer_tokens=state.device_buffer_tokens,
        device_buffer_locs=state.device_buffer_locs,
        lru_slots=state.lru_slots,
        host_cache_locs=state.host_cache_locs,
        scratch_locs=state.scratch_locs if speculative else None,
        top_k_tokens=top_k_tokens,
        top_k_device_locs=top_k_device_locs,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        host_cache=host_cache,
        device_buffer=device_buffer,
        num_real_reqs=num_real_reqs,
        plan=plan,
        workspace=workspace,
        counters=counters,
        check_newest=check_newest,
    )


def check_newest_error(check_newest: object) -> TypeError | None:
    """The ``check_newest`` field's rule, run where a record is built (:func:`swap_in_call`) and where one built field
    by field is checked (``kvplan.validate.arguments.check_swap_in``): a bool (``"False"`` is truthy)."""
    if type(check_newest) is bool:
        return None
    return TypeError(f"check_newest must be a bool, got {type(check_newest).__name__} {check_newest!r}.")


def refuse_stale_tails(state: object, call: str) -> None:
    """The stale-tail rule of a swap-in's public face, declared once: ``StateCheckError`` naming ``call`` when the
    state's host records know a request's tail to be stale (``state.append`` backed a newer token than the newest one
    ``state.write_tail`` put at slot ``HOT``); nothing while dynamo traces. Reads host records only (no device access);
    anything but a state passes, for the record's builder to refuse."""
    records = getattr(state, "lifecycle", None)
    if records is not None and records.stale and not torch.compiler.is_compiling():
        state.check_tails(call)


def swap_in_blocks_call(
    state: HotBufferState,
    top_k_blocks: Tensor,
    top_k_device_locs: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    host_cache_k: Tensor,
    host_cache_v: Tensor,
    device_buffer_k: Tensor,
    device_buffer_v: Tensor,
    sparse_block_size: int,
    num_real_reqs: Tensor | None,
    plan: MissPlan | None,
    workspace: Tensor | None = None,
    counters: Tensor | None = None,
    check_newest: bool = True,
) -> SwapInCall:
    """The record of one block-selection call (docs/kernels.md §2a): a single-step call whose ``top_k_tokens`` field
    holds the block ids and whose K rows travel in ``host_cache``/``device_buffer``, the V rows beside them. The
    checks (``kvplan.validate.arguments.check_swap_in``) refuse a ``sparse_block_size`` that is not an int >= 1.
    ``check_newest`` as for :func:`swap_in_call` (``False``: SGLang's rule, the adapter's)."""
    if sparse_block_size is None:  # (the record's None means token ids: refused here, the rest by the checks)
        raise TypeError("sparse_block_size must be an int >= 1 (tokens per selected block), got NoneType None.")
    call = swap_in_call(
        False, state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, device_buffer_k,
        num_real_reqs, plan, workspace, counters, check_newest,
    )  # fmt: skip
    blocks = dict(sparse_block_size=sparse_block_size, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v)
    return call._replace(**blocks)


class CopyCall(NamedTuple):
    """A plan copy (docs/kernels.md §4): host row ``plan.src[r, m]`` to device row ``plan.dst[r, m]`` for the real rows
    ``r`` and ``m < plan.count[r]``, adding (rows, bytes) to ``counters`` at ``counter_base`` (the replays' counters
    unless the swap-in's own copy), reading the swap-in ``workspace``'s record of shared host rows when given, and with
    ``host_cache_v``/``device_buffer_v`` (both or neither) the V rows beside the K rows in one pass. The fields are
    the checks' (``kvplan.validate.arguments.check_copy``); the custom ops' schemas are :meth:`flat` and
    :meth:`flat_kv`."""

    plan: MissPlan
    host_cache: Tensor
    device_buffer: Tensor
    num_real_reqs: Tensor | None = None
    counters: Tensor | None = None
    counter_base: int = REPLAY_COPY_BASE
    workspace: Tensor | None = None
    host_cache_v: Tensor | None = None
    device_buffer_v: Tensor | None = None

    def flat(self) -> tuple:
        """The plan as its three tensors, then the fields up to ``workspace`` in order: the ``kvplan::copy_planned``
        custom op's schema (K rows only). The plan must be a ``MissPlan``."""
        plan = self.plan
        return (plan.src, plan.dst, plan.count, *self[1:_COPY_V])

    def flat_kv(self) -> tuple:
        """The ``kvplan::copy_planned_kv`` custom op's schema: the plan's three tensors, the K rows, the V rows, then
        ``num_real_reqs``, ``counters``, ``counter_base``, ``workspace``."""
        plan = self.plan
        return (plan.src, plan.dst, plan.count, self.host_cache, self.device_buffer, *self[_COPY_V:], *self[3:_COPY_V])


class MaterializeCall(NamedTuple):
    """A fused KV materialize (docs/kernels.md §5): ``kv [T, Lyr, 2*H*D]`` normalized and rotated (K) and copied (V)
    into ``k_out``/``v_out`` ``[Lyr, T, H, D]`` (``None``: allocated by the launch). Its fields in order are the
    ``kvplan::materialize`` custom op's schema (the op takes both outputs: the traced route allocates missing ones
    first)."""

    kv: Tensor
    k_norm_weight: Tensor
    eps: Tensor
    cos_sin_cache: Tensor
    positions: Tensor
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    k_out: Tensor | None = None
    v_out: Tensor | None = None
    check_positions: bool = False


_COPY_V = CopyCall._fields.index("host_cache_v")
_PLAN = SwapInCall._fields.index("plan")
_BLOCKS = SwapInCall._fields.index("sparse_block_size")
FLAT_FIELDS = (
    *SwapInCall._fields[:_PLAN], "miss_src", "miss_dst", "miss_count", *SwapInCall._fields[_PLAN + 1 : _BLOCKS]
)  # fmt: skip
BLOCK_FLAT_FIELDS = (*FLAT_FIELDS, *SwapInCall._fields[_BLOCKS:])
