"""Kernel launches against a pool's buffers: the swap-ins, the plan replay and the KV materialize of
:class:`~kvplan.PlanBufferPool`, mixed into it so an engine calls ``pool.swap_in_spec(...)``.

The pool (``kvplan.pool``) only sizes: it grows, reserves, freezes, cuts views and counts. This module takes a
launch's views from it, handles the side stream of a replay, and picks how to call the kernels: eagerly the plain
``kvplan.kernels`` (checks, then a replay of the recorded launches for a layout seen before); while dynamo traces an
engine step (``torch.compile``), the custom ops of ``kvplan.ops`` with views sliced from the storage, so the step
compiles without graph breaks and without a recompile per batch. Launches never grow the pool and allocate nothing,
so they can be captured in a CUDA graph; a shape the pool was not sized for raises ``PoolCapacityError``. Triton is
imported on the first launch only.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from kvplan.errors import PoolCapacityError
from kvplan.kernels.layout import DISPATCH_SLOTS
from kvplan.plan import MissPlan, traceable_plan
from kvplan.sizing import check_request
from kvplan.state import HotBufferState

__all__ = ["PoolLaunches"]

_PARAMETERS = """
        Parameters
        ----------
        state : HotBufferState
            Read and written: the engine's hot-buffer tables (docs/kernels.md §1).
        top_k_tokens : Tensor
            Read. int32 ``{tokens}``: token ids; anything outside ``[0, that step's length)`` resolves to ``-1``.
        top_k_device_locs : Tensor
            Written. int32, ``top_k_tokens``' shape: the device row serving each token (``-1`` for none).
        req_pool_indices : Tensor
            Read. int32/int64 ``[>= B]``: each batch row's request slot.
        seq_lens : Tensor
            Read. int32/int64 ``{lens}``.
        host_cache, device_buffer : Tensor
            The layer's KV rows: ``[host_rows, item]`` pinned host memory, read; ``[device_rows, item]`` on the
            pool's device, written (the rows of missed tokens).
        num_real_reqs : Tensor, optional
            Read on the device. ``[1]`` int32: batch rows from it on are CUDA-graph padding.

        Returns the pool's plan views for this shape (``[B, {columns}]``): they hold this launch's rows until the
        pool's next swap-in (after one of another layout ``replay`` refuses them) or reallocation. Needs
        ``ensure_capacity(batch=B, num_steps={steps}, top_k=K)`` first (``PoolCapacityError``).
"""


class PoolLaunches:
    """The launch methods of :class:`~kvplan.PlanBufferPool` (see the module docstring)."""

    def swap_in(
        self, state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
        seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *, num_real_reqs: Tensor | None = None,
    ) -> MissPlan:  # fmt: skip
        """Single-step HiSparse swap-in (docs/kernels.md §2) with the plan written into the pool; returns that plan.
        A state with scratch rows works too (the single-step path does not use them)."""
        batch, top_k = _shape_of(top_k_tokens, 2, "pool.swap_in", "[batch, top_k]")
        plan, kernel_plan, workspace = self._require(batch, 1, top_k)
        _launchers().swap_in(
            state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs=num_real_reqs, plan=kernel_plan, workspace=workspace, counters=self.counters,
        )  # fmt: skip
        return plan

    def swap_in_spec(
        self, state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
        seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *, num_real_reqs: Tensor | None = None,
    ) -> MissPlan:  # fmt: skip
        """Speculative swap-in over ``S`` draft steps (docs/kernels.md §3) with the plan written into the pool."""
        batch, steps, top_k = _shape_of(top_k_tokens, 3, "pool.swap_in_spec", "[batch, steps, top_k]")
        plan, kernel_plan, workspace = self._require(batch, steps, top_k)
        _launchers().swap_in_spec(
            state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
            num_real_reqs=num_real_reqs, plan=kernel_plan, workspace=workspace, counters=self.counters,
        )  # fmt: skip
        return plan

    def replay(
        self,
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
            pool reallocated, or once a swap-in or ``miss_plan`` of another layout overwrote it (docs/pool.md §2).
        host_cache, device_buffer : Tensor
            This layer's KV rows (read; written at ``plan.dst``), laid out as the swap-in's.
        num_real_reqs : Tensor, optional
            Read on the device: ``[1]`` int32, rows from it on are graph padding.
        stream : torch.cuda.Stream, optional
            Run the copy on this side stream, after the work already queued on the current stream; the returned
            event marks its end: ``torch.cuda.current_stream().wait_event(event)`` before the layer reads
            ``device_buffer`` (inside graph capture too: the side stream must rejoin before capture ends).
        """
        compiling = torch.compiler.is_compiling()
        if compiling:  # dynamo: the generation only (launches while tracing do not record the live plan)
            if not isinstance(plan, MissPlan) or plan.generation != self._state.generation:
                self._check_replayable(plan)
        elif plan is not self._live_plan or plan.generation != self._state.generation:
            self._check_replayable(plan)  # eagerly: two attribute reads when it is the plan last handed out
        if stream is not None and self.device.type != "cuda":
            raise ValueError(f"pool.replay: stream= needs a CUDA pool, this pool is on {self.device}")
        if compiling:
            copy, extra = _launchers().copy_planned, {}
        else:  # the plain kernel, its programs handed their work by a counter of this step (when one is left)
            from kvplan.kernels.copy import _copy_planned as copy

            extra = {"dispatch": self._next_dispatch()}
        if stream is None:
            copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=self.counters, **extra)
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            copy(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=self.counters, **extra)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def materialize(
        self,
        kv: Tensor,
        k_norm_weight: Tensor,
        eps: Tensor,
        cos_sin_cache: Tensor,
        positions: Tensor,
        *,
        rotary_dim: int,
    ) -> tuple[Tensor, Tensor]:
        """Fused RMSNorm+RoPE KV materialization (docs/kernels.md §5) into the pool's slabs; returns the
        ``[n_layers, total_ctx, H, D]`` views it wrote (``total_ctx = kv.shape[0]``).

        Takes the arguments of :func:`kvplan.kernels.materialize`; ``num_kv_heads``, ``head_dim`` and the outputs are
        the pool's geometry and slabs. Needs ``ensure_capacity(..., total_ctx=T)`` first.
        """
        if not isinstance(kv, Tensor):
            raise TypeError(f"pool.materialize: kv must be a torch.Tensor, got {type(kv).__name__}")
        g = self.geometry
        if g is None:
            raise ValueError(
                "pool.materialize: this pool has no materialize slabs; build it with "
                "materialize=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
            )
        if kv.dim() != 3:  # report the engines' own message before asking for a slab view
            from kvplan.validate import check_materialize

            check_materialize(kv, k_norm_weight, eps, cos_sin_cache, positions, g.num_kv_heads, g.head_dim, rotary_dim)
        if kv.shape[1] != g.n_layers or kv.dtype != g.dtype or kv.device != self.device:
            raise ValueError(
                f"pool.materialize: kv must be [total_ctx, {g.n_layers}, {2 * g.num_kv_heads * g.head_dim}] "
                f"{g.dtype} on {self.device}, the pool's geometry {g!r}; got shape {tuple(kv.shape)} {kv.dtype} on "
                f"{kv.device}. Materialize a draft model of the pool's geometry, or build the pool with this one."
            )
        if torch.compiler.is_compiling():  # kv's token count may be symbolic: no per-shape cache, no int()
            k_out, v_out = self._cut_kv(self._state, kv.shape[0], call="kv_out")
        else:
            k_out, v_out = self.kv_out(int(kv.shape[0]))
        return _launchers().materialize(
            kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
            rotary_dim=rotary_dim, k_out=k_out, v_out=v_out,
        )  # fmt: skip

    # ---------------------------------------------------------------------------------------------------------------

    def _check_replayable(self, plan: object) -> None:
        """Refuse a plan whose rows are not what the pool's plan storage holds, or adopt one laid out exactly like
        the live plan (the same views: e.g. ``[2, 8]`` from ``(2, 1, 8)`` and from ``(2, 2, 4)``)."""
        if not isinstance(plan, MissPlan):
            raise TypeError(f"pool.replay: plan must be the MissPlan a pool launch returned, got {type(plan).__name__}")
        state = self._state
        if plan.generation != state.generation:
            raise PoolCapacityError(
                f"pool.replay: the plan is from generation {plan.generation}, the pool is at generation "
                f"{state.generation}: the pool grew since the swap-in that wrote it, so its buffers moved. "
                "Replay the plan of this step's swap-in."
            )
        if torch.compiler.is_compiling():
            return
        live = self._live_plan
        if live is not None and live.generation == state.generation and _same_views(plan, live):
            self._live_plan = plan
            return
        given = _layout(plan)
        if live is None or live.generation != state.generation:
            raise PoolCapacityError(
                f"pool.replay: the plan ({given}) is not a plan this pool handed out in generation {state.generation}; "
                "replay the MissPlan this step's pool.swap_in or pool.swap_in_spec returned."
            )
        raise PoolCapacityError(
            f"pool.replay: the plan ({given}) no longer holds its swap-in's rows: plans of every shape share the "
            f"pool's plan storage, and a later swap-in (or miss_plan view) of {_layout(live)} overwrote it. Replay "
            "a plan before the pool's next swap-in of another shape (the plan of this step's swap-in)."
        )

    def _next_dispatch(self) -> Tensor | None:
        """The work counter of this replay's ordered copy: the next slot of this step's (the last pool swap-in's, which
        zeroed them and used slot 0; each copy leaves its slot zero), or ``None`` (static dispatch: after
        ``miss_plan``, whose writer may not have zeroed them, or past the slots)."""
        slot = next(self._copy_slots, DISPATCH_SLOTS)
        if slot >= DISPATCH_SLOTS:
            return None
        state = self._state
        if state.dispatch is None:
            words = state.buffers["workspace"].storage.view(torch.int32)
            if words.numel() < 2 * DISPATCH_SLOTS:
                return None
            state.dispatch = [words[2 * k : 2 * k + 2] for k in range(DISPATCH_SLOTS)]
        return state.dispatch[slot]

    def _require(self, batch: int, num_steps: int, top_k: int) -> tuple[MissPlan, MissPlan, Tensor]:
        """``(plan, kernel_plan, workspace)`` for a swap-in of this shape, or ``PoolCapacityError`` naming the
        ``ensure_capacity(...)`` call to make. ``kernel_plan`` is what the kernel writes: ``plan`` itself eagerly."""
        if torch.compiler.is_compiling():
            return self._launch_views(batch, num_steps, top_k)
        views = self._state.launches.get((batch, num_steps, top_k))
        if views is None:
            state = self._state
            b, s, k, _ = check_request(batch, num_steps, top_k, 0, self.geometry, call="swap-in launch")
            plan = state.plans.get((b, s, k))  # the object miss_plan hands out, so replay knows it by identity
            if plan is None:
                plan = self._cut_plan(state, b, s, k, call="swap-in launch")
            views = (plan, plan, self._cut_workspace(state, b, s, k, call="swap-in launch"))
            for cache, value in ((state.plans, plan), (state.launches, views)):
                if len(cache) >= 1024:
                    cache.clear()
                cache[(b, s, k)] = value
        self._live_plan = views[0]  # what this launch writes: the plan replay accepts until another shape's
        self._copy_slots = itertools.count(1)  # this step's replays: the copy work counters after the swap-in's own
        return views

    def _launch_views(self, batch: int, num_steps: int, top_k: int) -> tuple[MissPlan, MissPlan, Tensor]:
        """``_require`` as dynamo traces it: views sliced from this generation's storage, no per-shape cache.

        The sizes may be symbolic (a dynamic batch): a cache keyed by them would pin them to constants and recompile
        per batch. Dynamo turns the capacity check into a guard (``batch * columns <= capacity``) on the compiled
        graph, so a shape beyond the pool's capacity re-traces and is refused with ``PoolCapacityError`` (reported by
        dynamo as ``Unsupported`` under ``fullgraph=True``), and a growth (new storage sizes) recompiles.

        The kernel writes the whole count buffer's view (the kernels take ``[>= batch]`` and write rows ``< batch``
        only): functionalization compares a mutated 1-D view's length with its base's, which would give
        ``batch == capacity`` a graph of its own.
        """
        state = self._state
        plan = self._cut_plan(state, batch, num_steps, top_k, call="swap-in launch")
        kernel_plan = traceable_plan(
            src=plan.src, dst=plan.dst, count=state.buffers["miss_count"].storage, generation=state.generation
        )
        return plan, kernel_plan, self._cut_workspace(state, batch, num_steps, top_k, call="swap-in launch")


