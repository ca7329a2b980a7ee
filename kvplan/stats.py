"""Pool statistics as frozen records, and their one flat schema.

A :class:`PoolStats` snapshot turns into one nested dict (:meth:`PoolStats.as_nested`): ``generation`` and
``frozen``, then ``total`` (the pool as a whole), one group per buffer by its name, and ``counters`` (the device
counter vector). :func:`flatten` turns any such nested dict into flat keys by one rule, the way
``torch.cuda.memory_stats()`` does: the path of names from the top down to a value, joined with ``"."``, so a
buffer's keys read ``{buffer}.{metric}.{stat}`` (``miss_src.reserved_bytes.current``, ``k_out.capacity.ctx``) and
the pool's ``total.{metric}.{stat}`` (``total.reserved_bytes.current``, ``total.grow_events``), as docs/pool.md §5
names them. Every value is a non-negative int, so an exporter (Prometheus, a log line) can take ``as_dict()`` as it
is. A byte metric that has a current and a peak value is a group of its own (``reserved_bytes.current``,
``reserved_bytes.peak``; ``used_bytes.current``); the device counters are named as in ``kvplan.counters.NAMES``.

:func:`stat_keys` lists every key for a pool's buffers (with or without the materialize slabs and a budget); the
schema is documented once, in docs/pool.md §5, and a test holds that table to this code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Union

import attrs

from kvplan.config import MaterializeGeometry
from kvplan.sizing import CONTEXT, FIXED, BufferRule, buffer_rules

__all__ = [
    "BufferStats",
    "DeviceCounters",
    "GrowthCauses",
    "PoolStats",
    "RESERVED_NAMES",
    "buffer_capacity",
    "flatten",
    "stat_keys",
]

RESERVED_NAMES = frozenset({"generation", "frozen", "total", "counters"})  # top-level stats groups: no buffer's name


def _dim_name(extent: str) -> str:
    """A capacity's key: the sizing dimension's name, but ``ctx`` for ``total_ctx`` (docs/pool.md §5)."""
    return "ctx" if extent == CONTEXT else extent


Nested = Mapping[str, Union[int, "Nested"]]


def _count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a non-negative int, got {value!r}")


def _optional_count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _count(instance, attribute, value)


def _flag(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a bool, got {value!r}")


def _name(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value or "." in value or value in RESERVED_NAMES:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a str without '.' and not one of "
            f"{sorted(RESERVED_NAMES)}, got {value!r}"
        )


def _counts(instance: object, attribute: attrs.Attribute, value: tuple[tuple[str, int], ...]) -> None:
    for name, count in value:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{type(instance).__name__}.{attribute.name}[{name!r}] must be a non-negative int")


def flatten(nested: Nested, prefix: str = "") -> dict[str, int]:
    """The one rule of the flat schema: each value's key is the path of names down to it, joined with ``"."``.

    ``flatten({"total": {"reserved_bytes": {"peak": 8}}}) == {"total.reserved_bytes.peak": 8}``. Names must be
    non-empty strings without ``"."`` and values non-negative ints (``ValueError`` otherwise), so a key splits back
    into its path unambiguously."""
    out: dict[str, int] = {}
    for name, value in nested.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"stats key component must be a non-empty str without '.', got {name!r} under {prefix!r}")
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(value, Mapping):
            out.update(flatten(value, key))
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[key] = value
        else:
            raise ValueError(f"stats value {key!r} must be a non-negative int, got {value!r}")
    return out


@attrs.frozen
class BufferStats:
    """One buffer: bytes reserved now and at peak, bytes the last step's views cover, capacity per dimension."""

    name: str = attrs.field(validator=_name)
    reserved_bytes: int = attrs.field(validator=_count)  # key reserved_bytes.current
    peak_bytes: int = attrs.field(validator=_count)  # key reserved_bytes.peak
    used_bytes: int = attrs.field(validator=_count)  # key used_bytes.current
    capacity: tuple[tuple[str, int], ...] = attrs.field(validator=_counts)  # e.g. (("batch", 8), ("columns", 64))
    grow_events: int = attrs.field(validator=_count)

    def as_nested(self) -> dict:
        """This buffer's group of ``PoolStats.as_nested()`` (its name is the key above it)."""
        return {
            "reserved_bytes": {"current": self.reserved_bytes, "peak": self.peak_bytes},
            "used_bytes": {"current": self.used_bytes},
            "capacity": dict(self.capacity),
            "grow_events": self.grow_events,
        }


