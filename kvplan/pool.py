"""PlanBufferPool: one per GPU worker; owns the step-scoped buffers, grows them, and hands out views of exact shapes.

Before each step the engine calls ``ensure_capacity(batch=, num_steps=, top_k=, total_ctx=)``; then it takes views
(``miss_plan``, ``workspace``, ``kv_out``) or launches kernels through the pool (``swap_in``, ``replay``,
``materialize``: each takes the pool's buffers for its shape and calls ``kvplan.ops``, one way down). A view of a
shape the pool was not sized for raises ``PoolCapacityError``: a short or wrong view is never returned.

Design, in short:

- Each buffer is flat storage viewed ``[rows, cols]`` (see ``kvplan.sizing``), so a steps or top_k change re-lays the
  plan rows over the same bytes; ``miss_src`` and ``miss_dst`` always share one row stride.
- All buffers of one generation, and the views cut from them, live in one ``_Generation`` that a reallocation replaces
  as a whole. Views are cached per shape in that generation, so the steady state is a dict lookup: no allocation, no
  device synchronisation, no lock, every data pointer and ``generation`` kept.
- Growth takes a lock, re-checks, allocates every new buffer before dropping any old one, and publishes the new
  generation with one assignment. A refusal (frozen, capturing, over budget, allocation failure) leaves everything as
  it was.

Threads: one pool belongs to one worker, but concurrent calls cannot corrupt it. Views returned before a growth
(including one triggered by another thread) stay valid memory but are stale: compare ``MissPlan.generation`` (or
data pointers) with ``pool.generation``. ``trim()`` concurrent with a step can make that step's next view fetch raise
``PoolCapacityError``; it never makes it return a short view.

Contents are step-scoped: nothing in the plan buffers, the workspace or the KV slabs is promised across an
``ensure_capacity`` call that grows (growth does not copy). Counters live in ``pool.counters``, allocated once and
never reallocated.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, NamedTuple

import attrs
import torch
from torch import Tensor

from kvplan import checked
from kvplan.config import MAX_TENSOR_BYTES, MaterializeGeometry, PoolConfig, as_int
from kvplan.counters import OVERFLOW, new_counters, read_counters
from kvplan.errors import PoolBudgetError, PoolCapacityError, PoolFrozenError
from kvplan.plan import MissPlan, traceable_plan
from kvplan.sizing import (
    BATCH,
    COLUMNS,
    CONTEXT,
    BufferRule,
    Request,
    buffer_rules,
    buffer_shapes,
    check_request,
    grow_extent,
)
from kvplan.sizing import required_bytes as _required_bytes
from kvplan.state import HotBufferState
from kvplan.stats import BufferStats, DeviceCounters, GrowthCauses, PoolStats, buffer_capacity
from kvplan.workspace import forget_tables, swap_in_workspace_columns

if TYPE_CHECKING:
    from kvplan.kernels.launch_cache import LaunchCache

__all__ = ["MissPlan", "PlanBufferPool"]

log = logging.getLogger("kvplan")

_CACHE_LIMIT = 1024  # shapes cached per generation and kind; engines cycle through far fewer


def _int_types() -> frozenset[type]:
    """Types the steady-state lookups take as they are: int, and NumPy's integers (equal and hashing like ints)."""
    try:
        import numpy as np
    except ImportError:
        return frozenset({int})
    return frozenset({int, *(np.dtype(c).type for c in np.typecodes["AllInteger"])})


_INTS = _int_types()


@attrs.frozen(eq=False)
class _Buffer:
    """One buffer of one generation: flat storage holding exactly ``rows * cols`` elements."""

    rule: BufferRule
    storage: Tensor
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.rule.dtype.itemsize


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


class _Generation:
    """All buffers of one generation and the views cut from them; replaced whole, never mutated but for caches."""

    __slots__ = (
        "buffers",
        "generation",
        "nbytes",
        "fits",
        "plans",
        "workspaces",
        "kv",
        "kv_proj",
        "launches",
    )

    def __init__(self, buffers: dict[str, _Buffer], generation: int) -> None:
        self.buffers = buffers
        self.generation = generation
        self.nbytes = sum(b.nbytes for b in buffers.values())
        self.fits: dict[Request, Request] = {}  # ensure_capacity requests known to fit -> the same as plain ints
        self.plans: dict[tuple[int, int, int], MissPlan] = {}
        self.workspaces: dict[tuple[int, int, int], Tensor] = {}
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.kv_proj: dict[int, Tensor] = {}
        self.launches: dict[tuple[int, int, int], LaunchBuffers] = {}


