"""PlanBufferPool: one per GPU worker; owns the step-scoped buffers, grows them, and launches the kernels on them.

Before each step the engine calls ``ensure_capacity(batch=, num_steps=, top_k=, total_ctx=)``; then it takes views
(``miss_plan``, ``workspace``, ``kv_out``) or launches kernels through the pool (``swap_in``, ``replay``,
``materialize``: each takes the pool's buffers for its shape and calls ``kvplan.ops``, one way down). A view of a
shape the pool was not sized for raises ``PoolCapacityError``: a short or wrong view is never returned.

Two rooms: the buffers (generations, growth, budget, views) are the arena's (``kvplan.arena.BufferArena``, whose
docstring tells the design); this module is the launch facade on top of it: the launches, the record of which plan
the last swap-in wrote (the replay guard), the launch records and the stats. The facade is the arena (a subclass, not
a wrapper): the sizing and view calls are the pool's own API, reached without a forwarding frame.

Counters live in ``pool.counters``, allocated once and never reallocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from kvplan import checked
from kvplan.arena import BufferArena, _Generation, _numel, _remember, _size
from kvplan.calls import CopyCall, MaterializeCall, swap_in_blocks_call, swap_in_call
from kvplan.config import MaterializeGeometry, PoolConfig
from kvplan.counters import OVERFLOW, REPLAY_COPY_BASE, new_counters, read_counters
from kvplan.errors import PoolCapacityError
from kvplan.plan import MissPlan, traceable_plan
from kvplan.sizing import buffer_shapes, check_request
from kvplan.state import HotBufferState
from kvplan.stats import BufferStats, DeviceCounters, GrowthCauses, PoolStats, buffer_capacity

if TYPE_CHECKING:
    from kvplan.runtime.launch_replay import LaunchCache

__all__ = ["MissPlan", "PlanBufferPool"]


class LaunchBuffers(NamedTuple):
    """A swap-in launch's buffers (``PlanBufferPool._launch_buffers``)."""

    plan: MissPlan  # returned to the caller
    kernel_plan: MissPlan  # what the kernel writes: ``plan`` eagerly; while dynamo traces, with the whole count buffer
    workspace: Tensor
    counters: Tensor


class ReplayBuffers(NamedTuple):
    """A replay's buffers (``PlanBufferPool._replay_buffers``)."""

    counters: Tensor
    workspace: Tensor | None  # the workspace of the swap-in that wrote the plan (None: unknown, every row from host)


def _plan_shape_text(plan: MissPlan) -> str:
    """A plan's shape as messages name it: ``[batch, columns]``."""
    src = plan.src
    return f"[{', '.join(map(str, src.shape))}]" if isinstance(src, Tensor) else repr(src)


def _same_views(a: MissPlan, b: MissPlan) -> bool:
    """Whether two plans are the same views of the same storage (then either shows what the other does)."""
    return all(
        x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
        for x, y in ((a.src, b.src), (a.dst, b.dst), (a.count, b.count))
    )