@attrs.frozen
class GrowthCauses:
    """Growths counted by what outgrew the previous step (one growth can have several causes), or a ``reserve``;
    ``context`` is ``total_ctx``, the materialize slabs' tokens (docs/pool.md §5)."""

    batch: int = attrs.field(default=0, validator=_count)
    steps: int = attrs.field(default=0, validator=_count)
    top_k: int = attrs.field(default=0, validator=_count)
    context: int = attrs.field(default=0, validator=_count)
    reserve: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class DeviceCounters:
    """The device counter vector (``kvplan.counters``, same names and order), read once when the stats were taken."""

    misses_copied: int = attrs.field(default=0, validator=_count)
    bytes_moved: int = attrs.field(default=0, validator=_count)
    hits: int = attrs.field(default=0, validator=_count)
    overflow: int = attrs.field(default=0, validator=_count)
    replayed_rows: int = attrs.field(default=0, validator=_count)
    replayed_bytes: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class PoolStats:
    """A snapshot of one pool: totals, growth history, each buffer, and the device counters."""

    generation: int = attrs.field(validator=_count)
    frozen: bool = attrs.field(validator=_flag)
    reserved_bytes: int = attrs.field(validator=_count)  # sum over buffers; key total.reserved_bytes.current
    peak_bytes: int = attrs.field(validator=_count)  # peak of that sum; key total.reserved_bytes.peak
    used_bytes: int = attrs.field(validator=_count)  # key total.used_bytes.current
    budget_bytes: int | None = attrs.field(validator=_optional_count)  # key total.budget_bytes, only when not None
    grow_events: int = attrs.field(validator=_count)  # growths (each reallocates one or more buffers)
    trim_events: int = attrs.field(validator=_count)
    grow_causes: GrowthCauses = attrs.field(validator=attrs.validators.instance_of(GrowthCauses))
    buffers: tuple[BufferStats, ...] = attrs.field(
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(BufferStats))
    )
    counters: DeviceCounters = attrs.field(validator=attrs.validators.instance_of(DeviceCounters))
    launch_records: int = attrs.field(default=0, validator=_count)  # eager launch layouts recorded now
    launch_graphs: int = attrs.field(default=0, validator=_count)  # of them relaunched as a CUDA graph
    relaunches: int = attrs.field(default=0, validator=_count)  # calls launched from a record since the pool was built

    def buffer(self, name: str) -> BufferStats:
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        raise KeyError(f"no pool buffer named {name!r}; the pool has {', '.join(b.name for b in self.buffers)}")

    def as_nested(self) -> dict:
        """The snapshot as one nested dict: ``{"generation": ..., "frozen": ..., "total": ..., buffer name: ...,
        "counters": ...}`` (a buffer's name is never one of ``RESERVED_NAMES``).

        ``as_dict()`` is ``flatten()`` of this; docs/pool.md §5 lists every key and what it means."""
        total: dict = {
            "reserved_bytes": {"current": self.reserved_bytes, "peak": self.peak_bytes},
            "used_bytes": {"current": self.used_bytes},
        }
        if self.budget_bytes is not None:
            total["budget_bytes"] = self.budget_bytes
        total["grow_events"] = self.grow_events
        total["trim_events"] = self.trim_events
        total["launch_records"] = self.launch_records
        total["launch_graphs"] = self.launch_graphs
        total["relaunches"] = self.relaunches
        total["grow_causes"] = attrs.asdict(self.grow_causes)
        return {
            "generation": self.generation,
            "frozen": int(self.frozen),
            "total": total,
            **{buffer.name: buffer.as_nested() for buffer in self.buffers},
            "counters": attrs.asdict(self.counters),
        }

    def as_dict(self) -> dict[str, int]:
        """Flat keys (``flatten(self.as_nested())``), every value a non-negative int, e.g. ``generation``,
        ``total.reserved_bytes.peak``, ``miss_src.reserved_bytes.current``, ``k_out.capacity.ctx``,
        ``counters.misses_copied``."""
        return flatten(self.as_nested())


def buffer_capacity(
    rule: BufferRule, rows: int, cols: int, used: tuple[int, int] = (0, 0)
) -> tuple[tuple[str, int], ...]:
    """``BufferStats.capacity`` of a buffer sized by ``rule`` holding ``rows x cols`` elements, in the units the engine
    asks for: the largest ``batch`` (or ``total_ctx``, named ``ctx``) that fits at the last step's columns, the
    largest ``columns`` (``num_steps * top_k``) that fits at the last step's batch (unless the geometry fixes the
    columns), then the rows the buffer is viewed as now and its element count. ``used`` is the last step's
    ``(rows, cols)`` view (zeros before any step: then the allocated ones). A steps or top_k change re-lays the rows
    over the same elements, so a buffer allocated as 4 x 64 holds a batch of 8 at 32 columns: its ``batch`` capacity
    then reads 8."""
    elements = rows * cols
    used_rows, used_cols = used
    per_row = used_cols if rule.col_extent != FIXED and used_cols else cols
    capacity = [(_dim_name(rule.row_extent), elements // per_row if per_row else rows)]
    if rule.col_extent != FIXED:
        per_column = used_rows or rows
        capacity.append((_dim_name(rule.col_extent), elements // per_column if per_column else cols))
    capacity.append(("rows", rows))
    capacity.append(("elements", elements))
    return tuple(capacity)


def _template(rules: Iterable[BufferRule], *, budget: bool) -> PoolStats:
    """A zeroed snapshot with the structure ``PlanBufferPool.stats()`` gives a pool of these buffers."""
    buffers = tuple(BufferStats(rule.name, 0, 0, 0, buffer_capacity(rule, 0, 0), 0) for rule in rules)
    return PoolStats(
        generation=0,
        frozen=False,
        reserved_bytes=0,
        peak_bytes=0,
        used_bytes=0,
        budget_bytes=0 if budget else None,
        grow_events=0,
        trim_events=0,
        grow_causes=GrowthCauses(),
        buffers=buffers,
        counters=DeviceCounters(),
    )


def stat_keys(geometry: MaterializeGeometry | None = None, *, budget: bool = False) -> tuple[str, ...]:
    """Every key of ``stats().as_dict()``, in its order, for a pool built with ``geometry`` (the ``k_out`` and
    ``v_out`` slabs only with a geometry) and with a budget (``PoolConfig.max_bytes`` set) or without. The keys do
    not depend on anything else: not on the step shapes, the growth policy or the device."""
    return tuple(_template(buffer_rules(geometry), budget=budget).as_dict())