def _remember(cache: dict | set, key, value=None) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    if isinstance(cache, set):
        cache.add(key)
    else:
        cache[key] = value


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


def _count(n: int) -> str:
    """An int as is, or in E notation once it has more than 18 digits (growth factors can make sizes astronomic)."""
    return str(n) if n < 10**18 else f"{Decimal(n):.3E}"


def _size(nbytes: int) -> str:
    if nbytes < 1 << 20:
        return f"{nbytes} B"
    if nbytes >= 1 << 80:  # beyond any device; printed short (a float would overflow past ~1e308)
        return f"{_count(nbytes)} B"
    return f"{nbytes} B ({nbytes / (1 << 20):.1f} MiB)"


def _call(name: str, request: Request) -> str:
    batch, num_steps, top_k, total_ctx = request
    return f"{name}(batch={batch}, num_steps={num_steps}, top_k={top_k}, total_ctx={total_ctx})"


def _resolve_device(device: object) -> torch.device:
    index = as_int(device)
    if index is not None:
        device = index
    elif not isinstance(device, (str, torch.device)):
        raise TypeError(f"PlanBufferPool: device must be a torch.device, str or int, got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"PlanBufferPool: device must name a torch device (e.g. 'cuda:0'), got {device!r}") from exc
    if resolved.type == "cpu" and resolved.index not in (None, 0):  # (every CPU tensor is on 'cpu', index-less)
        raise ValueError(
            f"PlanBufferPool: device={device!r} holds no memory the kernels can use: give a CUDA device, or 'cpu' "
            "(no index) for Triton's interpreter"
        )
    if resolved.type not in ("cpu", "cuda"):  # a meta pool was built, then stats() failed inside torch
        why = "a meta tensor has no data" if resolved.type == "meta" else "the kernels run on CUDA or the CPU"
        raise ValueError(
            f"PlanBufferPool: device={device!r} holds no memory the kernels can use ({why}; stats() and every launch "
            "read the pool's buffers): give a CUDA device, or 'cpu' (no index) for Triton's interpreter"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"PlanBufferPool: device={device!r} needs CUDA, but no CUDA device is available")
        if resolved.index is None:  # pin 'cuda' to a device now; later allocations never follow the current device
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"PlanBufferPool: device={device!r} names CUDA device {resolved.index}, but only "
                f"{torch.cuda.device_count()} are visible"
            )
    return resolved


