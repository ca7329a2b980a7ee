"""The pool's buffer arena: the step-scoped buffers of one GPU worker, their generations, growth, budget and views.

:class:`BufferArena` owns the memory; :class:`kvplan.pool.PlanBufferPool` is the arena with the launches on top
(swap-in, replay and its guard, materialize, stats). Nothing here launches a kernel or imports one.

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
data pointers) with ``generation``. ``trim()`` concurrent with a step can make that step's next view fetch raise
``PoolCapacityError``; it never makes it return a short view.

Contents are step-scoped: nothing in the plan buffers, the workspace or the KV slabs is promised across an
``ensure_capacity`` call that grows (growth does not copy).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from decimal import Decimal

import attrs
import torch
from torch import Tensor

from kvplan.config import MAX_TENSOR_BYTES, MaterializeGeometry, PoolConfig, as_int
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
from kvplan.stats import GrowthCauses
from kvplan.workspace import forget_tables, swap_in_workspace_columns

__all__ = ["BufferArena"]

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
    # (``launches``: the launch facade's buffers per swap-in shape, kvplan.pool.LaunchBuffers; cut from this
    # generation's views and dropped with them)

    def __init__(self, buffers: dict[str, _Buffer], generation: int) -> None:
        self.buffers = buffers
        self.generation = generation
        self.nbytes = sum(b.nbytes for b in buffers.values())
        self.fits: dict[Request, Request] = {}  # ensure_capacity requests known to fit -> the same as plain ints
        self.plans: dict[tuple[int, int, int], MissPlan] = {}
        self.workspaces: dict[tuple[int, int, int], Tensor] = {}
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.kv_proj: dict[int, Tensor] = {}
        self.launches: dict[tuple[int, int, int], object] = {}


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


class BufferArena:
    """The step-scoped buffers of one device: sized by ``ensure_capacity``/``reserve``, shrunk by ``trim``, cut into
    views of exact shapes, replaced a generation at a time. :class:`kvplan.pool.PlanBufferPool` is the arena with the
    launches; its docstring lists the parameters (the refusals name it: the arena is the pool's)."""

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
        rules = buffer_rules(geometry)
        empty = {rule.name: _Buffer(rule, self._allocate(0, rule.dtype), 0, 0) for rule in rules}
        self._gen = _Generation(empty, generation=0)
        self._last: Request = (0, 1, 0, 0)  # the previous step's request: trim target, growth causes, used bytes
        self._reserved: Request = (0, 1, 0, 0)  # elementwise max of reserve() calls: what reserve sizes for
        self._reserved_shapes = {rule.name: (0, 0) for rule in rules}  # trim floor per buffer
        # Statistics, changed only under the lock and only when a reallocation commits.
        self._peak_bytes = dict.fromkeys(empty, 0)
        self._total_peak = 0
        self._grow_events = dict.fromkeys(empty, 0)
        self._total_grow_events = 0
        self._trim_events = 0
        self._causes = dict.fromkeys(attrs.fields_dict(GrowthCauses), 0)

    def _published(self, gen: _Generation) -> None:
        """A new generation ``gen`` was just published (under the lock): what named the old buffers goes with them.
        The launch facade drops its launch records here."""

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

    def workspace(self, batch: int, num_steps: int, top_k: int) -> Tensor:
        """The swap-in resolve scratch: int64 ``[batch, swap_in_workspace_columns(num_steps, top_k)]``."""
        return self._swap_in_view("workspaces", self._cut_workspace, batch, num_steps, top_k, call="workspace")

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
        self._published(new)
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