def _layout(plan: MissPlan) -> str:
    """A plan's layout as messages name it: ``[batch, columns]``."""
    src = plan.src
    return f"[{', '.join(map(str, src.shape))}]" if isinstance(src, Tensor) else repr(src)


def _same_views(a: MissPlan, b: MissPlan) -> bool:
    """Whether two plans are the same views of the same storage (then either shows what the other does)."""
    return all(
        x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
        for x, y in ((a.src, b.src), (a.dst, b.dst), (a.count, b.count))
    )


def _launchers():
    """The launch functions: while dynamo traces, the custom ops of ``kvplan.ops`` (opaque graph nodes with declared
    mutations); otherwise the plain ``kvplan.kernels``, the same code without the dispatcher's round trip."""
    if torch.compiler.is_compiling():
        import kvplan.ops as launchers
    else:
        import kvplan.kernels as launchers
    return launchers


def _shape_of(tokens: object, ndim: int, call: str, expected: str) -> tuple[int, ...]:
    """The launch shape read off ``top_k_tokens``, or a TypeError/ValueError naming it. Plain ints in eager mode
    (``torch.Size`` holds ints); no ``int()`` on them, which would pin a symbolic size under ``torch.compile``."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{call}: top_k_tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != ndim:
        raise ValueError(f"{call}: top_k_tokens must have shape {expected}, got {tuple(tokens.shape)}")
    return tuple(tokens.shape)


_LENS = "[>= B*S]: the length at each draft step, request-major"
PoolLaunches.swap_in.__doc__ += _PARAMETERS.format(tokens="[B, K]", lens="[>= B]", columns="K", steps=1)
PoolLaunches.swap_in_spec.__doc__ += _PARAMETERS.format(tokens="[B, S, K]", lens=_LENS, columns="S*K", steps="S")