class PlanBufferPool:
    """Step-scoped buffers for one GPU worker: the HiSparse miss plan, the swap-in workspace, the fused-KV slabs.

    Parameters
    ----------
    device : torch.device, str or int
        Where every buffer lives (``'cuda'`` is pinned to the current device at construction).
    geometry : MaterializeGeometry, optional
        The draft model's KV slab geometry; without it the pool has no slabs and refuses ``total_ctx > 0``.
    config : PoolConfig, optional
        The growth policy and byte budget.
    """

    def __init__(
        self,
        device: torch.device | str | int,
        *,
        geometry: MaterializeGeometry | None = None,
        config: PoolConfig | None = None,
    ) -> None:
        if geometry is not None and not isinstance(geometry, MaterializeGeometry):
            raise TypeError(
                f"PlanBufferPool: geometry must be a MaterializeGeometry or None, got {type(geometry).__name__}"
            )
        if config is not None and not isinstance(config, PoolConfig):
            raise TypeError(f"PlanBufferPool: config must be a PoolConfig or None, got {type(config).__name__}")
        self.device = _resolve_device(device)
        self.geometry = geometry
        self.config = PoolConfig() if config is None else config
        self._lock = threading.Lock()
        self._frozen = False
        # The device counter vector: allocated once, survives every growth, read only by stats().
        self.counters = new_counters(self.device)
        rules = buffer_rules(geometry)
        empty = {rule.name: _Buffer(rule, self._allocate(0, rule.dtype), 0, 0) for rule in rules}
        self._gen = _Generation(empty, generation=0)
        self._last: Request = (0, 1, 0, 0)  # the previous step's request: trim target, growth causes, used bytes
        self._reserved: Request = (0, 1, 0, 0)  # elementwise max of reserve() calls: what reserve sizes for
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
        # The eager launches' records (a call laid out like a recorded one relaunches it; CUDA graphs from the second
        # relaunch): the pool's, so stats() counts them and a growth or trim drops them with the buffers they name.
        # (made on the first launch: the kernels package imports Triton, which a pool of its own does not)
        self._launch_records: LaunchCache | None = None
        self._reserved_shapes = {rule.name: (0, 0) for rule in rules}  # trim floor per buffer
        # Statistics, changed only under the lock and only when a reallocation commits.
        self._peak_bytes = dict.fromkeys(empty, 0)
        self._total_peak = 0
        self._grow_events = dict.fromkeys(empty, 0)
        self._total_grow_events = 0
        self._trim_events = 0
        self._causes = dict.fromkeys(attrs.fields_dict(GrowthCauses), 0)

    # ---------------------------------------------------------------------------------------------------------------
    # Launches against the pool's buffers: the pool takes its buffers and calls ``kvplan.ops`` (the kernels eagerly,
    # the custom ops while dynamo traces); checked mode wraps the launch when on. Nothing below calls back up.

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

        def launch() -> MissPlan:
            _ops().swap_in(
                state, top_k_tokens, top_k_device_locs, req_pool_indices, seq_lens, host_cache, device_buffer,
                num_real_reqs=num_real_reqs, plan=buffers.kernel_plan, workspace=buffers.workspace,
                counters=buffers.counters, speculative=spec, launch_records=self._records(), check_newest=check_newest,
            )  # fmt: skip
            # only once the launch ran: a refused call leaves the last record as it was; this swap-in's own handle
            return self._wrote(buffers, state)

        if not checked.checking(self.config):
            return launch()
        return checked.swap_in(
            launch, buffers.kernel_plan, state, top_k_tokens, top_k_device_locs, device_buffer, buffers.counters, spec,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, host_cache=host_cache, num_real_reqs=num_real_reqs,
            check_newest=check_newest,
        )  # fmt: skip

    def _refuse_device_buffer(self, state: HotBufferState, device_buffer: Tensor, need: int, spec: bool,
                              *inputs: Tensor | None) -> None:  # fmt: skip
        """A ``device_buffer`` with fewer rows than the state's tables name: the engines' texts first (an argument
        breaking one reports it), then kvplan's refusal."""
        from kvplan.calls import swap_in_call
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

        Returns
        -------
        torch.cuda.Event or None
            The side stream's end event (``None`` without ``stream``).
        """
        if stream is not None and self.device.type != "cuda":
            raise ValueError(f"pool.replay: stream= needs a CUDA pool, this pool is on {self.device}")
        buffers = self._replay_buffers(plan)
        records = self._records()

        def copy() -> None:
            _ops().copy_planned(plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=buffers.counters,
                                workspace=buffers.workspace, launch_records=records)  # fmt: skip

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
        return checked.replay(launch, plan, host_cache, device_buffer, num_real_reqs, buffers.workspace)

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
        inputs = dict(kv=kv, k_norm_weight=k_norm_weight, eps=eps, cos_sin_cache=cos_sin_cache, positions=positions,
                      num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, rotary_dim=rotary_dim,
                      check_positions=check_positions)  # fmt: skip

        def launch() -> tuple[Tensor, Tensor]:
            return _ops().materialize(**inputs, k_out=k_out, v_out=v_out, launch_records=self._records())

        if not checked.checking(self.config):
            return launch()
        return checked.materialize(launch, **inputs)

    def _records(self) -> LaunchCache | None:
        """The pool's launch records (made on the first launch, sized by ``config.launch_records``); ``None`` while
        dynamo traces (the traced ops record into the kernels' own)."""
        if torch.compiler.is_compiling():
            return None
        records = self._launch_records
        if records is None:
            from kvplan.kernels.launch_cache import LaunchCache

            records = self._launch_records = LaunchCache(limit=self.config.launch_records)
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
    # Sizing

    def ensure_capacity(self, *, batch: int, num_steps: int = 1, top_k: int = 0, total_ctx: int = 0) -> bool:
        """Grow whatever is too small for this step; True when something was reallocated.

        Steady state (the shape fits) is a dict lookup: it allocates nothing, never synchronises and keeps every data
        pointer. Growth follows ``config.growth``; refused while frozen or capturing (``PoolFrozenError``) or over
        budget / on allocation failure (``PoolBudgetError``), leaving the pool unchanged. Buffer contents are not
        kept across a growth.
        """
        key = (batch, num_steps, top_k, total_ctx)
        if type(batch) in _INTS and type(num_steps) in _INTS and type(top_k) in _INTS and type(total_ctx) in _INTS:
            request = self._gen.fits.get(key)  # NumPy ints hash and compare like the ints they hold
            if request is not None:
                self._last = request
                return False
        return self._ensure_slow(key)

    def _ensure_slow(self, key: tuple) -> bool:
        request = check_request(*key, self.geometry, call="ensure_capacity")
        shapes = buffer_shapes(self.geometry, *request)
        _check_extents(shapes, request, _call("ensure_capacity", request))
        gen = self._gen
        if not self._short(gen, shapes):
            self._fitted(gen, request)  # the generation checked, never a newer (possibly trimmed) one
            return False
        with self._lock:
            gen = self._gen  # re-check: another thread may have grown the pool meanwhile
            short = self._short(gen, shapes)
            if not short:
                self._fitted(gen, request)
                return False
            call = _call("ensure_capacity", request)
            self._refuse_if_frozen(gen, shapes, short, request, call)
            targets = self._growth(gen, shapes, exact=False)
            if self._over_budget(gen, targets):
                targets = self._growth(gen, shapes, exact=True)  # near the budget, exact sizes may still fit
            self._check_budget(gen, targets, call)
            new_gen = self._reallocate(gen, targets, call)
            causes = self._growth_causes(gen, request, targets)
            self._commit(gen, new_gen, targets, event="grow", causes=causes)
            self._fitted(new_gen, request)
            buckets = self.config.batch_buckets
            above_buckets = bool(buckets) and any(  # a batch dimension grew past the largest bucket
                gen.buffers[name].rule.row_extent == BATCH and rows > max(gen.buffers[name].rows, buckets[-1])
                for name, (rows, _) in targets.items()
            )
        if above_buckets:
            log.warning(
                "kvplan pool %s: batch %d is above the largest batch bucket %d; grew geometrically "
                "(add the batch size to PoolConfig.batch_buckets if it is a CUDA-graph size)",
                self.device,
                request[0],
                buckets[-1],
            )
        return True

    def reserve(self, *, batch: int, num_steps: int = 1, top_k: int = 0, total_ctx: int = 0) -> bool:
        """Size every buffer to hold exactly the elementwise maximum of these and all earlier reservations (no
        policy rounding; never shrinks), before capture or memory profiling: an engine reserving its decode and its
        speculative maxima in two calls gets both. True when something was reallocated. ``trim()`` never goes below
        what was reserved. A refused reservation is not recorded."""
        request = check_request(batch, num_steps, top_k, total_ctx, self.geometry, call="reserve")
        _check_extents(buffer_shapes(self.geometry, *request), request, _call("reserve", request))
        with self._lock:
            combined = tuple(max(a, b) for a, b in zip(self._reserved, request))
            call = _call("reserve", request)
            if combined != request:
                call += f" (with earlier reservations: {_call('reserve', combined)})"
            shapes = buffer_shapes(self.geometry, *combined)
            _check_extents(shapes, combined, call)
            gen = self._gen
            short = self._short(gen, shapes)
            if short:
                self._refuse_if_frozen(gen, shapes, short, combined, call)
                targets = {name: shapes[name] for name in short}
                self._check_budget(gen, targets, call)
                new_gen = self._reallocate(gen, targets, call)
                self._commit(gen, new_gen, targets, event="reserve", causes=("reserve",))
            for name, shape in shapes.items():
                if _numel(shape) > _numel(self._reserved_shapes[name]):
                    self._reserved_shapes[name] = shape
            self._reserved = combined
        return bool(short)

    def required_bytes(
        self, *, batch: int, num_steps: int = 1, top_k: int = 0, total_ctx: int = 0, worst_case_growth: bool = False
    ) -> int:
        """Bytes ``reserve(...)`` of these maxima takes on a fresh pool of this config and geometry (allocates
        nothing); ``worst_case_growth=True`` bounds ``ensure_capacity`` growth instead (see ``kvplan.sizing``)."""
        return _required_bytes(
            self.config,
            self.geometry,
            batch=batch,
            num_steps=num_steps,
            top_k=top_k,
            total_ctx=total_ctx,
            worst_case_growth=worst_case_growth,
        )

    def trim(self) -> bool:
        """Shrink every buffer to what the last step used (or what was reserved, if more); True when something
        shrank. Refused while frozen or capturing: it reallocates."""
        with self._lock:
            reason = self._growth_refusal()
            if reason is not None:
                raise PoolFrozenError(
                    f"trim() refused: {reason}; trimming reallocates buffers a captured CUDA graph may point at. "
                    "Call it after unfreeze(), outside graph capture."
                )
            gen = self._gen
            used = buffer_shapes(self.geometry, *self._last)
            targets = {}
            for name, buffer in gen.buffers.items():
                keep = max(used[name], self._reserved_shapes[name], key=_numel)
                if _numel(keep) < buffer.numel:
                    targets[name] = keep
            if not targets:
                return False
            new_gen = self._reallocate(gen, targets, "trim()")
            self._commit(gen, new_gen, targets, event="trim", causes=())
        return True

    def freeze(self) -> None:
        """Refuse every later growth with ``PoolFrozenError`` (call after ``reserve``/warm-up, before capture)."""
        self._frozen = True

    def unfreeze(self) -> None:
        """Allow growth again (only once no captured graph points at the current buffers)."""
        self._frozen = False

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def generation(self) -> int:
        """Increases on every reallocation (growth, reserve, trim) and only then; views of older ones are stale."""
        return self._gen.generation

    # ---------------------------------------------------------------------------------------------------------------
    # Views

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

    def workspace(self, batch: int, num_steps: int, top_k: int) -> Tensor:
        """The swap-in resolve scratch: int64 ``[batch, swap_in_workspace_columns(num_steps, top_k)]``."""
        return self._swap_in_view("workspaces", self._cut_workspace, batch, num_steps, top_k, call="workspace")

    # ---------------------------------------------------------------------------------------------------------------
    # What a launch takes from the pool

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

    def _swap_in_view(
        self, cache_name: str, cut: Callable, batch: int, num_steps: int, top_k: int, *, call: str
    ) -> MissPlan | Tensor:
        """A swap-in shape's view from this generation's cache ``cache_name``, cut (checked) on first use."""
        if type(batch) in _INTS and type(num_steps) in _INTS and type(top_k) in _INTS:
            view = getattr(self._gen, cache_name).get((batch, num_steps, top_k))
            if view is not None:
                return view
        b, s, k, _ = check_request(batch, num_steps, top_k, 0, self.geometry, call=call)
        gen = self._gen
        cache = getattr(gen, cache_name)
        view = cache.get((b, s, k))
        if view is None:
            view = cut(gen, b, s, k, call=call)
            _remember(cache, (b, s, k), view)
        return view

    def kv_out(self, total_ctx: int, *, _call: str = "kv_out") -> tuple[Tensor, Tensor]:
        """``(k_out, v_out)``: contiguous ``[n_layers, total_ctx, num_kv_heads, head_dim]`` views of the slabs."""
        if torch.compiler.is_compiling():  # the token count may be symbolic: no per-shape cache, no int()
            return self._cut_kv(self._gen, total_ctx, call=_call)
        if self.geometry is None:
            raise ValueError(
                f"{_call}: this pool has no materialize slabs; build it with "
                "geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
            )
        return self._context_view("kv", self._cut_kv, total_ctx, call=_call)

    def kv_proj(self, total_ctx: int) -> Tensor:
        """The fused KV projection's ``[total_ctx, n_layers * 2 * num_kv_heads * head_dim]`` view: what a
        :class:`~kvplan.FusedKVMaterializer` on this pool writes its GEMM into (a pool built with
        ``MaterializeGeometry(..., projection=True)``)."""
        g = self.geometry
        if g is None or not g.projection:
            raise ValueError(
                "kv_proj: this pool holds no fused KV projection; build it with "
                "geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype, projection=True)"
            )
        return self._context_view("kv_proj", self._cut_kv_proj, total_ctx, call="kv_proj")

    def _context_view(self, cache_name: str, cut: Callable, total_ctx: int, *, call: str) -> Tensor | tuple:
        """A ``total_ctx`` view from this generation's cache ``cache_name``, cut (checked) on first use."""
        if type(total_ctx) in _INTS:
            view = getattr(self._gen, cache_name).get(total_ctx)
            if view is not None:
                return view
        _, _, _, ctx = check_request(0, 1, 0, total_ctx, self.geometry, call=call)
        gen = self._gen
        cache = getattr(gen, cache_name)
        view = cache.get(ctx)
        if view is None:
            view = cut(gen, ctx, call=call)
            _remember(cache, ctx, view)
        return view

    # Each view is cut from its own buffer's dimensions; a shape the buffer cannot hold is PoolCapacityError naming
    # the ensure_capacity call to make. They take ints or, while dynamo traces a launch, symbolic sizes.

    def _cut_plan(self, gen: _Generation, b: int, s: int, k: int, *, call: str) -> MissPlan:
        hint = (("batch", b), ("num_steps", s), ("top_k", k))  # formatted only on error (b may be symbolic)
        columns = s * k
        return traceable_plan(
            src=self._cut(gen, "miss_src", b, columns, call, hint),
            dst=self._cut(gen, "miss_dst", b, columns, call, hint),
            count=self._cut(gen, "miss_count", b, 1, call, hint),
            generation=gen.generation,
        )

    def _cut_workspace(self, gen: _Generation, b: int, s: int, k: int, *, call: str) -> Tensor:
        hint = (("batch", b), ("num_steps", s), ("top_k", k))
        return self._cut(gen, "workspace", b, swap_in_workspace_columns(s, k), call, hint)

    def _context_hint(self, ctx: int) -> tuple:
        """The ``ensure_capacity`` arguments that fit ``ctx`` tokens and keep the last step's batch, steps and top_k."""
        batch, num_steps, top_k, _ = self._last
        return (("batch", batch), ("num_steps", num_steps), ("top_k", top_k), ("total_ctx", ctx))

    def _cut_kv(self, gen: _Generation, ctx: int, *, call: str) -> tuple[Tensor, Tensor]:
        g, hint = self.geometry, self._context_hint(ctx)
        return tuple(
            self._cut(gen, name, ctx, g.elements_per_token, call, hint).view(
                g.n_layers, ctx, g.num_kv_heads, g.head_dim
            )
            for name in ("k_out", "v_out")
        )

    def _cut_kv_proj(self, gen: _Generation, ctx: int, *, call: str) -> Tensor:
        hint = self._context_hint(ctx)
        return self._cut(gen, "kv_proj", ctx, 2 * self.geometry.elements_per_token, call, hint)

    def _cut(self, gen: _Generation, name: str, rows: int, cols: int, call: str, hint: tuple) -> Tensor:
        """The ``[rows, cols]`` view of buffer ``name`` (flat for ``miss_count``), or ``PoolCapacityError``. ``hint``
        holds the ``ensure_capacity`` arguments to suggest, formatted only when raising (a format would pin a
        symbolic size while dynamo traces)."""
        buffer = gen.buffers[name]
        if cols > MAX_TENSOR_BYTES:  # fits no tensor, even at 0 rows
            raise PoolCapacityError(f"{call}: {name} would need {cols} columns, more than a tensor can hold.")
        if rows * cols > buffer.numel:
            arguments = ", ".join(f"{key}={value}" for key, value in hint)
            raise PoolCapacityError(
                f"{call}: the pool was not sized for this shape: {name} needs {rows * cols} elements "
                f"({rows} x {cols}), it holds {buffer.numel} (generation {gen.generation}). "
                f"Call pool.ensure_capacity({arguments}) before the step "
                "(or pool.reserve(...) with your maxima before graph capture)."
            )
        flat = buffer.storage[: rows * cols]
        return flat if name == "miss_count" else flat.view(rows, cols)

    # ---------------------------------------------------------------------------------------------------------------
    # Growth internals (callers hold the lock from _growth on)

    def _allocate(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Flat storage on the pool's device (never the current device). Tests replace it to simulate OOM."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    @staticmethod
    def _short(gen: _Generation, shapes: dict[str, tuple[int, int]]) -> list[str]:
        return [name for name, (rows, cols) in shapes.items() if rows * cols > gen.buffers[name].numel]

    def _fitted(self, gen: _Generation, request: Request) -> None:
        _remember(gen.fits, request, request)
        self._last = request

    def _growth(
        self, gen: _Generation, shapes: dict[str, tuple[int, int]], *, exact: bool
    ) -> dict[str, tuple[int, int]]:
        """New ``(rows, cols)`` of each buffer too small for ``shapes``. By the policy, only dimensions that are too
        small grow (the others keep their extent); ``exact``: the requested shape itself, the fewest elements that
        hold it (the budget's fallback: keeping an old extent, e.g. 8 rows when 1 is asked for, may not fit)."""
        targets = {}
        for name, (rows, cols) in shapes.items():
            buffer = gen.buffers[name]
            if rows * cols <= buffer.numel:
                continue
            if exact:
                targets[name] = (rows, cols)
                continue
            rule = buffer.rule
            new_rows = grow_extent(self.config, rule.row_extent, buffer.rows, rows)
            new_cols = grow_extent(self.config, rule.col_extent, buffer.cols, cols)
            targets[name] = (new_rows, new_cols)
        return targets

    def _new_total(self, gen: _Generation, targets: dict[str, tuple[int, int]]) -> int:
        total = gen.nbytes
        for name, shape in targets.items():
            buffer = gen.buffers[name]
            total += _numel(shape) * buffer.rule.dtype.itemsize - buffer.nbytes
        return total

    def _over_budget(self, gen: _Generation, targets: dict[str, tuple[int, int]]) -> bool:
        budget = self.config.max_bytes
        return budget is not None and self._new_total(gen, targets) > budget

    def _check_budget(self, gen: _Generation, targets: dict[str, tuple[int, int]], call: str) -> None:
        if not self._over_budget(gen, targets):
            return
        changes = ", ".join(
            f"{name} {_size(gen.buffers[name].nbytes)} -> "
            f"{_size(_numel(shape) * gen.buffers[name].rule.dtype.itemsize)}"
            for name, shape in targets.items()
        )
        raise PoolBudgetError(
            f"{call} would put the pool over its byte budget: {changes} takes it from {_size(gen.nbytes)} to "
            f"{_size(self._new_total(gen, targets))} reserved, over PoolConfig.max_bytes={self.config.max_bytes}. "
            "The pool is unchanged; raise max_bytes, lower the step's maxima, or trim() first."
        )

    def _growth_refusal(self) -> str | None:
        if self._frozen:
            return "the pool is frozen"
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                if torch.cuda.is_current_stream_capturing():
                    return "the current CUDA stream is capturing a graph"
        return None

    def _refuse_if_frozen(
        self, gen: _Generation, shapes: dict[str, tuple[int, int]], short: list[str], request: Request, call: str
    ) -> None:
        reason = self._growth_refusal()
        if reason is None:
            return
        needs = ", ".join(
            f"{name} needs {_size(_numel(shapes[name]) * gen.buffers[name].rule.dtype.itemsize)} "
            f"(holds {_size(gen.buffers[name].nbytes)})"
            for name in short
        )
        hint = _call("reserve", tuple(max(a, b) for a, b in zip(request, self._reserved)))
        raise PoolFrozenError(
            f"{call} cannot grow the pool: {reason}. {needs}. Growing would free memory a captured CUDA graph "
            f"still points at; call pool.{hint} with your largest shapes before freeze() and graph capture."
        )

    def _reallocate(self, gen: _Generation, targets: dict[str, tuple[int, int]], call: str) -> _Generation:
        """The next generation: new storage for ``targets``, the other buffers shared. Allocates every new buffer
        before any old one is dropped; on failure the new ones are released and nothing changed."""
        buffers = dict(gen.buffers)
        for name, (rows, cols) in targets.items():  # sizes no tensor can have: refused before anything is allocated
            rule = gen.buffers[name].rule
            nbytes = rows * cols * rule.dtype.itemsize
            if nbytes > MAX_TENSOR_BYTES:
                raise PoolBudgetError(
                    f"{call} would need {name} of {_size(nbytes)} ({_count(rows)} x {_count(cols)} {rule.dtype}), "
                    f"more than a tensor can hold ({MAX_TENSOR_BYTES} B): the pool holds {_size(gen.nbytes)}, budget "
                    f"{'none' if self.config.max_bytes is None else self.config.max_bytes}. The pool is unchanged; "
                    "lower the step's maxima (or PoolConfig.growth_factor)."
                )
        for name, (rows, cols) in targets.items():
            rule = gen.buffers[name].rule
            try:
                storage = self._allocate(rows * cols, rule.dtype)
            except (RuntimeError, MemoryError, OverflowError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                nbytes = rows * cols * rule.dtype.itemsize
                raise PoolBudgetError(
                    f"{call} could not allocate {name} ({_size(nbytes)}, {rows} x {cols} {rule.dtype}) on "
                    f"{self.device}: the pool holds {_size(gen.nbytes)}, budget "
                    f"{'none' if self.config.max_bytes is None else self.config.max_bytes}. The pool is unchanged; "
                    f"free device memory or lower the step's maxima. ({type(exc).__name__}: {exc})"
                ) from exc
            buffers[name] = _Buffer(rule, storage, rows, cols)
        if "workspace" in targets:  # new storage may hold an earlier workspace's words: they vouch for nothing now
            forget_tables(buffers["workspace"].storage)
        return _Generation(buffers, gen.generation + 1)

    def _growth_causes(
        self, gen: _Generation, request: Request, targets: dict[str, tuple[int, int]]
    ) -> tuple[str, ...]:
        """What outgrew the previous step, among the dimensions that size the grown buffers."""
        last = self._last
        extents = set()
        for name in targets:
            rule = gen.buffers[name].rule
            extents.update((rule.row_extent, rule.col_extent))
        candidates = []
        if BATCH in extents:
            candidates.append(("batch", request[0] > last[0]))
        if COLUMNS in extents:
            candidates += [("steps", request[1] > last[1]), ("top_k", request[2] > last[2])]
        if CONTEXT in extents:
            candidates.append(("context", request[3] > last[3]))
        # Without a concurrent caller moving `last`, at least one dimension grew; otherwise name all candidates.
        return tuple(n for n, grew in candidates if grew) or tuple(n for n, _ in candidates)

    def _commit(
        self,
        old: _Generation,
        new: _Generation,
        targets: dict[str, tuple[int, int]],
        *,
        event: str,
        causes: tuple[str, ...],
    ) -> None:
        """Publish ``new`` and account for it; nothing here can fail half-way."""
        self._gen = new
        if self._launch_records is not None:  # recorded at the old buffers' addresses: never laid out alike again
            self._launch_records.clear()
        for name in targets:
            self._peak_bytes[name] = max(self._peak_bytes[name], new.buffers[name].nbytes)
            if event != "trim":
                self._grow_events[name] += 1
        self._total_peak = max(self._total_peak, new.nbytes)
        if event == "trim":
            self._trim_events += 1
        else:
            self._total_grow_events += 1
            for cause in causes:
                self._causes[cause] += 1
        changes = "; ".join(
            f"{name} {old.buffers[name].rows}x{old.buffers[name].cols} {_size(old.buffers[name].nbytes)} -> "
            f"{new.buffers[name].rows}x{new.buffers[name].cols} {_size(new.buffers[name].nbytes)}"
            for name in targets
        )
        log.info(
            "kvplan pool %s: %s (cause: %s), generation %d -> %d: %s; total %s -> %s",
            self.device,
            event,
            ", ".join(causes) or "trim",
            old.generation,
            new.generation,
            changes,
            _size(old.nbytes),
            _size(new.nbytes),
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


def _numel(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _check_extents(shapes: dict[str, tuple[int, int]], request: Request, call: str) -> None:
    """A dimension no tensor can have is refused even when the buffer holds 0 elements (a batch of 0 rows of
    2^70 columns fits any storage, but no view of it exists; nor does a ``top_k_tokens`` of 2^63 steps). ``call``
    is the call as the message names it."""
    for name, value in zip(("num_steps", "top_k"), request[1:3]):
        if value > MAX_TENSOR_BYTES:
            raise PoolBudgetError(
                f"{call} would need top_k_tokens of {_count(value)} {name}, more than a tensor can "
                "hold in one dimension. The pool is unchanged; lower the step's maxima."
            )
    for name, (rows, cols) in shapes.items():
        if max(rows, cols) > MAX_TENSOR_BYTES:
            raise PoolBudgetError(
                f"{call} would need {name} of {_count(rows)} x {_count(cols)} elements, more than a "
                "tensor can hold in one dimension. The pool is unchanged; lower the step's maxima."
            )


def _ops():
    """``kvplan.ops``, imported on the first launch (it imports the kernels, and so Triton: a pool is built before the
    engine has settled ``TRITON_INTERPRET``)."""
    global _OPS
    if _OPS is None:
        import kvplan.ops

        _OPS = kvplan.ops
    return _OPS


_OPS = None
