"""kvplan's kernels as ``torch.library`` custom ops (namespace ``kvplan``), so compiled engine steps do not break.

A raw Triton launch with Python-side checks in the middle of a ``torch.compile``d step is a graph break (or a
recompile per shape). Registered as custom ops, the kernels are opaque nodes with a declared schema: dynamo records
them without tracing their Python, fake tensors propagate shapes through them, and functionalization knows exactly
which arguments each one writes. The real implementation is the plain launch in ``kvplan.kernels`` (checks
included), so a compiled step and an eager one run the same code on the device.

A ``launch_records`` given to a function here (a pool's ``LaunchCache``) records its eager launches for relaunch under
its policy; without one, and in the ops while dynamo traces (a schema holds no records object), every call is checked
and launched, nothing recorded (inside a captured CUDA graph that costs nothing on replay).

The functions here are the one route from the pool, the materializer (through its pool) and the SGLang adapter down
to the kernels. Each call is one record of ``kvplan.calls`` (``SwapInCall``, ``CopyCall``, ``MaterializeCall``),
built once by whoever makes the call and handed whole to :func:`run_swap_in`, :func:`run_copy` or
:func:`run_materialize`: eagerly they launch it with the kernels' launch of the record (``kvplan.kernels``' code
without the dispatcher's round trip); while dynamo traces (``torch.compiler.is_compiling()``) they call the ops,
whose schemas are flat: ``torch.ops.kvplan.swap_in`` takes the fields of ``SwapInCall`` in order with the plan as its
three tensors (``SwapInCall.flat()``), ``copy_planned`` the plan's three tensors and the copy's fields
(``CopyCall.flat()``), ``materialize`` the fields of ``MaterializeCall``. :func:`swap_in`, :func:`swap_in_blocks`,
:func:`copy_planned` and :func:`materialize` have the signatures of ``kvplan.kernels`` (the hot-buffer state and the
plan as records): each builds its record and takes that route. A custom op cannot return an alias of an input, so
the ops return nothing: :func:`swap_in` returns the plan it was given, and :func:`materialize` allocates missing
outputs and returns ``(k_out, v_out)`` like the kernel. See ``docs/compile.md``.

Importing this module imports the kernels (and Triton): set ``TRITON_INTERPRET`` before it when running on CPU.
"""

from typing import Optional

import torch
from torch import Tensor

from kvplan.calls import CopyCall, MaterializeCall, SwapInCall, refuse_stale_tails, swap_in_blocks_call, swap_in_call
from kvplan.config import plain_int
from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels.copy import run_copy_call as _run_copy
from kvplan.kernels.fused_kv import kv_outputs
from kvplan.kernels.fused_kv import run_materialize_call as _run_materialize
from kvplan.kernels.hisparse import run_swap_in as _run_swap_in
from kvplan.plan import MissPlan, new_plan_tensors, traceable_plan
from kvplan.runtime.launch_replay import LaunchCache
from kvplan.state import HotBufferState
from kvplan.validate import check_materialize
from kvplan.validate.arguments import MemorySpec, check_written, copy_memory, materialize_memory, swap_in_memory

