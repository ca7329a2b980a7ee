"""SGLang-compatible entry points: change the import, keep the call.

Functions and a class with the public signatures (names, positional order, defaults, dtypes) of SGLang's HiSparse
host-to-device ops and of its DFlash fused-KV helper, computed by kvplan's kernels::

    # from sglang.jit_kernel.hisparse import copy_cache_planned_mla, load_cache_to_device_buffer_mla
    from kvplan.compat.sglang import copy_cache_planned_mla, load_cache_to_device_buffer_mla

- :func:`load_cache_to_device_buffer_mla`: the single-step swap-in. kvplan's single-step semantics are SGLang's
  (docs/kernels.md §2): same outputs, hot-buffer state, plan and device rows.
- :func:`copy_cache_planned_mla`: the plan replay for layers sharing the anchor's top-k (docs/kernels.md §4); it
  launches on the current stream, so the coordinator's side-stream replay works unchanged.
- :func:`load_blocks_to_device_buffer_mha`: SGLang 0.5.23's block-selection swap-in of MHA K and V caches (what
  its coordinator runs for MiniMax M3), by kvplan's ``swap_in_blocks`` (docs/kernels.md §2a): same outputs, state
  and device rows; kvplan also records the miss plan (:func:`last_miss_plan`).
- :func:`load_cache_to_device_buffer_spec_mla`: the speculative swap-in. kvplan's is a deterministic union-LRU with
  scratch rows, SGLang's a CLOCK commit over a cuckoo-hashed state: the call is the same, ``state`` is kvplan's
  :class:`SpecState` (``lru_slots`` + ``scratch_locs``), and results follow docs/kernels.md §3, not SGLang's.
- :class:`FusedKVMaterializeHelper`: DFlash's helper, backed by :class:`kvplan.FusedKVMaterializer`.

When the caller passes no plan buffers, the swap-ins record their plan in a :class:`kvplan.PlanBufferPool` this
module keeps per device and per thread (:func:`pool_for`; the plan of the thread's last call is
:func:`last_miss_plan`): threads calling at once never share a workspace or plan. Either way the
resolve workspace and the counters come from that pool, so the steady path allocates nothing and never synchronises.

Every launch takes kvplan's one route down, :mod:`kvplan.ops` (the pool's route too): through that pool's
``swap_in``/``swap_in_blocks`` when the pool holds the plan; through ``kvplan.ops`` itself, with the pool's workspace
and counters, when the caller's plan buffers do and for every plan copy (the ``_kv_*`` functions below); the DFlash
helper's :class:`kvplan.FusedKVMaterializer` through its own pool. Each call wraps the tables passed in a fresh
:class:`kvplan.HotBufferState` (a few microseconds: shapes, dtypes, strides and devices are checked, values never read):
nothing is cached, so the tensors passed are the ones written, and no table the caller freed is kept alive.

docs/sglang.md is the contract: the SGLang sources the signatures come from, the argument mapping, the differences and
the refusals.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from kvplan.state import HotBufferState
from kvplan.table_rules import not_tensor
from kvplan.validate.messages import PLAN_TOGETHER, device_key

if TYPE_CHECKING:
    from kvplan.plan import MissPlan
    from kvplan.pool import PlanBufferPool

__all__ = [
    "FusedKVMaterializeHelper",
    "SpecState",
    "copy_cache_planned_mla",
    "last_miss_plan",
    "load_blocks_to_device_buffer_mha",
    "load_cache_to_device_buffer_mla",
    "load_cache_to_device_buffer_spec_mla",
    "pool_for",
]

# =====================================================================================================================
# The launches: the per-thread, per-device pool, and the calls down kvplan.ops (directly or through that pool).
# =====================================================================================================================

# One pool per (device, thread): a call's launches write the pool's workspace (and, without plan buffers, its plan)
# and read them back in later launches, so two threads sharing one pool would overwrite each other's between launches
# (and, on the GPU, while the other thread's kernels run on its stream). Each thread's pools and last plans live in
# its thread-local slot and go with the thread.
_LOCAL = threading.local()


def _thread_slot() -> tuple[dict[tuple[str, int], PlanBufferPool], dict[tuple[str, int], MissPlan]]:
    """The calling thread's pools and last plans, by device key."""
    slot = getattr(_LOCAL, "slot", None)
    if slot is None:
        slot = _LOCAL.slot = ({}, {})
    return slot


