"""PlanBufferPool: one per GPU worker; owns the step-scoped buffers, grows them, and hands out views of exact shapes.

Before each step the engine calls ``ensure_capacity(batch=, num_steps=, top_k=, total_ctx=)``; then it takes views
(``miss_plan``, ``workspace``, ``kv_out``) or launches kernels through the pool. A view of a shape the pool was not
sized for raises ``PoolCapacityError``: a short or wrong view is never returned.

Design, in short:

- Each buffer is flat storage viewed ``[rows, cols]`` (see ``kvplan.sizing``), so a steps or top_k change re-lays the
  plan rows over the same bytes; ``miss_src`` and ``miss_dst`` always share one row stride.
- All buffers of one generation, and the views cut from them, live in one ``_State`` that a reallocation replaces as
  a whole. Views are cached per shape in that state, so the steady state is a dict lookup: no allocation, no device
  synchronisation, no lock, every data pointer and ``generation`` kept.
- Growth takes a lock, re-checks, allocates every new buffer before dropping any old one, and publishes the new state
  with one assignment. A refusal (frozen, capturing, over budget, allocation failure) leaves everything as it was.

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
from decimal import Decimal

import attrs
import torch
from torch import Tensor

from kvplan.config import MaterializeGeometry, PoolConfig
from kvplan.counters import REPLAY_COPY_BASE, new_counters, read_counters
from kvplan.errors import PoolBudgetError, PoolCapacityError, PoolFrozenError
from kvplan.sizing import (
    BATCH,
    COLUMNS,
    CONTEXT,
    BufferLayout,
    Request,
    buffer_layouts,
    buffer_shapes,
    check_request,
    grow_extent,
)
from kvplan.sizing import required_bytes as _required_bytes
from kvplan.stats import BufferStats, DeviceCounters, GrowthCauses, PoolStats, buffer_capacity

__all__ = ["MissPlan", "PlanBufferPool"]

log = logging.getLogger("kvplan")

_CACHE_LIMIT = 1024  # shapes cached per generation and kind; engines cycle through far fewer
# Largest tensor a buffer can be: torch sizes and byte counts are int64.
MAX_BUFFER_BYTES = (1 << 63) - 1


def _int_types() -> frozenset[type]:
    """Types the steady-state lookups take as they are: int, and NumPy's integers (equal and hashing like ints)."""
    try:
        import numpy as np
    except ImportError:
        return frozenset({int})
    return frozenset({int, *(np.dtype(c).type for c in np.typecodes["AllInteger"])})


_INTS = _int_types()


@attrs.frozen(eq=False)
class MissPlan:
    """One step's miss plan: ``src`` int64 and ``dst`` int32 ``[batch, num_steps * top_k]`` with one row stride,
    ``count`` int32 ``[batch]``; views into the pool's buffers of ``generation`` (stale after a later growth)."""

    src: Tensor
    dst: Tensor
    count: Tensor
    generation: int


@attrs.frozen(eq=False)
class _Buffer:
    """One buffer of one generation: flat storage holding exactly ``rows * cols`` elements."""

    layout: BufferLayout
    storage: Tensor
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.layout.dtype.itemsize


class _State:
    """All buffers of one generation and the views cut from them; replaced whole, never mutated but for caches."""

    __slots__ = ("buffers", "generation", "nbytes", "fits", "plans", "workspaces", "kv", "launches")

    def __init__(self, buffers: dict[str, _Buffer], generation: int) -> None:
        self.buffers = buffers
        self.generation = generation
        self.nbytes = sum(b.nbytes for b in buffers.values())
        self.fits: dict[Request, Request] = {}  # ensure_capacity requests known to fit -> the same as plain ints
        self.plans: dict[tuple[int, int, int], MissPlan] = {}
        self.workspaces: dict[tuple[int, int, int], Tensor] = {}
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.launches: dict[tuple[int, int, int], tuple[MissPlan, Tensor]] = {}