__all__ = ["copy_planned", "materialize", "run_copy", "run_materialize", "run_swap_in", "swap_in", "swap_in_blocks"]

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
    check_newest: bool = True,
) -> None:
    """The flat schema of ``kvplan.calls.SwapInCall`` (``SwapInCall.flat()``: the plan as its three tensors)."""
    plan = None if miss_src is None else MissPlan(miss_src, miss_dst, miss_count)
    _run_swap_in(SwapInCall(
        speculative, device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs, scratch_locs, top_k_tokens,
        top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer, num_real_reqs, plan, workspace,
        counters, check_newest,
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
    check_newest: bool,
    sparse_block_size: int,
    host_cache_v: Optional[Tensor],
    device_buffer_v: Optional[Tensor],
) -> None:
    """The flat schema of a block-selection ``SwapInCall`` (``SwapInCall.flat_blocks()``): ``top_k_tokens`` holds
    the block ids, ``host_cache``/``device_buffer`` the K rows."""
    plan = None if miss_src is None else MissPlan(miss_src, miss_dst, miss_count)
    _run_swap_in(SwapInCall(
        speculative, device_buffer_tokens, device_buffer_locs, lru_slots, host_cache_locs, scratch_locs, top_k_tokens,
        top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer, num_real_reqs, plan, workspace,
        counters, check_newest, sparse_block_size, host_cache_v, device_buffer_v,
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
    """``copy_planned`` of K and V rows in one pass (``host_cache``/``device_buffer``: the K rows): the flat schema of
    a ``kvplan.calls.CopyCall`` with V rows (``CopyCall.flat_kv()``)."""
    plan = MissPlan(miss_src, miss_dst, miss_count)
    _run_copy(CopyCall(plan, host_cache, device_buffer, num_real_reqs, counters, counter_base, workspace, host_cache_v,
                       device_buffer_v))  # fmt: skip


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
    """The flat schema of a ``kvplan.calls.CopyCall`` of K rows (``CopyCall.flat()``)."""
    plan = MissPlan(miss_src, miss_dst, miss_count)
    _run_copy(CopyCall(plan, host_cache, device_buffer, num_real_reqs, counters, counter_base, workspace))


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
    """The fields of ``kvplan.calls.MaterializeCall`` in order."""
    _run_materialize(MaterializeCall(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out,
        check_positions,
    ))  # fmt: skip


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


# The memory check of a compiled step. Functionalization hands a mutating op copies of what it writes, so the kernel
# op's own checks cannot see that an output shares memory with another argument, and the copy written back at the end
# of the graph lands in that argument (a compiled step would write device rows into top_k_tokens). This op writes
# nothing, so it sees the step's tensors as they are: while dynamo traces, its fake implementation compares the fake
# tensors' storages (what overlaps when traced is refused when traced); each time the step runs, the real one compares
# the tensors it is handed, as the eager checks do. It is registered as having a side effect, so no pass removes it.


@torch.library.custom_op("kvplan::check_memory", mutates_args=())
def _check_memory_op(names: str, tensors: list[Tensor], rows: list[int], cols: list[int], num_written: int) -> None:
    """The eager checks' ``check_written`` on the operands ``(name i, tensors[i], rows[i], cols[i])`` (``names``
    comma-separated; ``-1``: all rows or columns), the first ``num_written`` of them written by the kernel that
    follows."""
    check_written(*_memory_specs(names, tensors, rows, cols, num_written))


@_check_memory_op.register_fake
def _check_memory_fake(names, tensors, rows, cols, num_written) -> None:
    check_written(*_memory_specs(names, tensors, rows, cols, num_written), fake=True)


torch.fx.node.has_side_effect(torch.ops.kvplan.check_memory.default)


def _memory_specs(names, tensors, rows, cols, num_written) -> tuple[list[MemorySpec], list[MemorySpec]]:
    specs = [
        (name, t, None if r == -1 else r, None if c == -1 else c)
        for name, t, r, c in zip(names.split(","), tensors, rows, cols)
    ]
    return specs[:num_written], specs[num_written:]


def _check_memory(memory: tuple[list[MemorySpec], list[MemorySpec]]) -> None:
    """Trace the memory check of a kernel's operands (``kvplan.validate.arguments``' ``*_memory``) into the step.
    Only tensors are compared; an argument of another type is left to the kernel op's checks, which name it."""
    written, read = memory
    specs = [spec for spec in (*written, *read) if isinstance(spec[1], Tensor)]
    num_written = sum(isinstance(spec[1], Tensor) for spec in written)
    torch.ops.kvplan.check_memory.default(
        ",".join(spec[0] for spec in specs),
        [spec[1] for spec in specs],
        [-1 if spec[2] is None else spec[2] for spec in specs],
        [-1 if spec[3] is None else spec[3] for spec in specs],
        num_written,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The API of kvplan.kernels, through the ops. They call the OpOverload (torch.ops.kvplan.<name>.default): it traces
# to the same graph node as the decorated function and skips that wrapper's extra Python per eager call.


def swap_in(
    state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *, num_real_reqs: Optional[Tensor] = None,
    plan: Optional[MissPlan] = None, workspace: Optional[Tensor] = None, counters: Optional[Tensor] = None,
    speculative: Optional[bool] = None, launch_records: Optional[LaunchCache] = None, check_newest: bool = True,
) -> MissPlan:  # fmt: skip
    """:func:`kvplan.kernels.swap_in` (its refusals and texts, the stale tail's included) as one record down
    :func:`run_swap_in`: the kernels' launch eagerly, ``torch.ops.kvplan.swap_in`` while dynamo traces. Returns the
    plan written: ``plan``, or one allocated when not given (the op itself cannot return what it allocates)."""
    refuse_stale_tails(state, "kvplan.kernels.swap_in")  # (the kernels' text: this is their call)
    call = swap_in_call(
        speculative, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
        num_real_reqs, plan, workspace, counters, check_newest,
    )  # fmt: skip
    return run_swap_in(call, launch_records=launch_records)


def swap_in_blocks(
    state: HotBufferState, top_k_blocks: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, host_cache_k: Tensor, host_cache_v: Tensor, device_buffer_k: Tensor, device_buffer_v: Tensor,
    *, sparse_block_size: int, num_real_reqs: Optional[Tensor] = None, plan: Optional[MissPlan] = None,
    workspace: Optional[Tensor] = None, counters: Optional[Tensor] = None,
    launch_records: Optional[LaunchCache] = None, check_newest: bool = True,
) -> MissPlan:  # fmt: skip
    """:func:`kvplan.kernels.swap_in_blocks` as one record down :func:`run_swap_in`: the kernels' launch eagerly,
    ``torch.ops.kvplan.swap_in_blocks`` while dynamo traces. Returns the plan written: ``plan``, or one allocated when
    not given."""
    refuse_stale_tails(state, "kvplan.kernels.swap_in_blocks")
    call = swap_in_blocks_call(
        state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k, host_cache_v,
        device_buffer_k, device_buffer_v, sparse_block_size, num_real_reqs, plan, workspace, counters, check_newest,
    )  # fmt: skip
    return run_swap_in(call, launch_records=launch_records)


def run_swap_in(call: SwapInCall, *, launch_records: Optional[LaunchCache] = None) -> MissPlan:
    """One swap-in record (``kvplan.calls.SwapInCall``: a token or a block selection) down to the kernels, as the pool
    builds it once: eagerly ``kvplan.kernels``' launch of the record (its checks included), while dynamo traces
    ``torch.ops.kvplan.swap_in`` or ``torch.ops.kvplan.swap_in_blocks``. Returns the plan written: ``call.plan``, or
    one allocated here when the record has none."""
    if not torch.compiler.is_compiling():
        written = _run_swap_in(call, records=launch_records)
        return written if call.plan is None else call.plan
    blocks = call.sparse_block_size is not None
    tokens, out, plan = call.top_k_tokens, call.top_k_device_locs, call.plan
    # (a refused rank or shape is left to the op's checks, which name it)
    if blocks:  # the plan's columns and the occurrences: the output's (the selected tokens)
        sized = isinstance(out, Tensor) and out.dim() == 2
        rows = out.shape if sized else None
        ranked = sized and isinstance(tokens, Tensor) and tokens.dim() == 2
        occurrences = out.shape[1] if sized else 0
    else:
        sized = isinstance(tokens, Tensor) and tokens.dim() >= 2
        rows = (tokens.shape[0], tokens[0].numel()) if sized else None
        ranked = sized and tokens.dim() == (3 if call.speculative else 2)
        occurrences = tokens[0].numel() if sized else 0
    if plan is None and sized:
        device = out.device if blocks else tokens.device
        plan = traceable_plan(*new_plan_tensors(*rows, device), None)  # (dynamo cannot trace MissPlan's __init__)
        call = call._replace(plan=plan)
    if ranked:
        _check_memory(swap_in_memory(call, tokens.shape[0], occurrences))
    if blocks:
        torch.ops.kvplan.swap_in_blocks.default(*call.flat_blocks())
    else:
        torch.ops.kvplan.swap_in.default(*call.flat())
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
    """:func:`kvplan.kernels.copy_planned` as one record down :func:`run_copy`: the kernels' launch eagerly,
    ``torch.ops.kvplan.copy_planned`` while dynamo traces (with ``host_cache_v``/``device_buffer_v``:
    ``torch.ops.kvplan.copy_planned_kv``, K and V rows in one pass)."""
    call = CopyCall(plan, host_cache, device_buffer, num_real_reqs, counters, _counter_base, workspace, host_cache_v,
                    device_buffer_v)  # fmt: skip
    run_copy(call, launch_records=launch_records)


def run_copy(call: CopyCall, *, launch_records: Optional[LaunchCache] = None) -> None:
    """One plan copy's record (``kvplan.calls.CopyCall``) down to the kernels, as the pool and the adapter build it
    once: eagerly ``kvplan.kernels``' launch of the record (its checks included), while dynamo traces
    ``torch.ops.kvplan.copy_planned`` (with V rows: ``torch.ops.kvplan.copy_planned_kv``)."""
    if not torch.compiler.is_compiling():
        _run_copy(call, records=launch_records)
        return
    plan = call.plan
    if not isinstance(plan, MissPlan):
        raise TypeError(f"plan must be a kvplan.MissPlan, got {type(plan).__name__}.")
    if isinstance(plan.src, Tensor) and plan.src.dim() == 2:
        _check_memory(copy_memory(plan, call.host_cache, call.device_buffer, call.num_real_reqs, call.counters,
                                  call.workspace, call.host_cache_v, call.device_buffer_v))  # fmt: skip
    if call.host_cache_v is not None or call.device_buffer_v is not None:
        torch.ops.kvplan.copy_planned_kv.default(*call.flat_kv())
        return
    torch.ops.kvplan.copy_planned.default(*call.flat())


def materialize(
    kv: Tensor, k_norm_weight: Tensor, eps: Tensor, cos_sin_cache: Tensor, positions: Tensor, num_kv_heads: int,
    head_dim: int, rotary_dim: int, k_out: Optional[Tensor] = None, v_out: Optional[Tensor] = None, *,
    check_positions: bool = False, launch_records: Optional[LaunchCache] = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`kvplan.kernels.materialize` as one record down :func:`run_materialize`: the kernels' launch eagerly,
    ``torch.ops.kvplan.materialize`` while dynamo traces. Returns ``(k_out, v_out)``, the given tensors or new
    ``[Lyr, T, H, D]`` ones."""
    call = MaterializeCall(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out,
                           v_out, check_positions)  # fmt: skip
    return run_materialize(call, launch_records=launch_records)


def run_materialize(call: MaterializeCall, *, launch_records: Optional[LaunchCache] = None) -> tuple[Tensor, Tensor]:
    """One materialize's record (``kvplan.calls.MaterializeCall``) down to the kernels, as the pool builds it once:
    eagerly ``kvplan.kernels``' launch of the record (its checks included), while dynamo traces
    ``torch.ops.kvplan.materialize``. Returns ``(k_out, v_out)``, the record's or new ``[Lyr, T, H, D]`` ones
    (allocated here when traced: the op itself only writes its outputs)."""
    if not torch.compiler.is_compiling():
        return _run_materialize(call, records=launch_records)
    kv, k_norm_weight, eps, cos_sin_cache, positions = call[:5]
    num_kv_heads, head_dim, rotary_dim = (plain_int(v) for v in call[5:8])
    k_out, v_out = call.k_out, call.v_out
    if k_out is None or v_out is None:
        # validate before reading kv's shape, so a bad kv reports the spec's message, not an IndexError
        check_materialize(
            kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out
        )
        k_out, v_out = kv_outputs(kv, num_kv_heads, head_dim, k_out, v_out)
    else:  # (outputs allocated here share memory with nothing)
        _check_memory(materialize_memory(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out))
    torch.ops.kvplan.materialize.default(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, k_out, v_out,
        call.check_positions,
    )  # fmt: skip
    return k_out, v_out