def _kv_pool(device: torch.device) -> PlanBufferPool:
    key = device_key(device)
    pools = _thread_slot()[0]
    pool = pools.get(key)
    if pool is None:
        from kvplan.pool import PlanBufferPool

        index = None if key[1] < 0 else key[1]
        pool = pools[key] = PlanBufferPool(torch.device(key[0], index))
    return pool


def _kv_swap_in(
    speculative: bool,
    state: HotBufferState,
    top_k_tokens: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    plan_tensors: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """kvplan's swap-in (docs/kernels.md §2 or §3) with the per-device pool's workspace and counters; the pool's
    plan buffers when the caller gave none (that plan is then ``last_miss_plan``)."""
    from kvplan import ops
    from kvplan.plan import MissPlan

    pool = _kv_pool(top_k_tokens.device)
    batch, top_k = top_k_tokens.shape[0], top_k_tokens.shape[-1]
    steps = top_k_tokens.shape[1] if speculative else 1
    pool.ensure_capacity(batch=batch, num_steps=steps, top_k=top_k)
    data = (state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer)
    if all(t is None for t in plan_tensors):
        plan = pool.swap_in(*data, num_real_reqs=num_real_reqs, speculative=speculative, check_newest=False)
        _thread_slot()[1][device_key(top_k_tokens.device)] = plan
        return
    if any(t is None for t in plan_tensors):  # the validators' text (docs/kernels.md §6), bare as SGLang's
        raise ValueError(PLAN_TOGETHER)
    ops.swap_in(
        *data,
        num_real_reqs=num_real_reqs,
        plan=MissPlan(*plan_tensors),
        workspace=pool.workspace(batch, steps, top_k),
        counters=pool.counters,
        speculative=speculative,
        check_newest=False,  # SGLang's rule: the newest token at slot HOT whatever its token entry (docs/sglang.md)
        launch_records=pool._records(),  # relaunched as the pool's own calls are (its policy, its stats)
    )


def _kv_swap_in_blocks(
    state: HotBufferState,
    top_k_blocks: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sparse_block_size: int,
    num_real_reqs: torch.Tensor | None,
) -> None:
    """kvplan's block-selection swap-in (docs/kernels.md §2a) through the per-device pool: its plan becomes
    ``last_miss_plan`` (``kv_rows``: host K, host V, device K, device V)."""
    pool = _kv_pool(top_k_blocks.device)
    batch, tokens = top_k_blocks.shape[0], top_k_blocks.shape[1] * sparse_block_size
    pool.ensure_capacity(batch=batch, num_steps=1, top_k=tokens)
    plan = pool.swap_in_blocks(
        state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, *kv_rows,
        sparse_block_size=sparse_block_size, num_real_reqs=num_real_reqs,
        check_newest=False,  # SGLang's rule: the newest token at slot HOT whatever its token entry (docs/sglang.md)
    )  # fmt: skip
    _thread_slot()[1][device_key(top_k_blocks.device)] = plan


def _kv_copy_planned(
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    num_real_reqs: torch.Tensor | None,
    *,
    copy: bool = True,
) -> None:
    """kvplan's plan copy (docs/kernels.md §4) on the current stream, counted as replay in the pool's counters: one
    record (``kvplan.calls.CopyCall``) handed to ``kvplan.ops.run_copy``. ``copy=False`` runs the copy's checks only
    (SGLang's ``skip_io``) on the same record: the same refusals, nothing launched."""
    from kvplan import ops
    from kvplan.calls import CopyCall
    from kvplan.counters import REPLAY_COPY_BASE
    from kvplan.plan import MissPlan
    from kvplan.validate.arguments import check_copy

    for name, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if error := not_tensor(name, t):
            raise error
    pool = _kv_pool(miss_dst.device)
    call = CopyCall(MissPlan(miss_src, miss_dst, miss_count), host_cache, device_buffer, num_real_reqs, pool.counters,
                    REPLAY_COPY_BASE)  # fmt: skip
    if not copy:
        check_copy(call.plan, call.host_cache, call.device_buffer, num_real_reqs=call.num_real_reqs,
                   counters=call.counters, counter_base=call.counter_base)  # fmt: skip
        return
    # relaunched as the pool's own calls are (its policy, its stats)
    ops.run_copy(call, launch_records=pool._records())


def _kv_materializer(
    kv_weights: list[torch.Tensor],
    k_norm_weights: list[torch.Tensor],
    eps: list[float],
    cos_sin_cache: torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
) -> Any:
    """A :class:`kvplan.FusedKVMaterializer` with its own pool (it sizes it per call). Positions are checked by the
    adapter (SGLang's check) or promised by the caller's hint, so the materializer never checks them again on the
    host."""
    from kvplan.materializer import FusedKVMaterializer

    return FusedKVMaterializer(
        kv_weights,
        k_norm_weights,
        eps,
        cos_sin_cache,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        max_position_hint=int(cos_sin_cache.shape[0]),
    )


# =====================================================================================================================
# Public helpers
# =====================================================================================================================


def pool_for(device: torch.device | str | int) -> PlanBufferPool:
    """The :class:`kvplan.PlanBufferPool` the adapters use on ``device`` in the calling thread (created on first use;
    each thread has its own, so threads calling at once never share a workspace or a plan).

    Size it before CUDA-graph capture, in the thread that runs the steps (``pool_for(dev).reserve(batch=...,
    num_steps=..., top_k=...)``, then ``freeze()``): inside capture the adapters' ``ensure_capacity`` must not need to
    grow it. ``stats()`` reports the swap-in and replay counters of that thread's adapter calls on that device.
    """
    return _kv_pool(_as_device("pool_for", device))


def last_miss_plan(device: torch.device | str | int) -> MissPlan | None:
    """The plan the calling thread's last swap-in without plan buffers recorded on ``device`` (``.src``, ``.dst``,
    ``.count``), or ``None``. Step-scoped: the thread's next such call overwrites it; pass its tensors to
    :func:`copy_cache_planned_mla`."""
    return _thread_slot()[1].get(device_key(_as_device("last_miss_plan", device)))


def _as_device(owner: str, device: object) -> torch.device:
    """A CUDA index (an int) or anything :func:`kvplan.config.as_device` takes; its error names ``owner``."""
    from kvplan.config import as_device, as_int

    index = as_int(device)
    return torch.device("cuda", index) if index is not None else as_device(owner, device)


class SpecState(NamedTuple):
    """kvplan's speculative cache state, passed where SGLang passes its ``HiSparseSpecState``.

    ``lru_slots``: int16 ``[num_requests, hot_buffer_size]``, per request the hot slots least recently used first
    (the single-step path's table: both paths share one LRU state). ``scratch_locs``: int32
    ``[num_requests, capacity]`` device rows lent to misses that find no free hot slot (SGLang's
    ``HiSparseSpecState.scratch_locs`` has this layout and can be passed as is), or ``None``.
    """

    lru_slots: torch.Tensor
    scratch_locs: torch.Tensor | None = None


# =====================================================================================================================
# Argument mapping (SGLang's layouts -> kvplan's), no host synchronisation, no allocation
# =====================================================================================================================


def _rows(name: str, cache: torch.Tensor, item_size_bytes: int) -> torch.Tensor:
    """SGLang's KV buffer of one layer (``[rows, 1, dim]``, ``[rows, dim]``, ...) as kvplan's ``[rows, item]`` view;
    the row must be ``item_size_bytes`` long (SGLang copies rows of that size at that stride)."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() == 0:
        raise ValueError(f"{name} must be [rows, ...] (one row per token), got a 0-d tensor")
    rows = cache if cache.dim() == 2 else _flatten_rows(name, cache)
    row_bytes = rows.shape[1] * rows.element_size()
    if row_bytes != item_size_bytes:
        raise ValueError(
            f"{name} rows hold {row_bytes} bytes but item_size_bytes={item_size_bytes}: kvplan copies whole rows of "
            f"{name}, so each row of it must be exactly one item (shape {tuple(cache.shape)}, {cache.dtype})."
        )
    return rows


def _flatten_rows(name: str, cache: torch.Tensor) -> torch.Tensor:
    try:
        return cache.view(cache.shape[0], -1) if cache.dim() > 2 else cache.view(-1, 1)
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(cache.shape)} and strides {cache.stride()} cannot be viewed as [rows, item] "
            "without a copy: each token's row must be contiguous (SGLang's layer_first KV buffers are)."
        ) from None


def _positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1 (NumPy integers too); ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if type(value) is int and value >= 1:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _flag(name: str, value: object) -> bool:
    """``value`` as a bool (a NumPy bool too); ``TypeError`` naming ``name`` otherwise (``"no"`` is not false)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _single_step_tables(
    top_k_tokens: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    lru_slots: torch.Tensor,
    num_top_k: int,
    hot_buffer_size: int,
    page_size: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's compile-time sizes checked against the tensors kvplan reads them from; the top-k views."""
    num_top_k = _positive_int("num_top_k", num_top_k)
    hot_buffer_size = _positive_int("hot_buffer_size", hot_buffer_size)
    _positive_int("block_size", block_size)
    if hot_buffer_size < num_top_k:  # SGLang asserts this, with this text
        raise AssertionError(f"hot_buffer_size ({hot_buffer_size}) must be >= num_top_k ({num_top_k})")
    if _positive_int("page_size", page_size) != 1:
        raise ValueError(
            f"page_size={page_size} is not supported: kvplan's swap-in works on token rows (page_size=1, what "
            "SGLang's HiSparseCoordinator passes); a paged host/device layout has no kvplan equivalent."
        )
    for name, t in (("top_k_tokens", top_k_tokens), ("top_k_device_locs", top_k_device_locs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] < num_top_k:
            raise ValueError(f"{name} must have shape [batch, >= num_top_k={num_top_k}], got {tuple(t.shape)}")
    if not isinstance(lru_slots, torch.Tensor):
        raise TypeError(f"lru_slots must be a torch.Tensor, got {type(lru_slots).__name__}")
    if lru_slots.dim() != 2 or lru_slots.shape[1] != hot_buffer_size:
        raise ValueError(
            f"lru_slots must have shape [num_requests, hot_buffer_size={hot_buffer_size}], got "
            f"{tuple(lru_slots.shape)}: kvplan reads the hot-buffer size from lru_slots."
        )
    if top_k_tokens.shape[1] != num_top_k:
        top_k_tokens = top_k_tokens[:, :num_top_k]
    if top_k_device_locs.shape[1] != num_top_k:
        top_k_device_locs = top_k_device_locs[:, :num_top_k]
    return top_k_tokens, top_k_device_locs


# =====================================================================================================================
# HiSparse ops
# =====================================================================================================================


def load_cache_to_device_buffer_mla(
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
    item_size_bytes: int,
    num_top_k: int,
    hot_buffer_size: int,
    page_size: int = 1,
    block_size: int = 256,
    num_real_reqs: torch.Tensor | None = None,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    skip_io: bool = False,
) -> None:
    """SGLang's single-step HiSparse swap-in (MLA, linear host and device rows), by kvplan's ``swap_in``.

    Resolves ``top_k_tokens[:, :num_top_k]`` into ``top_k_device_locs``, updates ``device_buffer_tokens`` and
    ``lru_slots`` in place and copies the missing rows, exactly as docs/kernels.md §2 (SGLang's semantics). With
    ``miss_src``/``miss_dst``/``miss_count`` it records the plan there, for :func:`copy_cache_planned_mla`; without
    them the plan goes to the per-device pool (:func:`last_miss_plan`). ``skip_io=True`` does everything except move
    the KV bytes (SGLang's timing probe). ``block_size`` is SGLang's CUDA block size: accepted, not used.
    """
    skip_io = _flag("skip_io", skip_io)
    item_size_bytes = _positive_int("item_size_bytes", item_size_bytes)
    top_k_tokens, top_k_device_locs = _single_step_tables(
        top_k_tokens, top_k_device_locs, lru_slots, num_top_k, hot_buffer_size, page_size, block_size
    )
    host_rows = _rows("host_cache", host_cache, item_size_bytes)
    device_rows = _rows("device_buffer", device_buffer, item_size_bytes)
    if skip_io:  # every copy is then out of range (docs/kernels.md §2 rule 4): planned and recorded, not moved
        host_rows, device_rows = host_rows[:0], device_rows[:0]
    state = HotBufferState(device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs)
    _kv_swap_in(
        False, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_rows, device_rows,
        num_real_reqs, (miss_src, miss_dst, miss_count),
    )  # fmt: skip


def copy_cache_planned_mla(
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    item_size_bytes: int,
    num_blocks: int = 4,
    block_size: int = 1024,
    is_dsv4_layout: bool = False,
    skip_io: bool = False,
) -> None:
    """SGLang's plan replay: copy host row ``miss_src[r, m]`` to device row ``miss_dst[r, m]`` for real rows ``r``
    and ``m < miss_count[r]``, by kvplan's ``copy_planned`` (docs/kernels.md §4), on the current stream.

    ``num_blocks``/``block_size`` are SGLang's grid and block sizes: accepted, not used (kvplan sizes its own grid).
    ``skip_io=True`` checks everything a real call checks, then copies nothing (SGLang's probe elides the KV bytes,
    which is all this op moves). ``is_dsv4_layout=True`` is refused: kvplan has no page-padded DeepSeek-V4 layout.
    """
    skip_io = _flag("skip_io", skip_io)
    if _flag("is_dsv4_layout", is_dsv4_layout):
        raise NotImplementedError(
            "copy_cache_planned_mla(is_dsv4_layout=True) is not supported: kvplan copies linear rows of "
            "item_size_bytes; DeepSeek-V4's page-padded C4 layout has no kvplan equivalent. Keep SGLang's op for it."
        )
    _positive_int("num_blocks", num_blocks)
    _positive_int("block_size", block_size)
    item_size_bytes = _positive_int("item_size_bytes", item_size_bytes)
    host_rows = _rows("host_cache", host_cache, item_size_bytes)
    device_rows = _rows("device_buffer", device_buffer, item_size_bytes)
    _kv_copy_planned(miss_src, miss_dst, miss_count, host_rows, device_rows, num_real_reqs, copy=not skip_io)


def load_blocks_to_device_buffer_mha(
    top_k_blocks: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache_k: torch.Tensor,
    host_cache_v: torch.Tensor,
    device_buffer_k: torch.Tensor,
    device_buffer_v: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    item_size_bytes: int,
    hot_buffer_size: int,
    sparse_block_size: int,
    page_size: int = 1,
    block_size: int = 256,
    num_real_reqs: torch.Tensor | None = None,
    skip_io: bool = False,
) -> None:
    """SGLang 0.5.23's block-selection MHA swap-in (MiniMax M3's ``swap_in_selected_blocks``), by kvplan's
    ``swap_in_blocks`` (docs/kernels.md §2a).

    ``top_k_blocks`` int32 ``[batch, num_blocks]`` names blocks of ``sparse_block_size`` tokens (``-1``: none); the
    token-slot table of the ``num_blocks * sparse_block_size`` selected tokens goes to the first columns of
    ``top_k_device_locs`` ``[>= batch, >= num_blocks * sparse_block_size]`` (padding rows ``-1``), the hot-buffer
    state is updated in place, and each miss copies its K row and its V row. kvplan records the miss plan too, in the
    per-device pool (:func:`last_miss_plan`; ``pool_for(device).replay(plan, host_cache=..., device_buffer=...,
    host_cache_v=..., device_buffer_v=...)`` copies it into another layer's caches). ``skip_io=True`` does everything
    except move the KV bytes. ``block_size`` is SGLang's CUDA block size: accepted, not used. Refused as SGLang
    refuses, with its texts (as ``ValueError``): ``hot_buffer_size`` below the selected tokens, and K/V host rows
    whose stride is not ``item_size_bytes``.
    """
    skip_io = _flag("skip_io", skip_io)
    item_size_bytes = _positive_int("item_size_bytes", item_size_bytes)
    hot_buffer_size = _positive_int("hot_buffer_size", hot_buffer_size)
    sparse_block_size = _positive_int("sparse_block_size", sparse_block_size)
    _positive_int("block_size", block_size)
    for name, t in (("top_k_blocks", top_k_blocks), ("top_k_device_locs", top_k_device_locs),
                    ("host_cache_k", host_cache_k), ("host_cache_v", host_cache_v)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if top_k_blocks.dim() != 2:
        raise ValueError(f"top_k_blocks must have shape [batch, num_blocks], got {tuple(top_k_blocks.shape)}")
    batch, tokens = top_k_blocks.shape[0], top_k_blocks.shape[1] * sparse_block_size
    if hot_buffer_size < tokens:  # SGLang asserts this, with this text
        raise ValueError(f"hot_buffer_size ({hot_buffer_size}) must be >= selected tokens ({tokens})")
    if top_k_device_locs.dim() != 2 or top_k_device_locs.shape[0] < batch or top_k_device_locs.shape[1] < tokens:
        raise ValueError(
            f"top_k_device_locs must have shape [>= batch={batch}, >= num_blocks * sparse_block_size={tokens}], got "
            f"{tuple(top_k_device_locs.shape)}"
        )
    k_stride = host_cache_k.stride(0) * host_cache_k.element_size() if host_cache_k.dim() else 0
    v_stride = host_cache_v.stride(0) * host_cache_v.element_size() if host_cache_v.dim() else 0
    if not k_stride == v_stride == item_size_bytes:  # SGLang asserts this, with this text
        raise ValueError(
            "K/V token strides must equal item_size_bytes: "
            f"k_stride={k_stride}, v_stride={v_stride}, item_size_bytes={item_size_bytes}"
        )
    if _positive_int("page_size", page_size) != 1:
        raise ValueError(
            f"page_size={page_size} is not supported: kvplan's swap-in works on token rows (page_size=1, what "
            "SGLang's HiSparseCoordinator passes); a paged host/device layout has no kvplan equivalent."
        )
    if not isinstance(lru_slots, torch.Tensor):
        raise TypeError(f"lru_slots must be a torch.Tensor, got {type(lru_slots).__name__}")
    if lru_slots.dim() != 2 or lru_slots.shape[1] != hot_buffer_size:
        raise ValueError(
            f"lru_slots must have shape [num_requests, hot_buffer_size={hot_buffer_size}], got "
            f"{tuple(lru_slots.shape)}: kvplan reads the hot-buffer size from lru_slots."
        )
    rows = [_rows(name, t, item_size_bytes) for name, t in (
        ("host_cache_k", host_cache_k), ("host_cache_v", host_cache_v), ("device_buffer_k", device_buffer_k),
        ("device_buffer_v", device_buffer_v))]  # fmt: skip
    if skip_io:  # every copy is then out of range (docs/kernels.md §2 rule 4): planned and recorded, not moved
        rows = [t[:0] for t in rows]
    out = top_k_device_locs
    if tuple(out.shape) != (batch, tokens):
        out = out[:batch, :tokens]
    state = HotBufferState(device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs)
    _kv_swap_in_blocks(state, top_k_blocks, out, req_pool_indices, seq_lens, tuple(rows), sparse_block_size,
                       num_real_reqs)  # fmt: skip


SPEC_STEPS = (2, 4)  # SGLang's speculative kernel is instantiated for 2 to 4 steps
SPEC_ROW_ALIGN = 16  # and moves rows in 16-byte units


def load_cache_to_device_buffer_spec_mla(
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
    state: SpecState,
    num_real_reqs: torch.Tensor,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
) -> None:
    """SGLang's speculative HiSparse swap-in call, computed by kvplan's speculative ``swap_in`` (docs/kernels.md §3).

    ``top_k_tokens``/``top_k_device_locs`` ``[batch, steps, top_k]``, ``seq_lens`` ``[batch * steps]`` batch-major,
    as SGLang. ``state`` is a :class:`SpecState` (kvplan's LRU + scratch), not SGLang's CLOCK state. Refused as
    SGLang refuses: ``steps`` outside 2-4 and rows whose size (``host_cache.stride(0) * element_size``) is not a
    multiple of 16 bytes. The results are kvplan's deterministic union-LRU, not SGLang's CLOCK commit: see
    docs/sglang.md §4.
    """
    if not isinstance(top_k_tokens, torch.Tensor):
        raise TypeError(f"top_k_tokens must be a torch.Tensor, got {type(top_k_tokens).__name__}")
    if top_k_tokens.dim() != 3:
        raise ValueError("speculative top_k_tokens must have shape [batch, steps, top_k].")
    num_steps = top_k_tokens.shape[1]
    if not SPEC_STEPS[0] <= num_steps <= SPEC_STEPS[1]:  # SGLang's check and text
        raise ValueError(f"HiSparse speculative swap requires 2-4 steps, got {num_steps}.")
    lru_slots, scratch_locs = _spec_state(state)
    if not isinstance(host_cache, torch.Tensor):
        raise TypeError(f"host_cache must be a torch.Tensor, got {type(host_cache).__name__}")
    item_size_bytes = host_cache.stride(0) * host_cache.element_size() if host_cache.dim() else 0
    if item_size_bytes <= 0 or item_size_bytes % SPEC_ROW_ALIGN:
        raise ValueError(
            f"HiSparse speculative swap requires rows whose size is a positive multiple of {SPEC_ROW_ALIGN} bytes, "
            f"got {item_size_bytes} (host_cache.stride(0) * element_size): SGLang's speculative kernel moves "
            "16-byte units and kvplan keeps its contract. kvplan.kernels.swap_in copies rows of any size."
        )
    if num_real_reqs is None:
        raise TypeError("num_real_reqs is required: an int32 [1] tensor on the kernel's device (as in SGLang)")
    host_rows = _rows("host_cache", host_cache, item_size_bytes)
    device_rows = _rows("device_buffer", device_buffer, item_size_bytes)
    state = HotBufferState(device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs, scratch_locs)
    _kv_swap_in(
        True, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_rows, device_rows,
        num_real_reqs, (miss_src, miss_dst, miss_count),
    )  # fmt: skip


def _spec_state(state: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    lru_slots = getattr(state, "lru_slots", None)
    if lru_slots is None:
        if hasattr(state, "cache_policy") or hasattr(state, "cache_index"):
            raise ValueError(
                "state is SGLang's HiSparseSpecState (CLOCK cache_policy + cuckoo cache_index): kvplan's speculative "
                "swap-in is a deterministic union-LRU and cannot read that state. Pass "
                "kvplan.compat.sglang.SpecState(lru_slots, scratch_locs): lru_slots int16 [num_requests, "
                "hot_buffer_size] (the single-step table), scratch_locs = your HiSparseSpecState.scratch_locs."
            )
        raise TypeError(
            "state must be a kvplan.compat.sglang.SpecState(lru_slots, scratch_locs), got " + type(state).__name__
        )
    return lru_slots, getattr(state, "scratch_locs", None)


# =====================================================================================================================
# DFlash fused KV materialization
# =====================================================================================================================


class FusedKVMaterializeHelper:
    """SGLang DFlash's fused KV helper: the layers' KV projections in one GEMM, then one fused RMSNorm + RoPE kernel
    for all layers (kvplan's :class:`~kvplan.FusedKVMaterializer`), then ``write_layer_kv`` per layer.

    ``layers[i].self_attn`` provides ``qkv_proj.weight`` (the KV rows ``[q_size, q_size + 2 * kv_size)``),
    ``k_norm.weight``, ``k_norm.variance_epsilon``, ``num_kv_heads``, ``head_dim`` and ``rotary_emb``, as in SGLang.
    ``max_position_hint``: positions stay below it, so :meth:`materialize` reads nothing back from the device (no
    ``positions.max()`` synchronisation; out-of-range positions are clamped into the cache, never read past it); it
    must fit the RoPE cache (grown through ``_ensure_cos_sin_cache_length`` when the rotary embedding has it).
    ``check_positions=True`` checks positions against the hint anyway (one synchronisation per call; not under
    CUDA-graph capture). Without a hint every call checks positions against the RoPE cache as SGLang does, and
    refuses negative ones in the same read.
    """

    def __init__(
        self,
        layers: list,
        rotary_emb,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        max_position_hint: Optional[int] = None,
        *,
        check_positions: bool = False,
    ):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rotary_emb = rotary_emb
        self.n_layers = len(layers)
        self.device = _as_device("FusedKVMaterializeHelper", device)
        self.rotary_dim = int(getattr(rotary_emb, "rotary_dim", head_dim))
        self.is_neox_style = bool(getattr(rotary_emb, "is_neox_style", True))
        if not self.is_neox_style:
            raise NotImplementedError("Only neox-style RoPE is supported.")
        if self.rotary_dim <= 0 or self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"Invalid fused KV rotary/head dim pair: rotary_dim={self.rotary_dim}, head_dim={self.head_dim}."
            )
        if max_position_hint is not None:
            max_position_hint = _positive_int("max_position_hint", max_position_hint)
        self.max_position_hint = max_position_hint
        self.check_positions = _flag("check_positions", check_positions)

        kv_weights, self.k_norm_weights, self.eps_values = [], [], []
        for layer_id, layer in enumerate(layers):
            attn = layer.self_attn
            if int(attn.num_kv_heads) != self.num_kv_heads:
                raise ValueError(
                    "num_kv_heads mismatch across layers for fused KV path: "
                    f"expected {self.num_kv_heads}, got {int(attn.num_kv_heads)} at layer {layer_id}."
                )
            if int(attn.head_dim) != self.head_dim:
                raise ValueError(
                    "head_dim mismatch across layers for fused KV path: "
                    f"expected {self.head_dim}, got {int(attn.head_dim)} at layer {layer_id}."
                )
            layer_rotary_dim = int(getattr(attn.rotary_emb, "rotary_dim", self.head_dim))
            layer_is_neox = bool(getattr(attn.rotary_emb, "is_neox_style", True))
            if layer_rotary_dim != self.rotary_dim or layer_is_neox != self.is_neox_style:
                raise ValueError(
                    "RoPE config mismatch across layers for fused KV path: "
                    f"expected (rotary_dim={self.rotary_dim}, neox={self.is_neox_style}), "
                    f"got (rotary_dim={layer_rotary_dim}, neox={layer_is_neox}) at layer {layer_id}."
                )
            q_size, kv_size = int(attn.q_size), int(attn.kv_size)
            kv_weights.append(attn.qkv_proj.weight[q_size : q_size + 2 * kv_size])
            self.k_norm_weights.append(attn.k_norm.weight)
            self.eps_values.append(float(attn.k_norm.variance_epsilon))
        self._kv_weights = kv_weights  # views of the layers' weights, kept to rebuild when the RoPE cache grows
        self._source_cache: torch.Tensor | None = None
        self._materializer: Any = None
        if max_position_hint is not None:
            self._ensure_cache(max_position_hint - 1)
        self._refresh(self.rotary_emb.cos_sin_cache)

    def _ensure_cache(self, max_position: int) -> None:
        ensure = getattr(self.rotary_emb, "_ensure_cos_sin_cache_length", None)
        if callable(ensure):
            ensure(max_position)

    def _refresh(self, cos_sin_cache: torch.Tensor) -> None:
        """(Re)build the kvplan materializer when the RoPE cache object changed (it grew); a no-op otherwise. The
        constructor's hint must fit the new cache (refused before anything changes)."""
        if cos_sin_cache is self._source_cache:
            return
        if self.max_position_hint is not None:
            _hint_fits(self.max_position_hint, cos_sin_cache)
        on_device = cos_sin_cache if cos_sin_cache.device == self.device else cos_sin_cache.to(self.device)
        self._materializer = _kv_materializer(
            self._kv_weights,
            self.k_norm_weights,
            self.eps_values,
            on_device,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rotary_dim=self.rotary_dim,
        )
        self._source_cache = cos_sin_cache

    def materialize(
        self,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        write_layer_kv: Callable[[int, torch.Tensor, torch.Tensor], None],
        *,
        max_position_hint: Optional[int] = None,
    ) -> None:
        """Materialize KV for every layer and hand each layer's ``[T, H, D]`` K and V to ``write_layer_kv``.

        Returns at once for an empty context. The K/V handed over are views of kvplan's slabs, valid until the next
        call: ``write_layer_kv`` copies them into the KV pool (SGLang's ``set_kv_buffer`` does). ``max_position_hint``
        (keyword, as a DFlash worker revision passes it) promises positions below it for this call: no host check
        unless the helper was built with ``check_positions=True``.
        """
        total_ctx = ctx_hidden.shape[0]
        if total_ctx == 0:
            return
        if positions.ndim != 1:
            positions = positions.reshape(-1)
        if positions.numel() != total_ctx:
            raise ValueError(
                "positions must match ctx_hidden token count for fused KV materialization: "
                f"positions={positions.numel()}, total_ctx={total_ctx}."
            )
        hint = self.max_position_hint  # checked against the cache when the cache changes (_refresh)
        if max_position_hint is not None:
            hint = _positive_int("max_position_hint", max_position_hint)
            self._ensure_cache(hint - 1)
            _hint_fits(hint, self.rotary_emb.cos_sin_cache)
        elif hint is None:  # SGLang's check (one host synchronisation), negative positions refused in the same read
            low, max_position = (int(v) for v in torch.stack(torch.aminmax(positions)).tolist())
            self._ensure_cache(max_position)
            cache_len = int(self.rotary_emb.cos_sin_cache.shape[0])
            if max_position >= cache_len:
                raise RuntimeError(
                    "RoPE cos/sin cache is too short for fused KV materialization: "
                    f"max_position={max_position}, cache_len={cache_len}."
                )
            if low < 0:
                _positions_out_of_range(positions, cache_len, "the RoPE cos/sin cache rows")
        self._refresh(self.rotary_emb.cos_sin_cache)
        if hint is not None and self.check_positions:
            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "check_positions=True reads positions on the host, which CUDA-graph capture forbids: "
                    "build the helper used inside capture without it."
                )
            _positions_out_of_range(positions, hint, "max_position_hint")
        self._materializer.materialize(ctx_hidden, positions, write_layer_kv)


def _hint_fits(hint: int, cos_sin_cache: torch.Tensor) -> None:
    rows = int(cos_sin_cache.shape[0])
    if hint > rows:
        raise ValueError(
            f"max_position_hint must be <= {rows} (the RoPE cos/sin cache rows), got {hint}: positions past the "
            "cache would be clamped, not rotated. Grow the rotary embedding's cache (SGLang's grows through "
            "_ensure_cos_sin_cache_length) or lower the hint."
        )


def _positions_out_of_range(positions: torch.Tensor, bound: int, source: str) -> None:
    """``ValueError`` naming the positions outside ``[0, bound)``; reads them on the host (a synchronisation)."""
    pos = positions.reshape(-1).to(torch.int64)
    bad = ((pos < 0) | (pos >= bound)).nonzero().flatten()
    if bad.numel() == 0:
        return
    shown = bad[:8].tolist()
    more = f" (and {bad.numel() - len(shown)} more)" if bad.numel() > len(shown) else ""
    raise ValueError(
        f"positions out of range: expected 0 <= position < {bound} ({source}), got positions "
        f"{pos[bad[:8]].tolist()} at token indices {shown}{more}."
    )
