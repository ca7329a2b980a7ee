"""Kernel launches against a pool's buffers: :class:`~kvplan.PlanBufferPool`'s ``swap_in``, ``replay`` and
``materialize``, as functions of the pool (the pool binds them as its methods).

The pool (``kvplan.pool``) sizes: it grows, reserves, freezes, cuts views and counts. These functions ask it for a
launch's buffers through two methods (:meth:`~kvplan.PlanBufferPool.launch_buffers`,
:meth:`~kvplan.PlanBufferPool.replay_buffers`) and its public views, never its internals; handle the side stream of a
replay; and pick how to call the kernels: eagerly the plain ``kvplan.kernels`` (checks, then a record of the launches
for a layout seen before); while dynamo traces an engine step (``torch.compile``), the custom ops of ``kvplan.ops``,
so the step compiles without graph breaks and without a recompile per batch. Launches never grow the pool and
allocate nothing, so they can be captured in a CUDA graph; a shape the pool was not sized for raises
``PoolCapacityError``. Triton is imported on the first launch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from kvplan import checked
from kvplan.config import MaterializeGeometry, PoolConfig
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState

__all__ = ["Pool", "materialize", "replay", "swap_in"]


class Pool(Protocol):
    """What the launches take from a :class:`kvplan.PlanBufferPool`: its package-facing methods and public views,
    never its internals (a protocol, so this module does not import the pool that binds its functions)."""

    device: torch.device
    geometry: MaterializeGeometry | None
    config: PoolConfig

    def launch_buffers(self, batch: int, num_steps: int, top_k: int, hot_state: object = None) -> Any: ...

    def replay_buffers(self, plan: MissPlan) -> Any: ...

    def kv_out(self, total_ctx: int) -> tuple[Tensor, Tensor]: ...


def swap_in(
    pool: Pool, state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor,
    req_pool_indices: Tensor, seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *,
    num_real_reqs: Tensor | None = None, speculative: bool | None = None,
) -> MissPlan:  # fmt: skip
    """HiSparse swap-in (docs/kernels.md §2-§3) with the plan written into the pool: :func:`kvplan.kernels.swap_in`
    with the pool's plan, workspace and counters. Speculative when ``top_k_tokens`` is ``[B, S, K]`` (or
    ``speculative=True``), single-step when it is ``[B, K]``.

    Returns
    -------
    MissPlan
        The pool's plan views for this shape (``[B, S*K]``): they hold this launch's rows until the pool's next
        swap-in (after one of another layout ``replay`` refuses them) or reallocation.

    Raises
    ------
    PoolCapacityError
        The pool was not sized for ``(B, S, K)``: the message names the ``ensure_capacity`` call to make.
    TypeError, ValueError
        As :func:`kvplan.kernels.swap_in`.
    """
    if not isinstance(top_k_tokens, Tensor):
        raise TypeError(f"pool.swap_in: top_k_tokens must be a torch.Tensor, got {type(top_k_tokens).__name__}")
    rank = top_k_tokens.dim()
    spec = rank == 3 if speculative is None else speculative
    if rank != (3 if spec else 2):
        expected = "[batch, steps, top_k]" if spec else "[batch, top_k]"
        raise ValueError(f"pool.swap_in: top_k_tokens must have shape {expected}, got {tuple(top_k_tokens.shape)}")
    shape = top_k_tokens.shape  # plain ints eagerly; never int() them (a symbolic size under torch.compile)
    buffers = pool.launch_buffers(shape[0], shape[1] if spec else 1, shape[-1], state)

    def launch() -> MissPlan:
        _launchers().swap_in(
            state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs=num_real_reqs, plan=buffers.kernel_plan, workspace=buffers.workspace,
            counters=buffers.counters, speculative=spec,
        )  # fmt: skip
        return buffers.plan

    if not checked.checking(pool.config):
        return launch()
    return checked.swap_in(
        launch, buffers.kernel_plan, state, top_k_tokens, top_k_device_locs, device_buffer, buffers.counters, spec,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens, host_cache=host_cache, num_real_reqs=num_real_reqs,
    )  # fmt: skip


def replay(
    pool: Pool,
    plan: MissPlan,
    *,
    host_cache: Tensor,
    device_buffer: Tensor,
    num_real_reqs: Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Copy ``plan``'s rows from ``host_cache`` into ``device_buffer``: a layer sharing the anchor's top-k.

    Parameters
    ----------
    plan : MissPlan
        Read: this step's plan, as a swap-in of this pool returned it. Refused (``PoolCapacityError``) once the
        pool reallocated, once a swap-in or ``miss_plan`` of another layout overwrote it, or once the state its
        swap-in ran on admitted, finished or re-laid a request slot (docs/pool.md §2).
    host_cache, device_buffer : Tensor
        This layer's KV rows (read; written at ``plan.dst``), laid out as the swap-in's.
    num_real_reqs : Tensor, optional
        Read on the device: ``[1]`` int32, rows from it on are graph padding.
    stream : torch.cuda.Stream, optional
        Run the copy on this side stream, after the work already queued on the current stream; the returned
        event marks its end: ``torch.cuda.current_stream().wait_event(event)`` before the layer reads
        ``device_buffer`` (inside graph capture too: the side stream must rejoin before capture ends).

    Returns
    -------
    torch.cuda.Event or None
        The side stream's end event (``None`` without ``stream``).
    """
    if stream is not None and pool.device.type != "cuda":
        raise ValueError(f"pool.replay: stream= needs a CUDA pool, this pool is on {pool.device}")
    buffers = pool.replay_buffers(plan)
    copy = _launchers().copy_planned

    def launch() -> torch.cuda.Event | None:
        if stream is None:
            copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=buffers.counters,
                 workspace=buffers.workspace)  # fmt: skip
            return None
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(stream):
            copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=buffers.counters,
                 workspace=buffers.workspace)  # fmt: skip
            done = torch.cuda.Event()
            done.record(stream)
        return done

    if not checked.checking(pool.config):
        return launch()
    return checked.replay(launch, plan, host_cache, device_buffer, num_real_reqs)


