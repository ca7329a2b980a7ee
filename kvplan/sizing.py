"""Pure sizing: which buffers a pool holds, how large each is for a step shape, and how the growth policies round.

Nothing here allocates or imports Triton, so an engine can ask how many bytes its maxima take (``required_bytes``)
before its memory profiling, and the pool grows by exactly the rules this module states.

Every pool buffer is flat storage viewed as ``[rows, cols]`` (row stride = cols): rows are sized by the batch (or the
context, for the KV slabs), columns by ``num_steps * top_k`` (or fixed by the model geometry). A request fits when
``rows * cols`` elements fit in the storage, so a steps or top_k change re-lays the rows over the same storage.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import attrs
import torch

from kvplan.config import MaterializeGeometry, PoolConfig, sizes
from kvplan.errors import NotAnIntError
from kvplan.workspace import swap_in_workspace_columns

__all__ = [
    "BATCH",
    "COLUMNS",
    "CONTEXT",
    "FIXED",
    "BufferRule",
    "buffer_bytes",
    "buffer_rules",
    "buffer_shapes",
    "check_request",
    "grow_extent",
    "required_bytes",
    "worst_extent",
]

# What sizes a buffer dimension.
BATCH = "batch"  # batch rows: the growth policy, buckets included
COLUMNS = "columns"  # plan columns (num_steps * top_k): exact or geometric
CONTEXT = "total_ctx"  # context tokens of the KV slabs: exact or geometric
FIXED = "fixed"  # set by the geometry, never grows past the first size

Request = tuple[int, int, int, int]  # (batch, num_steps, top_k, total_ctx)


@attrs.frozen
class BufferRule:
    """How one pool buffer is sized: its name, flat ``dtype`` storage viewed as ``[rows, cols]``, and what sizes its
    rows (``row_extent``) and columns (``col_extent``)."""

    name: str
    dtype: torch.dtype
    row_extent: str
    col_extent: str


_PLAN_RULES = (
    BufferRule("miss_src", torch.int64, BATCH, COLUMNS),
    BufferRule("miss_dst", torch.int32, BATCH, COLUMNS),
    BufferRule("miss_count", torch.int32, BATCH, FIXED),
    BufferRule("workspace", torch.int64, BATCH, COLUMNS),
)


def buffer_rules(geometry: MaterializeGeometry | None) -> tuple[BufferRule, ...]:
    """The buffers of a pool with this geometry, in a fixed order (the KV slabs only with a geometry)."""
    if geometry is None:
        return _PLAN_RULES
    slabs = (
        BufferRule("k_out", geometry.dtype, CONTEXT, FIXED),
        BufferRule("v_out", geometry.dtype, CONTEXT, FIXED),
    )
    projection = (BufferRule("kv_proj", geometry.dtype, CONTEXT, FIXED),) if geometry.projection else ()
    return _PLAN_RULES + slabs + projection


def _index(call: str, name: str, value: object) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor) or not hasattr(type(value), "__index__"):
        hint = " (a tensor would need a device sync; pass a Python int)" if isinstance(value, torch.Tensor) else ""
        raise NotAnIntError(f"{call}: {name} must be an int, got {type(value).__name__} {value!r}{hint}")
    return value.__index__()


_MEANING = {
    "batch": "the step's batch rows (graph padding included)",
    "num_steps": "the step's draft steps (1 for a single-step call)",
    "top_k": "the tokens each step selects",
    "total_ctx": "the draft tokens the step materializes (0 for none)",
}


def check_request(
    batch: object,
    num_steps: object,
    top_k: object,
    total_ctx: object,
    geometry: MaterializeGeometry | None,
    *,
    call: str,
) -> Request:
    """The step shape as plain ints, or a ``TypeError``/``ValueError`` naming ``call``, the argument and the value."""
    values = (
        _index(call, "batch", batch),
        _index(call, "num_steps", num_steps),
        _index(call, "top_k", top_k),
        _index(call, "total_ctx", total_ctx),
    )
    for name, value, low in zip(("batch", "num_steps", "top_k", "total_ctx"), values, (0, 1, 0, 0)):
        if value < low:
            raise ValueError(f"{call}: {name} must be >= {low}, got {value}; pass {_MEANING[name]}")
    if values[3] > 0 and geometry is None:
        raise ValueError(
            f"{call}: total_ctx must be 0 for a pool without materialize slabs, got total_ctx={values[3]}; "
            "build the pool with geometry=MaterializeGeometry(n_layers, num_kv_heads, head_dim, dtype)"
        )
    return values


def buffer_shapes(
    geometry: MaterializeGeometry | None, batch: int, num_steps: int, top_k: int, total_ctx: int
) -> dict[str, tuple[int, int]]:
    """``[rows, cols]`` each buffer needs for one step shape (validated ints)."""
    columns = num_steps * top_k
    shapes = {
        "miss_src": (batch, columns),
        "miss_dst": (batch, columns),
        "miss_count": (batch, 1),
        "workspace": (batch, swap_in_workspace_columns(num_steps, top_k)),
    }
    if geometry is not None:
        slab = (total_ctx, geometry.elements_per_token)
        shapes["k_out"] = slab
        shapes["v_out"] = slab
        if geometry.projection:  # the fused projection: K and V of every layer per token
            shapes["kv_proj"] = (total_ctx, 2 * geometry.elements_per_token)
    return shapes


def _geometric(config: PoolConfig, old: int) -> int:
    """``ceil(old * growth_factor)`` computed exactly (a float product would round, or overflow for a large factor:
    the result may exceed what any tensor can hold, and the pool then refuses it with ``PoolBudgetError``)."""
    return math.ceil(old * Fraction(config.growth_factor))


def grow_extent(config: PoolConfig, extent: str, old: int, need: int, *, exact: bool = False) -> int:
    """New capacity of one dimension that holds ``old`` and must hold ``need`` (> ``old``) under the policy."""
    if need <= old:
        return old
    if exact or extent == FIXED or config.growth == "exact":
        return need
    if extent == BATCH and config.growth == "bucketed":
        buckets = config.batch_buckets
        if need <= buckets[-1]:
            return buckets[bisect.bisect_left(buckets, need)]
    return max(need, _geometric(config, old))


def worst_extent(config: PoolConfig, extent: str, maximum: int) -> int:
    """Largest capacity growth can reach for one dimension while every request stays <= ``maximum``.

    Growing from ``old < need <= maximum`` gives at most ``max(maximum, ceil((maximum - 1) * factor))``, and any
    ``old < maximum`` is reachable, so that is the bound (a bucket when buckets cover ``maximum``).
    """
    if maximum == 0 or extent == FIXED or config.growth == "exact":
        return maximum
    if extent == BATCH and config.growth == "bucketed" and maximum <= config.batch_buckets[-1]:
        return grow_extent(config, extent, 0, maximum)
    return max(maximum, _geometric(config, maximum - 1))


def buffer_bytes(
    config: PoolConfig | None = None,
    geometry: MaterializeGeometry | None = None,
    *,
    batch: int,
    num_steps: int = 1,
    top_k: int = 0,
    total_ctx: int = 0,
    worst_case_growth: bool = False,
) -> dict[str, int]:
    """Bytes per buffer for these maxima; see :func:`required_bytes`."""
    if config is not None and not isinstance(config, PoolConfig):
        raise TypeError(f"required_bytes: config must be a PoolConfig or None, got {type(config).__name__}")
    if geometry is not None and not isinstance(geometry, MaterializeGeometry):
        kind = type(geometry).__name__
        raise TypeError(f"required_bytes: geometry must be a MaterializeGeometry or None, got {kind}")
    config = PoolConfig() if config is None else config
    request = check_request(batch, num_steps, top_k, total_ctx, geometry, call="required_bytes")
    shapes = buffer_shapes(geometry, *request)
    sizes = {}
    for rule in buffer_rules(geometry):
        rows, cols = shapes[rule.name]
        if worst_case_growth:
            rows = worst_extent(config, rule.row_extent, rows)
            cols = worst_extent(config, rule.col_extent, cols)
        sizes[rule.name] = rows * cols * rule.dtype.itemsize
    return sizes


def required_bytes(
    config: PoolConfig | None = None,
    geometry: MaterializeGeometry | None = None,
    *,
    batch: int,
    num_steps: int = 1,
    top_k: int = 0,
    total_ctx: int = 0,
    worst_case_growth: bool = False,
) -> int:
    """Bytes a pool with ``config`` and ``geometry`` reserves for these maxima; allocates nothing.

    By default: what ``reserve(batch=..., num_steps=..., top_k=..., total_ctx=...)`` takes on a fresh pool (exact, no
    policy rounding). With ``worst_case_growth=True``: an upper bound on what ``ensure_capacity`` growth under the
    config's policy can reserve while no step exceeds the maxima (the number to budget when not reserving). The
    device counter vector (48 bytes, allocated at construction) is not included.
    """
    return sum(
        buffer_bytes(
            config,
            geometry,
            batch=batch,
            num_steps=num_steps,
            top_k=top_k,
            total_ctx=total_ctx,
            worst_case_growth=worst_case_growth,
        ).values()
    )


def scratch_rows(hot: int, steps: int, top_k: int) -> int:
    """Scratch rows per request that no speculative swap-in can overflow: ``max(0, steps * top_k - hot)``.

    The rule: a row's distinct wanted tokens are at most ``steps * top_k``; the ones a hot slot holds are hits, and
    every other hot slot is evictable (a token sits in at most one slot), so misses beyond the evictable slots number
    at most ``steps * top_k - hot``. Those go to scratch rows; with this many, none is dropped (output ``-1``,
    counted as overflow). The single-step path needs none: it requires ``hot >= top_k``.
    """
    hot, steps, top_k = sizes("scratch_rows", hot=hot, steps=steps, top_k=top_k)
    return max(0, steps * top_k - hot)