def _remember(cache: dict | set, key, value=None) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    if isinstance(cache, set):
        cache.add(key)
    else:
        cache[key] = value


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
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise TypeError(f"PlanBufferPool: device must be a torch.device, str or int, got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"PlanBufferPool: device must name a torch device (e.g. 'cuda:0'), got {device!r}") from exc
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

    ``device``: where every buffer lives (``'cuda'`` is pinned to the current device at construction).
    ``materialize``: the KV slab geometry; without it the pool has no slabs and refuses ``total_ctx > 0``.
    ``config``: the growth policy and byte budget (:class:`~kvplan.PoolConfig`).
    """

    def __init__(
        self,
        device: torch.device | str | int,
        *,
        materialize: MaterializeGeometry | None = None,
        config: PoolConfig | None = None,
    ) -> None:
        if materialize is not None and not isinstance(materialize, MaterializeGeometry):
            raise TypeError(
                f"PlanBufferPool: materialize must be a MaterializeGeometry or None, got {type(materialize).__name__}"
            )
        if config is not None and not isinstance(config, PoolConfig):
            raise TypeError(f"PlanBufferPool: config must be a PoolConfig or None, got {type(config).__name__}")
        self.device = _resolve_device(device)
        self.geometry = materialize
        self.config = PoolConfig() if config is None else config
        self._lock = threading.Lock()
        self._frozen = False
        # The device counter vector: allocated once, survives every growth, read only by stats().
        self.counters = new_counters(self.device)
        layouts = buffer_layouts(materialize)
        empty = {lay.name: _Buffer(lay, self._allocate(0, lay.dtype), 0, 0) for lay in layouts}
        self._state = _State(empty, generation=0)
        self._last: Request = (0, 1, 0, 0)  # the previous step's request: trim target, growth causes, used bytes
        self._reserved: Request = (0, 1, 0, 0)  # elementwise max of reserve() calls, for error hints
        self._reserved_shapes = {lay.name: (0, 0) for lay in layouts}  # trim floor per buffer
        # Statistics, changed only under the lock and only when a reallocation commits.
        self._peak_bytes = dict.fromkeys(empty, 0)
        self._total_peak = 0
        self._grow_events = dict.fromkeys(empty, 0)
        self._total_grow_events = 0
        self._trim_events = 0
        self._causes = dict.fromkeys(attrs.fields_dict(GrowthCauses), 0)

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
            request = self._state.fits.get(key)  # NumPy ints hash and compare like the ints they hold
            if request is not None:
                self._last = request
                return False
        return self._ensure_slow(key)

    def _ensure_slow(self, key: tuple) -> bool:
        request = check_request(*key, self.geometry, call="ensure_capacity")
        shapes = buffer_shapes(self.geometry, *request)
        state = self._state
        if not self._short(state, shapes):
            self._fitted(state, request)  # the state checked, never a newer (possibly trimmed) one
            return False
        with self._lock:
            state = self._state  # re-check: another thread may have grown the pool meanwhile
            short = self._short(state, shapes)
            if not short:
                self._fitted(state, request)
                return False
            call = _call("ensure_capacity", request)
            self._refuse_if_frozen(state, shapes, short, request, call)
            targets = self._growth(state, shapes, exact=False)
            if self._over_budget(state, targets):
                targets = self._growth(state, shapes, exact=True)  # near the budget, exact sizes may still fit
            self._check_budget(state, targets, call)
            new_state = self._reallocate(state, targets, call)
            causes = self._growth_causes(state, request, targets)
            self._commit(state, new_state, targets, event="grow", causes=causes)
            self._fitted(new_state, request)
            buckets = self.config.batch_buckets
            above_buckets = bool(buckets) and any(  # a batch dimension grew past the largest bucket
                state.buffers[name].layout.row_extent == BATCH and rows > max(state.buffers[name].rows, buckets[-1])
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
        """Size every buffer to hold exactly these maxima (no policy rounding; never shrinks), before capture or
        memory profiling; True when something was reallocated. ``trim()`` never goes below what was reserved."""
        request = check_request(batch, num_steps, top_k, total_ctx, self.geometry, call="reserve")
        shapes = buffer_shapes(self.geometry, *request)
        with self._lock:
            state = self._state
            short = self._short(state, shapes)
            if short:
                call = _call("reserve", request)
                self._refuse_if_frozen(state, shapes, short, request, call)
                targets = {name: shapes[name] for name in short}
                self._check_budget(state, targets, call)
                new_state = self._reallocate(state, targets, call)
                self._commit(state, new_state, targets, event="reserve", causes=("reserve",))
            for name, shape in shapes.items():
                if shape[0] * shape[1] > _numel(self._reserved_shapes[name]):
                    self._reserved_shapes[name] = shape
            self._reserved = tuple(max(a, b) for a, b in zip(self._reserved, request))
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
            state = self._state
            used = buffer_shapes(self.geometry, *self._last)
            targets = {}
            for name, buffer in state.buffers.items():
                keep = max(used[name], self._reserved_shapes[name], key=_numel)
                if _numel(keep) < buffer.numel:
                    targets[name] = keep
            if not targets:
                return False
            new_state = self._reallocate(state, targets, "trim()")
            self._commit(state, new_state, targets, event="trim", causes=())
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
        return self._state.generation

    # ---------------------------------------------------------------------------------------------------------------
    # Views

    def miss_plan(self, batch: int, num_steps: int, top_k: int) -> MissPlan:
        """The plan views of exactly ``[batch, num_steps * top_k]`` (src, dst) and ``[batch]`` (count)."""
        if type(batch) in _INTS and type(num_steps) in _INTS and type(top_k) in _INTS:
            plan = self._state.plans.get((batch, num_steps, top_k))
            if plan is not None:
                return plan
        b, s, k, _ = check_request(batch, num_steps, top_k, 0, self.geometry, call="miss_plan")
        state = self._state
        plan = state.plans.get((b, s, k))
        if plan is None:
            plan = self._cut_plan(state, b, s, k, call="miss_plan")
            _remember(state.plans, (b, s, k), plan)
        return plan

    def workspace(self, batch: int, num_steps: int, top_k: int) -> Tensor:
        """The swap-in resolve scratch: int64 ``[batch, swap_in_workspace_columns(num_steps, top_k)]``."""
        if type(batch) in _INTS and type(num_steps) in _INTS and type(top_k) in _INTS:
            view = self._state.workspaces.get((batch, num_steps, top_k))
            if view is not None:
                return view
        b, s, k, _ = check_request(batch, num_steps, top_k, 0, self.geometry, call="workspace")
        state = self._state
        view = state.workspaces.get((b, s, k))
        if view is None:
            view = self._cut(state, "workspace", (b, s, k, self._last[3]), "workspace")
            _remember(state.workspaces, (b, s, k), view)
        return view

    def kv_out(self, total_ctx: int) -> tuple[Tensor, Tensor]:
        """``(k_out, v_out)``: contiguous ``[n_layers, total_ctx, num_kv_heads, head_dim]`` views of the slabs."""
        if type(total_ctx) in _INTS:
            views = self._state.kv.get(total_ctx)
            if views is not None:
                return views
        if self.geometry is None:
            raise ValueError(
                "kv_out: this pool has no materialize slabs; build it with "
                "materialize=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
            )
        last = self._last
        _, _, _, ctx = check_request(0, 1, 0, total_ctx, self.geometry, call="kv_out")
        state = self._state
        views = state.kv.get(ctx)
        if views is None:
            request = (last[0], last[1], last[2], ctx)
            views = (self._cut(state, "k_out", request, "kv_out"), self._cut(state, "v_out", request, "kv_out"))
            _remember(state.kv, ctx, views)
        return views

    def _require(self, batch: int, num_steps: int, top_k: int) -> tuple[MissPlan, Tensor]:
        """Plan and workspace for a swap-in launch of this shape, or ``PoolCapacityError`` naming the
        ``ensure_capacity(...)`` call to make. Launch wrappers pass shapes read off tensors."""
        if torch.compiler.is_compiling():
            return self._launch_views(batch, num_steps, top_k)
        views = self._state.launches.get((batch, num_steps, top_k))
        if views is None:
            state = self._state
            request = check_request(batch, num_steps, top_k, 0, self.geometry, call="swap-in launch")
            views = (
                self._cut_plan(state, *request[:3], call="swap-in launch"),
                self._cut(state, "workspace", (*request[:3], self._last[3]), "swap-in launch"),
            )
            _remember(state.launches, request[:3], views)
        return views

    def _launch_views(self, batch: int, num_steps: int, top_k: int) -> tuple[MissPlan, Tensor]:
        """``_require`` as dynamo traces it: views sliced from this generation's storage, no per-shape cache.

        The sizes may be symbolic (a dynamic batch): a cache keyed by them would pin them to constants and recompile
        per batch. Dynamo turns the capacity check into a guard (``batch * columns <= capacity``) on the compiled
        graph, so a shape beyond the pool's capacity re-traces and is refused with ``PoolCapacityError`` (reported by
        dynamo as ``Unsupported`` under ``fullgraph=True``), and a growth (new storage sizes) recompiles. Nothing here
        reads ``_last``, which changes every step.
        """
        state = self._state
        request = (batch, num_steps, top_k, 0)
        plan = _new_plan(
            src=self._cut(state, "miss_src", request, "swap-in launch"),
            dst=self._cut(state, "miss_dst", request, "swap-in launch"),
            count=self._cut(state, "miss_count", request, "swap-in launch"),
            generation=state.generation,
        )
        return plan, self._cut(state, "workspace", request, "swap-in launch")

    def _kernel_count(self, plan: MissPlan) -> Tensor:
        """The ``miss_count`` a swap-in launch writes: ``plan.count``, or under dynamo the whole count buffer (the
        kernels take ``[>= batch]``; they write rows ``< batch`` only). Functionalization compares a mutated 1-D
        view's length with its base's, which would give ``batch == capacity`` a graph of its own."""
        if torch.compiler.is_compiling():
            return self._state.buffers["miss_count"].storage
        return plan.count

    def _launch_kv(self, total_ctx: int) -> tuple[Tensor, Tensor]:
        """``kv_out`` as dynamo traces it (see ``_launch_views``); the caller has checked the geometry."""
        state, request = self._state, (0, 1, 0, total_ctx)
        return self._cut(state, "k_out", request, "kv_out"), self._cut(state, "v_out", request, "kv_out")

    def _cut_plan(self, state: _State, b: int, s: int, k: int, *, call: str) -> MissPlan:
        request = (b, s, k, self._last[3])
        return _new_plan(
            src=self._cut(state, "miss_src", request, call),
            dst=self._cut(state, "miss_dst", request, call),
            count=self._cut(state, "miss_count", request, call),
            generation=state.generation,
        )

    def _cut(self, state: _State, name: str, request: Request, call: str) -> Tensor:
        """The view of buffer ``name`` for ``request``, or ``PoolCapacityError`` naming the call to make."""
        rows, cols = buffer_shapes(self.geometry, *request)[name]
        buffer = state.buffers[name]
        if rows * cols > buffer.numel:
            raise PoolCapacityError(
                f"{call}: the pool was not sized for this shape: {name} needs {rows * cols} elements "
                f"({rows} x {cols}), it holds {buffer.numel} (generation {state.generation}). "
                f"Call pool.{_call('ensure_capacity', request)} before the step "
                "(or pool.reserve(...) with your maxima before graph capture)."
            )
        flat = buffer.storage[: rows * cols]
        if name == "miss_count":
            return flat
        if name in ("k_out", "v_out"):
            g = self.geometry
            return flat.view(g.n_layers, rows, g.num_kv_heads, g.head_dim)
        return flat.view(rows, cols)

    # ---------------------------------------------------------------------------------------------------------------
    # Growth internals (callers hold the lock from _growth on)

    def _allocate(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Flat storage on the pool's device (never the current device). Tests replace it to simulate OOM."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    @staticmethod
    def _short(state: _State, shapes: dict[str, tuple[int, int]]) -> list[str]:
        return [name for name, (rows, cols) in shapes.items() if rows * cols > state.buffers[name].numel]

    def _fitted(self, state: _State, request: Request) -> None:
        _remember(state.fits, request, request)
        self._last = request

    def _growth(self, state: _State, shapes: dict[str, tuple[int, int]], *, exact: bool) -> dict[str, tuple[int, int]]:
        """New ``(rows, cols)`` of each buffer too small for ``shapes``: only dimensions that are too small grow."""
        targets = {}
        for name, (rows, cols) in shapes.items():
            buffer = state.buffers[name]
            if rows * cols <= buffer.numel:
                continue
            lay = buffer.layout
            new_rows = grow_extent(self.config, lay.row_extent, buffer.rows, rows, exact=exact)
            new_cols = grow_extent(self.config, lay.col_extent, buffer.cols, cols, exact=exact)
            targets[name] = (new_rows, new_cols)
        return targets

    def _new_total(self, state: _State, targets: dict[str, tuple[int, int]]) -> int:
        total = state.nbytes
        for name, shape in targets.items():
            buffer = state.buffers[name]
            total += _numel(shape) * buffer.layout.dtype.itemsize - buffer.nbytes
        return total

    def _over_budget(self, state: _State, targets: dict[str, tuple[int, int]]) -> bool:
        budget = self.config.max_bytes
        return budget is not None and self._new_total(state, targets) > budget

    def _check_budget(self, state: _State, targets: dict[str, tuple[int, int]], call: str) -> None:
        if not self._over_budget(state, targets):
            return
        changes = ", ".join(
            f"{name} {_size(state.buffers[name].nbytes)} -> "
            f"{_size(_numel(shape) * state.buffers[name].layout.dtype.itemsize)}"
            for name, shape in targets.items()
        )
        raise PoolBudgetError(
            f"{call} would put the pool over its byte budget: {changes} takes it from {_size(state.nbytes)} to "
            f"{_size(self._new_total(state, targets))} reserved, over PoolConfig.max_bytes={self.config.max_bytes}. "
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
        self, state: _State, shapes: dict[str, tuple[int, int]], short: list[str], request: Request, call: str
    ) -> None:
        reason = self._growth_refusal()
        if reason is None:
            return
        needs = ", ".join(
            f"{name} needs {_size(_numel(shapes[name]) * state.buffers[name].layout.dtype.itemsize)} "
            f"(holds {_size(state.buffers[name].nbytes)})"
            for name in short
        )
        hint = _call("reserve", tuple(max(a, b) for a, b in zip(request, self._reserved)))
        raise PoolFrozenError(
            f"{call} cannot grow the pool: {reason}. {needs}. Growing would free memory a captured CUDA graph "
            f"still points at; call pool.{hint} with your largest shapes before freeze() and graph capture."
        )

    def _reallocate(self, state: _State, targets: dict[str, tuple[int, int]], call: str) -> _State:
        """The next generation: new storage for ``targets``, the other buffers shared. Allocates every new buffer
        before any old one is dropped; on failure the new ones are released and nothing changed."""
        buffers = dict(state.buffers)
        for name, (rows, cols) in targets.items():  # sizes no tensor can have: refused before anything is allocated
            lay = state.buffers[name].layout
            nbytes = rows * cols * lay.dtype.itemsize
            if nbytes > MAX_BUFFER_BYTES:
                raise PoolBudgetError(
                    f"{call} would need {name} of {_size(nbytes)} ({_count(rows)} x {_count(cols)} {lay.dtype}), "
                    f"more than a tensor can hold ({MAX_BUFFER_BYTES} B): the pool holds {_size(state.nbytes)}, budget "
                    f"{'none' if self.config.max_bytes is None else self.config.max_bytes}. The pool is unchanged; "
                    "lower the step's maxima (or PoolConfig.growth_factor)."
                )
        for name, (rows, cols) in targets.items():
            lay = state.buffers[name].layout
            try:
                storage = self._allocate(rows * cols, lay.dtype)
            except (RuntimeError, MemoryError, OverflowError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                nbytes = rows * cols * lay.dtype.itemsize
                raise PoolBudgetError(
                    f"{call} could not allocate {name} ({_size(nbytes)}, {rows} x {cols} {lay.dtype}) on "
                    f"{self.device}: the pool holds {_size(state.nbytes)}, budget "
                    f"{'none' if self.config.max_bytes is None else self.config.max_bytes}. The pool is unchanged; "
                    f"free device memory or lower the step's maxima. ({type(exc).__name__}: {exc})"
                ) from exc
            buffers[name] = _Buffer(lay, storage, rows, cols)
        return _State(buffers, state.generation + 1)

    def _growth_causes(self, state: _State, request: Request, targets: dict[str, tuple[int, int]]) -> tuple[str, ...]:
        """What outgrew the previous step, among the dimensions that size the grown buffers."""
        last = self._last
        extents = set()
        for name in targets:
            lay = state.buffers[name].layout
            extents.update((lay.row_extent, lay.col_extent))
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
        old: _State,
        new: _State,
        targets: dict[str, tuple[int, int]],
        *,
        event: str,
        causes: tuple[str, ...],
    ) -> None:
        """Publish ``new`` and account for it; nothing here can fail half-way."""
        self._state = new
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
    # Kernel launches against the pool's buffers. They never grow the pool and allocate nothing, so they can be
    # captured in a CUDA graph; a shape the pool was not sized for raises PoolCapacityError. While dynamo traces
    # them (torch.compile of an engine step) they call the kernels as torch custom ops and cut their views from the
    # storage (see _launchers, _launch_views), so a step compiles without graph breaks. Triton is imported on first
    # launch only.

    def swap_in(self, *, top_k_tokens: Tensor, **state: Tensor | None) -> MissPlan:
        """Single-step HiSparse swap-in (docs/kernels.md §2) with the plan written into the pool; returns that plan.

        Takes the arguments of :func:`kvplan.kernels.swap_in` except ``miss_src``/``miss_dst``/``miss_count``,
        ``workspace`` and ``counters``, which are the pool's.
        """
        batch, top_k = _shape_of(top_k_tokens, 2, "pool.swap_in", "[batch, top_k]")
        plan, workspace = self._require(batch, 1, top_k)
        _launchers().swap_in(
            top_k_tokens=top_k_tokens,
            miss_src=plan.src,
            miss_dst=plan.dst,
            miss_count=self._kernel_count(plan),
            workspace=workspace,
            counters=self.counters,
            **state,
        )
        return plan

    def swap_in_spec(self, *, top_k_tokens: Tensor, **state: Tensor | None) -> MissPlan:
        """Speculative swap-in over ``S`` draft steps (docs/kernels.md §3) with the plan written into the pool.

        Takes the arguments of :func:`kvplan.kernels.swap_in_spec` except the plan, ``workspace`` and ``counters``.
        """
        batch, steps, top_k = _shape_of(top_k_tokens, 3, "pool.swap_in_spec", "[batch, steps, top_k]")
        plan, workspace = self._require(batch, steps, top_k)
        _launchers().swap_in_spec(
            top_k_tokens=top_k_tokens,
            miss_src=plan.src,
            miss_dst=plan.dst,
            miss_count=self._kernel_count(plan),
            workspace=workspace,
            counters=self.counters,
            **state,
        )
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

        With ``stream``, the copy runs on that side stream after the work already queued on the current stream, and
        the returned event marks its end: ``torch.cuda.current_stream().wait_event(event)`` before the layer reads
        ``device_buffer`` (inside graph capture too: the side stream must rejoin before capture ends).
        """
        if not isinstance(plan, MissPlan):
            raise TypeError(f"pool.replay: plan must be the MissPlan a pool launch returned, got {type(plan).__name__}")
        if plan.generation != self._state.generation:
            raise PoolCapacityError(
                f"pool.replay: the plan is from generation {plan.generation}, the pool is at generation "
                f"{self._state.generation}: the pool grew since the swap-in that wrote it, so its buffers moved. "
                "Replay the plan of this step's swap-in."
            )
        copy_planned = _launchers().copy_planned
        kwargs = dict(
            miss_src=plan.src,
            miss_dst=plan.dst,
            miss_count=plan.count,
            num_real_reqs=num_real_reqs,
            host_cache=host_cache,
            device_buffer=device_buffer,
            counters=self.counters,
            counter_base=REPLAY_COPY_BASE,
        )
        if stream is None:
            copy_planned(**kwargs)
            return None
        if self.device.type != "cuda":
            raise ValueError(f"pool.replay: stream= needs a CUDA pool, this pool is on {self.device}")
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            copy_planned(**kwargs)
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
        rotary_dim: int,
    ) -> tuple[Tensor, Tensor]:
        """Fused RMSNorm+RoPE KV materialization (docs/kernels.md §5) into the pool's slabs; returns the
        ``[n_layers, total_ctx, H, D]`` views it wrote (``total_ctx = kv.shape[0]``)."""
        if not isinstance(kv, Tensor):
            raise TypeError(f"pool.materialize: kv must be a torch.Tensor, got {type(kv).__name__}")
        if self.geometry is None:
            raise ValueError(
                "pool.materialize: this pool has no materialize slabs; build it with "
                "materialize=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
            )
        g = self.geometry
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
            k_out, v_out = self._launch_kv(kv.shape[0])
        else:
            k_out, v_out = self.kv_out(int(kv.shape[0]))
        return _launchers().materialize(
            kv,
            k_norm_weight,
            eps,
            cos_sin_cache,
            positions,
            g.num_kv_heads,
            g.head_dim,
            rotary_dim,
            k_out=k_out,
            v_out=v_out,
        )

    # ---------------------------------------------------------------------------------------------------------------
    # Counters and stats

    def reset_counters(self) -> None:
        """Zero the device counters (stream-ordered, no synchronisation)."""
        self.counters.zero_()

    def stats(self) -> PoolStats:
        """A snapshot; reads the device counters (the pool's only host synchronisation). Its flat ``as_dict()`` keys
        are listed by ``kvplan.stats.stat_keys`` and documented in docs/pool.md §5."""
        counters = DeviceCounters(**read_counters(self.counters))
        with self._lock:
            state = self._state
            used = buffer_shapes(self.geometry, *self._last)
            buffers = []
            for name, buffer in state.buffers.items():
                lay = buffer.layout
                buffers.append(
                    BufferStats(
                        name=name,
                        reserved_bytes=buffer.nbytes,
                        peak_bytes=self._peak_bytes[name],
                        used_bytes=min(_numel(used[name]), buffer.numel) * lay.dtype.itemsize,
                        capacity=buffer_capacity(lay, buffer.rows, buffer.cols),
                        grow_events=self._grow_events[name],
                    )
                )
            return PoolStats(
                generation=state.generation,
                frozen=self._frozen,
                reserved_bytes=state.nbytes,
                peak_bytes=self._total_peak,
                used_bytes=sum(b.used_bytes for b in buffers),
                budget_bytes=self.config.max_bytes,
                grow_events=self._total_grow_events,
                trim_events=self._trim_events,
                grow_causes=GrowthCauses(**self._causes),
                buffers=tuple(buffers),
                counters=counters,
            )

    def __repr__(self) -> str:
        state = self._state
        return (
            f"PlanBufferPool(device={self.device}, growth={self.config.growth!r}, generation={state.generation}, "
            f"reserved={_size(state.nbytes)}, frozen={self._frozen})"
        )