def materialize(
    pool: Pool,
    kv: Tensor,
    k_norm_weight: Tensor,
    eps: Tensor | float | Sequence[float],
    cos_sin_cache: Tensor,
    positions: Tensor,
    *,
    rotary_dim: int,
) -> tuple[Tensor, Tensor]:
    """Fused RMSNorm+RoPE KV materialization (docs/kernels.md §5) into the pool's slabs.

    Takes the arguments of :func:`kvplan.kernels.materialize`; ``num_kv_heads``, ``head_dim`` and the outputs are
    the pool's geometry and slabs. ``eps`` is a ``[n_layers]`` float32 tensor, or (as ``FusedKVMaterializer`` takes
    it) one float or one per layer, kept on the device after the first call with those values (pass a tensor when
    the first call is captured in a CUDA graph). Needs ``ensure_capacity(..., total_ctx=T)`` first.

    Returns
    -------
    (Tensor, Tensor)
        The ``[n_layers, total_ctx, H, D]`` slab views it wrote (``total_ctx = kv.shape[0]``).
    """
    if not isinstance(kv, Tensor):
        raise TypeError(f"pool.materialize: kv must be a torch.Tensor, got {type(kv).__name__}")
    g = pool.geometry
    if g is None:
        raise ValueError(
            "pool.materialize: this pool has no materialize slabs; build it with "
            "geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
        )
    if kv.dim() != 3:  # report the engines' own message before asking for a slab view
        from kvplan.validate import check_materialize

        check_materialize(kv, k_norm_weight, eps, cos_sin_cache, positions, g.num_kv_heads, g.head_dim, rotary_dim)
    if kv.shape[1] != g.n_layers or kv.dtype != g.dtype or kv.device != pool.device:
        raise ValueError(
            f"pool.materialize: kv must be [total_ctx, {g.n_layers}, {2 * g.num_kv_heads * g.head_dim}] "
            f"{g.dtype} on {pool.device}, the pool's geometry {g!r}; got shape {tuple(kv.shape)} {kv.dtype} on "
            f"{kv.device}. Materialize a draft model of the pool's geometry, or build the pool with this one."
        )
    if not isinstance(eps, Tensor):  # one float for every layer, or one per layer, as the materializer takes it
        eps = _eps_tensor(eps, g.n_layers, pool.device)
    k_out, v_out = pool.kv_out(kv.shape[0])
    inputs = dict(kv=kv, k_norm_weight=k_norm_weight, eps=eps, cos_sin_cache=cos_sin_cache, positions=positions,
                  num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, rotary_dim=rotary_dim)  # fmt: skip

    def launch() -> tuple[Tensor, Tensor]:
        return _launchers().materialize(**inputs, k_out=k_out, v_out=v_out)

    if not checked.checking(pool.config):
        return launch()
    return checked.materialize(launch, **inputs)


_EPS: dict[tuple, Tensor] = {}  # per-layer epsilons given as numbers -> their device tensor


def _eps_tensor(eps: float | Sequence[float], n_layers: int, device: torch.device) -> Tensor:
    """``eps`` as the kernel's ``[n_layers]`` float32 tensor on ``device`` (checked as the materializer checks it),
    made once per distinct value."""
    from kvplan.validate.arguments import eps_per_layer

    try:
        key = (device, n_layers, type(eps), tuple(eps) if isinstance(eps, Sequence) else eps)
        tensor = _EPS.get(key)
    except TypeError:  # not hashable (an array): converted every call
        return eps_per_layer(eps, n_layers).to(device)
    if tensor is None:
        tensor = eps_per_layer(eps, n_layers).to(device)
        if len(_EPS) >= 64:
            _EPS.clear()
        _EPS[key] = tensor
    return tensor


def _launchers():
    """The launch functions: while dynamo traces, the custom ops of ``kvplan.ops`` (opaque graph nodes with declared
    mutations); otherwise the plain ``kvplan.kernels``, the same code without the dispatcher's round trip."""
    if torch.compiler.is_compiling():
        import kvplan.ops as launchers
    else:
        import kvplan.kernels as launchers
    return launchers