class PlanBufferPool(BufferArena):
    """Step-scoped buffers for one GPU worker: the HiSparse miss plan, the swap-in workspace, the fused-KV slabs.

    Parameters
    ----------
    device : torch.device, str or int
        Where every buffer lives (``'cuda'`` is pinned to the current device at construction).
    geometry : MaterializeGeometry, optional
        The draft model's KV slab geometry; without it the pool has no slabs and refuses ``total_ctx > 0``.
    config : PoolConfig, optional
        The growth policy and byte budget, the checked mode, and the launch records and how they relaunch
        (``launch_records``, ``launch_replay``).
    """

    def __init__(
        self,
        device: torch.device | str | int,
        *,
        geometry: MaterializeGeometry | None = None,
        config: PoolConfig | None = None,
    ) -> None:
        super().__init__(device, geometry=geometry, config=config)
        # The device counter vector: allocated once, survives every growth, read only by stats().
        self.counters = new_counters(self.device)
        # The plan view last handed out (a swap-in launch or miss_plan): plans of every shape share one storage, so
        # only that shape holds what the last swap-in wrote; replay refuses the others (_replay_buffers).
        self._live_plan: MissPlan | None = None
        # The handles handed out since the last swap-in (its own, then miss_plan's of the same views): a swap-in hands
        # out a new MissPlan object over the cached views, so a handle of an earlier swap-in is told apart from this
        # one's even when both are the same views (a late replay of it would copy this step's rows).
        self._live_handles: list[MissPlan] = []
        # The workspace of the swap-in that wrote the live plan (None after miss_plan): its record of shared host rows
        # lets a replay read each distinct host row once.
        self._live_workspace: Tensor | None = None
        # The request records (HotBufferState.lifecycle: host ints, no tensors) of the state the live plan's swap-in
        # ran on, and their epoch then: replay refuses the plan once a slot of that state changed requests (its rows
        # may be another request's now). None: a miss_plan view or a state without records.
        self._live_requests: object | None = None
        self._live_epoch: int | None = None
        # Set when dynamo traced a swap-in of this pool: compiled calls skip the host bookkeeping above, so an eager
        # replay cannot tell which swap-in's rows the plan storage holds (_replay_buffers refuses it).
        self._traced = False
        self._eps: dict[tuple, Tensor] = {}  # per-layer epsilons given to materialize as numbers -> device tensors
        # The eager launches' records (a call laid out like a recorded one relaunches it, under config.launch_replay):
        # the pool's, so stats() counts them and a growth or trim drops them with the buffers they name. (made on the
        # first launch: the launch runtime imports Triton, which a pool of its own does not; never made when the
        # policy is "off" or config.launch_records is 0: every call is then checked and launched, nothing recorded)
        self._launch_records: LaunchCache | None = None

    def _published(self, gen: _Generation) -> None:
        if self._launch_records is not None:  # recorded at the old buffers' addresses: never laid out alike again
            self._launch_records.clear()

    # ---------------------------------------------------------------------------------------------------------------
    # Launches against the pool's buffers: the pool takes its buffers, builds the call's record (``kvplan.calls``) once
    # and hands it to ``kvplan.ops``' run_* (the kernels eagerly, the custom ops while dynamo traces); checked mode
    # wraps the launch, with the same record, when on. Nothing below calls back up.

    def swap_in(
        self, state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor,
        req_pool_indices: Tensor, seq_lens: Tensor, host_cache: Tensor, device_buffer: Tensor, *,
        num_real_reqs: Tensor | None = None, speculative: bool | None = None, check_newest: bool = True,
    ) -> MissPlan:  # fmt: skip
        """HiSparse swap-in (docs/kernels.md §2-§3) with the plan written into the pool: :func:`kvplan.kernels.swap_in`
        with the pool's plan, workspace and counters. Speculative when ``top_k_tokens`` is ``[B, S, K]`` (or
        ``speculative=True``), single-step when it is ``[B, K]``. ``check_newest`` as there (``False``: SGLang's rule
        for the newest token, the adapter's).

        Returns
        -------
        MissPlan
            The pool's plan views for this shape (``[B, S*K]``): they hold this launch's rows until the pool's next
            swap-in (after one of another shape ``replay`` refuses them) or reallocation.

        Raises
        ------
        PoolCapacityError
            The pool was not sized for ``(B, S, K)``: the message names the ``ensure_capacity`` call to make.
        TypeError, ValueError
            As :func:`kvplan.kernels.swap_in`.
        """
        if not isinstance(top_k_tokens, Tensor):
            raise TypeError(f"pool.swap_in: top_k_tokens must be a torch.Tensor, got {type(top_k_tokens).__name__}")
        if speculative is not None and type(speculative) is not bool:  # ("False" is truthy)
            raise TypeError(f"pool.swap_in: speculative must be a bool or None, got {type(speculative).__name__} "
                            f"{speculative!r}.")  # fmt: skip
        rank = top_k_tokens.dim()
        spec = rank == 3 if speculative is None else speculative
        if rank != (3 if spec else 2):  # the engines' text (docs/kernels.md §6), as kvplan.kernels.swap_in raises it
            from kvplan.validate import check_miss_plan, check_spec_miss_plan

            (check_spec_miss_plan if spec else check_miss_plan)(top_k_tokens, None, None, None)
        shape = top_k_tokens.shape  # plain ints eagerly; never int() them (a symbolic size under torch.compile)
        records = getattr(state, "lifecycle", None)  # (host records: nothing here reads the device)
        if records is not None and not torch.compiler.is_compiling():
            if records.stale:
                state.check_tails("pool.swap_in")
            need = records.rows if spec or records.rows is None else state.num_reqs * state.width
            if need is not None and isinstance(device_buffer, Tensor) and device_buffer.shape[:1] < (need,):
                self._refuse_device_buffer(state, device_buffer, need, spec, top_k_tokens, top_k_device_locs,
                                           req_pool_indices, seq_lens, host_cache, num_real_reqs)  # fmt: skip
        buffers = self._launch_buffers(shape[0], shape[1] if spec else 1, shape[-1])
        # the call's one record, handed to the checked mode and down kvplan.ops to the launch
        call = swap_in_call(spec, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache,
                            device_buffer, num_real_reqs, buffers.kernel_plan, buffers.workspace, buffers.counters,
                            check_newest)  # fmt: skip

        def launch() -> MissPlan:
            _ops().run_swap_in(call, launch_records=self._records())
            # only once the launch ran: a refused call leaves the last record as it was; this swap-in's own handle
            return self._wrote(buffers, state)

        if not checked.checking(self.config):
            return launch()
        return checked.swap_in(launch, call, state)

    def swap_in_blocks(
        self, state: HotBufferState, top_k_blocks: Tensor, top_k_device_locs: Tensor, req_pool_indices: Tensor,
        seq_lens: Tensor, host_cache_k: Tensor, host_cache_v: Tensor, device_buffer_k: Tensor,
        device_buffer_v: Tensor, *, sparse_block_size: int, num_real_reqs: Tensor | None = None,
        check_newest: bool = True,
    ) -> MissPlan:  # fmt: skip
        """Block-selection swap-in of an MHA layer's K and V rows (docs/kernels.md §2a) with the plan written into the
        pool: :func:`kvplan.kernels.swap_in_blocks` with the pool's plan, workspace and counters. The pool is sized as
        for a single-step swap-in of ``top_k = NB * sparse_block_size`` tokens
        (``ensure_capacity(batch=B, top_k=NB * sparse_block_size)``). ``check_newest`` as there (``False``: SGLang's
        rule for the newest token, the adapter's).

        Returns
        -------
        MissPlan
            The pool's plan views for this shape (``[B, NB * sparse_block_size]``), which :meth:`replay` copies into
            another layer's K and V caches (``host_cache_v=``, ``device_buffer_v=``) until the pool's next swap-in.

        Raises
        ------
        PoolCapacityError
            The pool was not sized for ``(B, 1, NB * sparse_block_size)``: the message names the call to make.
        TypeError, ValueError
            As :func:`kvplan.kernels.swap_in_blocks`; nothing is written.
        """
        from kvplan.validate.arguments import check_sparse_block_size

        if not isinstance(top_k_blocks, Tensor):
            given = type(top_k_blocks).__name__
            raise TypeError(f"pool.swap_in_blocks: top_k_blocks must be a torch.Tensor, got {given}")
        if top_k_blocks.dim() != 2:
            raise ValueError(
                "pool.swap_in_blocks: top_k_blocks must have shape [batch, num_blocks], got "
                f"{tuple(top_k_blocks.shape)}."
            )
        block = check_sparse_block_size(sparse_block_size)
        batch, tokens = top_k_blocks.shape[0], top_k_blocks.shape[1] * block
        records = getattr(state, "lifecycle", None)  # (host records: nothing here reads the device)
        if records is not None and not torch.compiler.is_compiling():
            if records.stale:
                state.check_tails("pool.swap_in_blocks")
            # (as swap_in's single-step check: only a state whose host records name its rows)
            need = None if records.rows is None else state.num_reqs * state.width
            buffers = (("device_buffer_k", device_buffer_k), ("device_buffer_v", device_buffer_v))
            short = [(name, t) for name, t in buffers if need is not None and isinstance(t, Tensor)
                     and t.shape[:1] < (need,)]  # fmt: skip
            if short:
                from kvplan.validate.arguments import check_swap_in

                # the arguments' own messages first, then kvplan's refusal
                check_swap_in(swap_in_blocks_call(state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens,
                                                  host_cache_k, host_cache_v, device_buffer_k, device_buffer_v, block,
                                                  num_real_reqs, None, check_newest=check_newest),
                              launch=False)  # fmt: skip
                name, t = short[0]
                raise ValueError(
                    f"pool.swap_in_blocks: {name} has {t.shape[0]} rows, but the state's tables name {need} device "
                    f"rows behind its slots (R * (HOT + tail) = {state.num_reqs} * ({state.hot} + {state.tail})): "
                    "tokens "
                    f"served there would point past the buffer. Allocate {name} with at least {need} rows. Nothing "
                    "was launched."
                )
        buffers = self._launch_buffers(batch, 1, tokens)
        call = swap_in_blocks_call(state, top_k_blocks, top_k_device_locs, req_pool_indices, seq_lens, host_cache_k,
                                   host_cache_v, device_buffer_k, device_buffer_v, block, num_real_reqs,
                                   buffers.kernel_plan, buffers.workspace, buffers.counters, check_newest)  # fmt: skip

        def launch() -> MissPlan:
            _ops().run_swap_in(call, launch_records=self._records())
            return self._wrote(buffers, state)

        if not checked.checking(self.config):
            return launch()
        return checked.swap_in(launch, call, state)

    def _refuse_device_buffer(self, state: HotBufferState, device_buffer: Tensor, need: int, spec: bool,
                              *inputs: Tensor | None) -> None:  # fmt: skip
        """A ``device_buffer`` with fewer rows than the state's tables name: the engines' texts first (an argument
        breaking one reports it), then kvplan's refusal."""
        from kvplan.validate.arguments import check_swap_in

        top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, num_real_reqs = inputs
        check_swap_in(swap_in_call(spec, state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens,
                                   host_cache, device_buffer, num_real_reqs, None), launch=False)  # fmt: skip
        rows = state.num_reqs * state.width
        what = (
            f"{state.device_rows} device rows (state.device_rows: R * (HOT + tail + scratch) = {state.num_reqs} * "
            f"({state.hot} + {state.tail} + {state.scratch}))"
            if spec
            else f"{rows} device rows behind its slots (R * (HOT + tail) = {state.num_reqs} * ({state.hot} + "
            f"{state.tail}); a single-step swap-in uses no scratch rows)"
        )
        raise ValueError(
            f"pool.swap_in: device_buffer has {device_buffer.shape[0]} rows, but the state's tables name {what}: "
            f"rows {device_buffer.shape[0]} and up lie outside it, so tokens served there would point past the "
            f"buffer. Allocate device_buffer with state.device_rows = {state.device_rows} rows. Nothing was launched."
        )

    def replay(
        self,
        plan: MissPlan,
        *,
        host_cache: Tensor,
        device_buffer: Tensor,
        num_real_reqs: Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
        host_cache_v: Tensor | None = None,
        device_buffer_v: Tensor | None = None,
    ) -> torch.cuda.Event | None:
        """Copy ``plan``'s rows from ``host_cache`` into ``device_buffer``: a layer sharing the anchor's top-k.

        Parameters
        ----------
        plan : MissPlan
            Read: this step's plan, as a swap-in of this pool returned it. Refused (``PoolCapacityError``) once the
            pool reallocated, once a swap-in or ``miss_plan`` of another shape overwrote it, or once the state its
            swap-in ran on admitted, finished or re-laid a request slot (docs/pool.md §2).
        host_cache, device_buffer : Tensor
            This layer's KV rows (read; written at ``plan.dst``), laid out as the swap-in's.
        num_real_reqs : Tensor, optional
            Read on the device: ``[1]`` int32, rows from it on are graph padding.
        stream : torch.cuda.Stream, optional
            Run the copy on this side stream, after the work already queued on the current stream; the returned
            event marks its end: ``torch.cuda.current_stream().wait_event(event)`` before the layer reads
            ``device_buffer`` (inside graph capture too: the side stream must rejoin before capture ends).
        host_cache_v, device_buffer_v : Tensor, optional
            Both or neither: an MHA layer's V rows beside its K rows (``host_cache``/``device_buffer``), each with its
            K twin's shape, dtype and row stride. Each entry copies its K row and its V row in one pass: the plan of
            :meth:`swap_in_blocks` (or of any single-step swap-in) replayed into another layer's K and V caches.

        Returns
        -------
        torch.cuda.Event or None
            The side stream's end event (``None`` without ``stream``).
        """
        if stream is not None and self.device.type != "cuda":
            raise ValueError(f"pool.replay: stream= needs a CUDA pool, this pool is on {self.device}")
        buffers = self._replay_buffers(plan)
        records = self._records()
        # the copy's one record, handed to the checked mode and down kvplan.ops to the launch
        call = CopyCall(plan, host_cache, device_buffer, num_real_reqs, buffers.counters, REPLAY_COPY_BASE,
                        buffers.workspace, host_cache_v, device_buffer_v)  # fmt: skip

        def copy() -> None:
            _ops().run_copy(call, launch_records=records)

        def launch() -> torch.cuda.Event | None:
            if stream is None:
                copy()
                return None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                copy()
                done = torch.cuda.Event()
                done.record(stream)
            return done

        if not checked.checking(self.config):
            return launch()
        return checked.replay(launch, call)

    def materialize(
        self,
        kv: Tensor,
        k_norm_weight: Tensor,
        eps: Tensor | float | Sequence[float],
        cos_sin_cache: Tensor,
        positions: Tensor,
        *,
        rotary_dim: int,
        check_positions: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Fused RMSNorm+RoPE KV materialization (docs/kernels.md §5) into the pool's slabs.

        Takes the arguments of :func:`kvplan.kernels.materialize`; ``num_kv_heads``, ``head_dim`` and the outputs are
        the pool's geometry and slabs. ``eps`` is a ``[n_layers]`` float32 tensor, or (as ``FusedKVMaterializer`` takes
        it) one float or one per layer, kept on the device after the first call with those values (pass a tensor when
        the first call is captured in a CUDA graph). ``check_positions=True`` refuses positions outside
        ``cos_sin_cache`` on the host (a device synchronisation: not while capturing); without it they are clamped in
        the kernel. Needs ``ensure_capacity(..., total_ctx=T)`` first.

        Returns
        -------
        (Tensor, Tensor)
            The ``[n_layers, total_ctx, H, D]`` slab views it wrote (``total_ctx = kv.shape[0]``).
        """
        if not isinstance(kv, Tensor):
            raise TypeError(f"pool.materialize: kv must be a torch.Tensor, got {type(kv).__name__}")
        g = self.geometry
        if g is None:
            raise ValueError(
                "pool.materialize: this pool has no materialize slabs; build it with "
                "geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
            )
        if not isinstance(eps, Tensor):  # one float for every layer, or one per layer, as the materializer takes it
            eps = self._eps_tensor(eps)

        def engines_texts() -> None:
            """The engines' texts first (docs/kernels.md §6): an input breaking one reports it, not the pool's own
            refusal (run only on the way to one, so the steady path pays nothing for it)."""
            from kvplan.validate import check_materialize

            check_materialize(kv, k_norm_weight, eps, cos_sin_cache, positions, g.num_kv_heads, g.head_dim, rotary_dim)

        if kv.dim() != 3:
            engines_texts()
        if kv.shape[1] != g.n_layers or kv.dtype != g.dtype or kv.device != self.device:
            engines_texts()  # (at T == 0 they pass: a kv of another model is still refused, even without tokens)
            raise ValueError(
                f"pool.materialize: kv must be [total_ctx, {g.n_layers}, {2 * g.num_kv_heads * g.head_dim}] "
                f"{g.dtype} on {self.device}, the pool's geometry {g!r}; got shape {tuple(kv.shape)} {kv.dtype} on "
                f"{kv.device}. Materialize a draft model of the pool's geometry, or build the pool with this one."
            )
        try:
            k_out, v_out = self.kv_out(kv.shape[0], _call="pool.materialize")
        except PoolCapacityError:
            engines_texts()
            raise
        # the materialize's one record, handed to the checked mode and down kvplan.ops to the launch
        call = MaterializeCall(kv, k_norm_weight, eps, cos_sin_cache, positions, g.num_kv_heads, g.head_dim, rotary_dim,
                               k_out, v_out, check_positions)  # fmt: skip

        def launch() -> tuple[Tensor, Tensor]:
            return _ops().run_materialize(call, launch_records=self._records())

        if not checked.checking(self.config):
            return launch()
        return checked.materialize(launch, call)

    def _records(self) -> LaunchCache | None:
        """The pool's launch records (made on the first launch, sized by ``config.launch_records``, relaunching under
        ``config.launch_replay``). ``None``, every call checked and launched: while dynamo traces (the traced ops
        record nothing), and when the policy is ``"off"`` or ``config.launch_records`` is 0."""
        if torch.compiler.is_compiling():
            return None
        records = self._launch_records
        if records is None:
            config = self.config
            if config.launch_replay == "off" or config.launch_records == 0:
                return None
            from kvplan.runtime.launch_replay import LaunchCache

            records = self._launch_records = LaunchCache(limit=config.launch_records, replay=config.launch_replay)
        return records

    def _eps_tensor(self, eps: float | Sequence[float]) -> Tensor:
        """``eps`` as the kernel's ``[n_layers]`` float32 tensor on the pool's device (checked as the materializer
        checks it), made once per distinct value and kept by the pool (at most 64 values)."""
        from kvplan.validate.arguments import eps_per_layer

        n_layers = self.geometry.n_layers
        if _is_array(eps):  # a NumPy array: its values, as the materializer takes them
            eps = [float(e) for e in eps.reshape(-1)] if eps.ndim else float(eps)
        try:
            key = (type(eps), tuple(eps) if isinstance(eps, Sequence) else eps)
            tensor = self._eps.get(key)
        except TypeError:  # not hashable: converted every call
            return eps_per_layer(eps, n_layers).to(self.device)
        if tensor is None:
            tensor = eps_per_layer(eps, n_layers).to(self.device)
            if len(self._eps) >= 64:
                self._eps.clear()
            self._eps[key] = tensor
        return tensor

    # ---------------------------------------------------------------------------------------------------------------
    # The plan handed out and the replay guard

    def miss_plan(self, batch: int, num_steps: int, top_k: int) -> MissPlan:
        """The plan views of exactly ``[batch, num_steps * top_k]`` (src, dst) and ``[batch]`` (count). Handing them
        out counts as writing them: ``replay`` then refuses plans of another shape (docs/pool.md §2)."""
        plan = self._swap_in_view("plans", self._cut_plan, batch, num_steps, top_k, call="miss_plan")
        # (the requests of the last swap-in stay recorded: a view of its shape is its plan, and handing it out must not
        # make a plan whose requests changed replayable again)
        live = self._live_plan
        if live is not None and live.generation == plan.generation and _same_views(plan, live):
            self._live_handles = [*self._live_handles[-15:], plan]  # the same views: earlier handles keep holding
        else:
            self._live_handles = [plan]
        self._live_plan, self._live_workspace = plan, None
        return plan

    def _launch_buffers(self, batch: int, num_steps: int, top_k: int) -> LaunchBuffers:
        """The buffers a swap-in of ``(batch, num_steps, top_k)`` writes, for a launch: the plan handed back, the
        plan the kernel writes (the same eagerly), the workspace and the counters (:meth:`_wrote` records them once
        the launch ran). ``PoolCapacityError`` names the ``ensure_capacity(...)`` call to make."""
        if torch.compiler.is_compiling():
            self._traced = True
            return self._traced_launch_buffers(batch, num_steps, top_k)
        buffers = self._gen.launches.get((batch, num_steps, top_k))
        if buffers is None:
            gen = self._gen
            b, s, k, _ = check_request(batch, num_steps, top_k, 0, self.geometry, call="swap-in launch")
            plan = self._swap_in_view("plans", self._cut_plan, b, s, k, call="swap-in launch")  # miss_plan's object
            workspace = self._swap_in_view("workspaces", self._cut_workspace, b, s, k, call="swap-in launch")
            buffers = LaunchBuffers(plan, plan, workspace, self.counters)
            _remember(gen.launches, (b, s, k), buffers)
        return buffers

    def _wrote(self, buffers: LaunchBuffers, hot_state: object) -> MissPlan:
        """A swap-in on ``hot_state`` (its ``HotBufferState``) ran into ``buffers``: a handle of this swap-in's own over
        the cached views becomes the plan ``replay`` accepts, until the pool's next swap-in and for as long as the
        requests of ``hot_state``'s tables stay (``HotBufferState.epoch``, one record per tables, whichever wrapper
        changes them); this step's replays read the workspace's record of shared host rows (and of padding rows).
        Returns the handle. Nothing is recorded while dynamo traces (compiled calls skip it)."""
        if torch.compiler.is_compiling():
            return buffers.plan
        view = buffers.plan
        handle = traceable_plan(view.src, view.dst, view.count, view.generation)
        self._live_plan, self._live_handles, self._live_workspace = handle, [handle], buffers.workspace
        requests = self._live_requests = getattr(hot_state, "lifecycle", None)
        self._live_epoch = None if requests is None else requests.epoch
        return handle

    def _traced_launch_buffers(self, batch: int, num_steps: int, top_k: int) -> LaunchBuffers:
        """``launch_buffers`` as dynamo traces it: views sliced from this generation's storage, no per-shape cache.

        The sizes may be symbolic (a dynamic batch): a cache keyed by them would pin them to constants and recompile
        per batch. Dynamo turns the capacity check into a guard (``batch * columns <= capacity``) on the compiled
        graph, so a shape beyond the pool's capacity re-traces and is refused with ``PoolCapacityError`` (reported by
        dynamo as ``Unsupported`` under ``fullgraph=True``), and a growth (new storage sizes) recompiles.

        The kernel writes the whole count buffer's view (the kernels take ``[>= batch]`` and write rows ``< batch``
        only): functionalization compares a mutated 1-D view's length with its base's, which would give
        ``batch == capacity`` a graph of its own.
        """
        gen = self._gen
        plan = self._cut_plan(gen, batch, num_steps, top_k, call="swap-in launch")
        kernel_plan = traceable_plan(
            src=plan.src, dst=plan.dst, count=gen.buffers["miss_count"].storage, generation=gen.generation
        )
        workspace = self._cut_workspace(gen, batch, num_steps, top_k, call="swap-in launch")
        return LaunchBuffers(plan, kernel_plan, workspace, self.counters)

    def _replay_buffers(self, plan: MissPlan) -> ReplayBuffers:
        """What a replay of ``plan`` takes: the counters and the workspace of the
        swap-in that wrote it. Refuses (``PoolCapacityError``) a plan of an older generation or one another shape's
        swap-in or ``miss_plan`` overwrote, or one whose swap-in's state has admitted, finished or re-laid a request
        slot since (``HotBufferState.epoch``: its rows may be another request's); ``TypeError`` for anything but a
        ``MissPlan``."""
        if torch.compiler.is_compiling():  # the generation only (launches while tracing do not record the live plan)
            if not isinstance(plan, MissPlan) or plan.generation != self._gen.generation:
                self._check_replayable(plan)
            return ReplayBuffers(self.counters, None)
        if self._traced:
            raise PoolCapacityError(
                "pool.replay: this pool's swap-ins also run compiled (torch.compile), and compiled calls skip the "
                "pool's record of the plan each swap-in wrote: an eager replay cannot tell whose rows the plan storage "
                "holds. Replay inside the compiled step (docs/compile.md), or give eager steps a pool of their own."
            )
        if plan is not self._live_plan or plan.generation != self._gen.generation:
            self._check_replayable(plan)  # eagerly: two attribute reads when it is the plan last handed out
        requests = self._live_requests
        if requests is not None and requests.epoch != self._live_epoch:
            raise PoolCapacityError(
                f"pool.replay: the plan's requests changed since its swap-in: the HotBufferState it ran on admitted, "
                f"finished or re-laid a request slot since (epoch {self._live_epoch} -> {requests.epoch}), so its "
                "rows may be another request's now. Replay a step's plan before changing the state's requests."
            )
        return ReplayBuffers(self.counters, self._live_workspace)

    def _check_replayable(self, plan: object) -> None:
        """Refuse a plan whose rows are not what the pool's plan storage holds, or adopt one laid out exactly like
        the live plan (the same views: e.g. ``[2, 8]`` from ``(2, 1, 8)`` and from ``(2, 2, 4)``)."""
        if not isinstance(plan, MissPlan):
            raise TypeError(f"pool.replay: plan must be the MissPlan a pool launch returned, got {type(plan).__name__}")
        gen = self._gen
        if plan.generation != gen.generation:
            raise PoolCapacityError(
                f"pool.replay: the plan is from generation {plan.generation}, the pool is at generation "
                f"{gen.generation}: the pool grew since the swap-in that wrote it, so its buffers moved. "
                "Replay the plan of this step's swap-in."
            )
        if torch.compiler.is_compiling():
            return
        live = self._live_plan
        same = live is not None and live.generation == gen.generation and _same_views(plan, live)
        if same and any(plan is handle for handle in self._live_handles):
            self._live_plan = plan
            return
        given = _plan_shape_text(plan)
        if live is None or live.generation != gen.generation:
            raise PoolCapacityError(
                f"pool.replay: the plan ({given}) is not a plan this pool handed out in generation {gen.generation}; "
                "replay the MissPlan this step's pool.swap_in returned."
            )
        if same:
            raise PoolCapacityError(
                f"pool.replay: the plan ({given}) is not the handle of the pool's latest swap-in: a plan is good until "
                "the pool's next swap-in, and a later one (here of the same shape, into the same views) rewrote its "
                "rows. Replay a step's plan before the next swap-in; a layer that needs it later replays a copy "
                "(MissPlan(plan.src.clone(), plan.dst.clone(), plan.count.clone())) with kvplan.kernels.copy_planned."
            )
        raise PoolCapacityError(
            f"pool.replay: the plan ({given}) no longer holds its swap-in's rows: plans of every shape share the "
            f"pool's plan storage, and a later swap-in (or miss_plan view) of {_plan_shape_text(live)} overwrote it. "
            "Replay a plan before the pool's next swap-in of another shape (the plan of this step's swap-in)."
        )

    # ---------------------------------------------------------------------------------------------------------------
    # Counters and stats

    def reset_counters(self) -> None:
        """Zero the device counters (stream-ordered, no synchronisation)."""
        self.counters.zero_()

    @property
    def overflow(self) -> Tensor:
        """The tokens speculative swap-ins have dropped so far (output ``-1`` for want of a hot slot or scratch row),
        as a 0-dim int64 tensor on the pool's device, updated by the kernels: the per-step overflow signal without a
        synchronisation. Snapshot it after a step (``seen = pool.overflow.clone()``) and compare later, or copy it
        to pinned memory with ``non_blocking=True``; ``int(pool.overflow)`` synchronises. Size the state's scratch
        rows with ``kvplan.sizing.scratch_rows(hot, steps, top_k)`` and it stays 0."""
        return self.counters[OVERFLOW]

    def stats(self) -> PoolStats:
        """A snapshot; reads the device counters (the pool's only host synchronisation). Its flat ``as_dict()`` keys
        are listed by ``kvplan.stats.stat_keys`` and documented in docs/pool.md §5."""
        counters = DeviceCounters(**read_counters(self.counters))
        records = self._launch_records
        with self._lock:
            gen = self._gen
            used = buffer_shapes(self.geometry, *self._last)
            buffers = []
            for name, buffer in gen.buffers.items():
                rule = buffer.rule
                buffers.append(
                    BufferStats(
                        name=name,
                        reserved_bytes=buffer.nbytes,
                        peak_bytes=self._peak_bytes[name],
                        used_bytes=min(_numel(used[name]), buffer.numel) * rule.dtype.itemsize,
                        capacity=buffer_capacity(rule, buffer.rows, buffer.cols, used[name]),
                        grow_events=self._grow_events[name],
                    )
                )
            return PoolStats(
                generation=gen.generation,
                frozen=self._frozen,
                reserved_bytes=gen.nbytes,
                peak_bytes=self._total_peak,
                used_bytes=sum(b.used_bytes for b in buffers),
                budget_bytes=self.config.max_bytes,
                grow_events=self._total_grow_events,
                trim_events=self._trim_events,
                grow_causes=GrowthCauses(**self._causes),
                buffers=tuple(buffers),
                counters=counters,
                launch_records=0 if records is None else len(records),
                launch_graphs=0 if records is None else records.graphs(),
                relaunches=0 if records is None else records.relaunches,
            )

    def __repr__(self) -> str:
        gen = self._gen
        return (
            f"PlanBufferPool(device={self.device}, growth={self.config.growth!r}, generation={gen.generation}, "
            f"reserved={_size(gen.nbytes)}, frozen={self._frozen})"
        )


def _is_array(value: object) -> bool:
    """A NumPy array (without importing NumPy when the caller has not)."""
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _ops():
    """``kvplan.ops``, imported on the first launch (it imports the kernels, and so Triton: a pool is built before the
    engine has settled ``TRITON_INTERPRET``)."""
    global _OPS
    if _OPS is None:
        import kvplan.ops

        _OPS = kvplan.ops
    return _OPS


_OPS = None