def _numel(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def _launchers():
    """The launch functions: while dynamo traces, the custom ops of ``kvplan.ops`` (opaque graph nodes with declared
    mutations); otherwise the plain ``kvplan.kernels``, the same code without the dispatcher's round trip (about
    30-60 us a call measured on CPU, per launch of every layer's replay)."""
    if torch.compiler.is_compiling():
        import kvplan.ops as launchers
    else:
        import kvplan.kernels as launchers
    return launchers


def _new_plan(**fields: object) -> MissPlan:
    """A ``MissPlan`` built field by field, as attrs' generated ``__init__`` does (MissPlan has no validators or
    converters to skip). Dynamo cannot trace that ``__init__`` of a frozen slotted class (it binds
    ``object.__setattr__`` through a descriptor), nor compile its frame alone after a graph break in a caller."""
    plan = object.__new__(MissPlan)
    for name, value in fields.items():
        object.__setattr__(plan, name, value)
    return plan


def _shape_of(tokens: object, ndim: int, call: str, expected: str) -> tuple[int, ...]:
    """The launch shape read off ``top_k_tokens``, or a TypeError/ValueError naming it. Plain ints in eager mode
    (``torch.Size`` holds ints); no ``int()`` on them, which would pin a symbolic size under ``torch.compile``."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{call}: top_k_tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != ndim:
        raise ValueError(f"{call}: top_k_tokens must have shape {expected}, got {tuple(tokens.shape)}")
    return tuple(tokens.shape)
