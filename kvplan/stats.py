"""Pool statistics as frozen records, flattened by ``as_dict()`` into ``{buffer}.{metric}.{stat}`` integer keys.

The flat schema follows ``torch.cuda.memory_stats()``: predictable keys, every value a non-negative int, so an
exporter (Prometheus, a log line) can take the dict as it is.
"""

from __future__ import annotations

import attrs

__all__ = ["BufferStats", "DeviceCounters", "GrowthCauses", "PoolStats"]


def _count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a non-negative int, got {value!r}")


def _counts(instance: object, attribute: attrs.Attribute, value: tuple[tuple[str, int], ...]) -> None:
    for name, count in value:
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{type(instance).__name__}.{attribute.name}[{name!r}] must be a non-negative int")


@attrs.frozen
class BufferStats:
    """One buffer: bytes reserved now and at peak, bytes the last step's views cover, capacity per dimension."""

    name: str
    reserved_bytes: int = attrs.field(validator=_count)
    peak_bytes: int = attrs.field(validator=_count)
    used_bytes: int = attrs.field(validator=_count)
    capacity: tuple[tuple[str, int], ...] = attrs.field(validator=_counts)  # e.g. (("batch", 8), ("columns", 64))
    grow_events: int = attrs.field(validator=_count)

    def as_dict(self) -> dict[str, int]:
        out = {
            f"{self.name}.reserved_bytes.current": self.reserved_bytes,
            f"{self.name}.reserved_bytes.peak": self.peak_bytes,
            f"{self.name}.used_bytes.current": self.used_bytes,
        }
        out.update({f"{self.name}.capacity.{dim}": value for dim, value in self.capacity})
        out[f"{self.name}.grow_events"] = self.grow_events
        return out


@attrs.frozen
class GrowthCauses:
    """Growths counted by what outgrew the previous step (one growth can have several causes), or a ``reserve``."""

    batch: int = attrs.field(default=0, validator=_count)
    steps: int = attrs.field(default=0, validator=_count)
    top_k: int = attrs.field(default=0, validator=_count)
    context: int = attrs.field(default=0, validator=_count)
    reserve: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class DeviceCounters:
    """The device counter vector (``kvplan.counters``), read once when the stats were taken."""

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
    frozen: bool
    reserved_bytes: int = attrs.field(validator=_count)  # sum over buffers
    peak_bytes: int = attrs.field(validator=_count)  # peak of that sum
    used_bytes: int = attrs.field(validator=_count)
    budget_bytes: int | None
    grow_events: int = attrs.field(validator=_count)  # growths (each reallocates one or more buffers)
    trim_events: int = attrs.field(validator=_count)
    grow_causes: GrowthCauses
    buffers: tuple[BufferStats, ...]
    counters: DeviceCounters

    def buffer(self, name: str) -> BufferStats:
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        raise KeyError(f"no pool buffer named {name!r}; the pool has {', '.join(b.name for b in self.buffers)}")

    def as_dict(self) -> dict[str, int]:
        """Flat ``{buffer}.{metric}.{stat}`` keys, every value a non-negative int (``total.budget_bytes`` only when
        a budget is set)."""
        out = {
            "generation": self.generation,
            "frozen": int(self.frozen),
            "total.reserved_bytes.current": self.reserved_bytes,
            "total.reserved_bytes.peak": self.peak_bytes,
            "total.used_bytes.current": self.used_bytes,
            "total.grow_events": self.grow_events,
            "total.trim_events": self.trim_events,
        }
        if self.budget_bytes is not None:
            out["total.budget_bytes"] = self.budget_bytes
        out.update({f"total.grow_cause.{k}": v for k, v in attrs.asdict(self.grow_causes).items()})
        for buffer in self.buffers:
            out.update(buffer.as_dict())
        c = self.counters
        out.update(
            {
                "swap_in.misses_copied": c.misses_copied,
                "swap_in.bytes_moved": c.bytes_moved,
                "swap_in.hits": c.hits,
                "swap_in.overflow": c.overflow,
                "replay.rows": c.replayed_rows,
                "replay.bytes": c.replayed_bytes,
            }
        )
        return out
