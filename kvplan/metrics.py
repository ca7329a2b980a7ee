"""Prometheus metrics for one or more pools (``pip install kvplan[metrics]``, which brings ``prometheus_client``).

:class:`PoolCollector` is a custom collector: every scrape takes one :meth:`PlanBufferPool.stats` snapshot per pool
(its one device read: the counter vector) and exposes it under Prometheus naming conventions, labelled by
``worker`` (one pool per GPU worker):

=============================  =======  ===================  =============================================
metric (after ``kvplan_pool_``)  type     labels               from ``stats().as_dict()``
=============================  =======  ===================  =============================================
``reserved_bytes``             gauge    worker, stat         ``total.reserved_bytes.{stat}`` (current, peak)
``used_bytes``                 gauge    worker               ``total.used_bytes.current``
``budget_bytes``               gauge    worker               ``total.budget_bytes`` (when a budget is set)
``generation``                 gauge    worker               ``generation``
``frozen``                     gauge    worker               ``frozen`` (0 or 1)
``grow_events_total``          counter  worker               ``total.grow_events``
``trim_events_total``          counter  worker               ``total.trim_events``
``grow_causes_total``          counter  worker, cause        ``total.grow_causes.{cause}``
``launch_records``             gauge    worker               ``total.launch_records``
``launch_graphs``              gauge    worker               ``total.launch_graphs``
``relaunches_total``           counter  worker               ``total.relaunches``
``buffer_reserved_bytes``      gauge    worker, buffer, stat ``{buffer}.reserved_bytes.{stat}``
``buffer_used_bytes``          gauge    worker, buffer       ``{buffer}.used_bytes.current``
``buffer_capacity``            gauge    worker, buffer, dim  ``{buffer}.capacity.{dim}``
``buffer_grow_events_total``   counter  worker, buffer       ``{buffer}.grow_events``
``device_events_total``        counter  worker, stat         ``counters.{stat}``: misses_copied, hits,
                                                             overflow, replayed_rows
``device_bytes_total``         counter  worker, stat         ``counters.{stat}``: bytes_moved, replayed_bytes
=============================  =======  ===================  =============================================

Bytes held are gauges; events and bytes the kernels moved since the last ``reset_counters()`` are counters (a reset
reads as a counter reset, as after a restart). Pool-wide totals and per-buffer values are separate metrics, so a
``sum by (worker)`` over the buffer metric never counts a total twice.

    from prometheus_client import REGISTRY, start_http_server
    from kvplan.metrics import PoolCollector

    REGISTRY.register(PoolCollector({"0": pool}))   # or PoolCollector(pool, worker="0")
    start_http_server(9400)

One collector per registry, holding every pool of the process: its ``describe()`` lists the families, so registering
a second collector (or this one twice) raises the registry's ``ValueError`` ("Duplicated timeseries") instead of
giving every scrape duplicate series, which Prometheus rejects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvplan.metrics needs prometheus_client: pip install 'kvplan[metrics]'") from exc

from kvplan.pool import PlanBufferPool
from kvplan.stats import PoolStats

__all__ = ["PoolCollector", "PREFIX"]

PREFIX = "kvplan_pool"
_EVENT_COUNTERS = ("misses_copied", "hits", "overflow", "replayed_rows")
_BYTE_COUNTERS = ("bytes_moved", "replayed_bytes")


class PoolCollector(Collector):
    """Exposes the stats of ``pools`` (a pool, or ``{worker label: pool}``) at every scrape."""

    def __init__(self, pools: PlanBufferPool | Mapping[str, PlanBufferPool], *, worker: str = "0") -> None:
        if isinstance(pools, PlanBufferPool):
            pools = {worker: pools}
        if not isinstance(pools, Mapping) or not pools:
            raise TypeError(f"pools must be a PlanBufferPool or a non-empty {{worker: pool}} mapping, got {pools!r}")
        for label, pool in pools.items():
            if not isinstance(label, str) or not isinstance(pool, PlanBufferPool):
                raise TypeError(f"pools must map str worker labels to PlanBufferPool, got {label!r}: {pool!r}")
        self._pools = dict(pools)

    def describe(self) -> list[Metric]:
        """The metric families, without samples: a registry refuses a second collector of the same series (two
        collectors, or one registered twice, would give a scrape duplicate series). Reads no stats (no device)."""
        return _Families().all(with_samples_only=False)

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        for worker, pool in self._pools.items():
            families.add(worker, pool.stats())
        yield from families.all()


class _Families:
    """The metric families of one scrape, filled pool by pool."""

    def __init__(self) -> None:
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["worker", *labels])

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["worker", *labels])

        self.reserved = gauge("reserved_bytes", "Bytes the pool's buffers hold (current) and their peak", ["stat"])
        self.used = gauge("used_bytes", "Bytes the last step's views cover", [])
        self.budget = gauge("budget_bytes", "The pool's byte budget (PoolConfig.max_bytes)", [])
        self.generation = gauge("generation", "Reallocations so far (buffers moved when it changed)", [])
        self.frozen = gauge("frozen", "1 while the pool refuses to grow (CUDA graphs captured)", [])
        self.grows = counter("grow_events", "Growths (each reallocates one or more buffers)", [])
        self.trims = counter("trim_events", "Trims back to the last step's needs", [])
        self.causes = counter("grow_causes", "Growths by what outgrew the previous step, or a reserve", ["cause"])
        self.records = gauge("launch_records", "Eager launch layouts the pool has recorded", [])
        self.graphs = gauge("launch_graphs", "Recorded launches relaunched as one CUDA graph", [])
        self.relaunches = counter("relaunches", "Calls launched from a record (checks skipped)", [])
        self.buffer_reserved = gauge(
            "buffer_reserved_bytes", "Bytes one buffer holds (current) and its peak", ["buffer", "stat"]
        )
        self.buffer_used = gauge("buffer_used_bytes", "Bytes of one buffer the last step's views cover", ["buffer"])
        self.capacity = gauge("buffer_capacity", "One buffer's capacity per dimension", ["buffer", "dim"])
        self.buffer_grows = counter("buffer_grow_events", "Growths of one buffer", ["buffer"])
        self.events = counter("device_events", "Events the kernels counted on the device", ["stat"])
        self.moved = counter("device_bytes", "Bytes the kernels copied from the host", ["stat"])

    def add(self, worker: str, stats: PoolStats) -> None:
        self.reserved.add_metric([worker, "current"], stats.reserved_bytes)
        self.reserved.add_metric([worker, "peak"], stats.peak_bytes)
        self.used.add_metric([worker], stats.used_bytes)
        if stats.budget_bytes is not None:
            self.budget.add_metric([worker], stats.budget_bytes)
        self.generation.add_metric([worker], stats.generation)
        self.frozen.add_metric([worker], int(stats.frozen))
        self.grows.add_metric([worker], stats.grow_events)
        self.trims.add_metric([worker], stats.trim_events)
        for cause, count in attrs.asdict(stats.grow_causes).items():
            self.causes.add_metric([worker, cause], count)
        self.records.add_metric([worker], stats.launch_records)
        self.graphs.add_metric([worker], stats.launch_graphs)
        self.relaunches.add_metric([worker], stats.relaunches)
        for buffer in stats.buffers:
            self.buffer_reserved.add_metric([worker, buffer.name, "current"], buffer.reserved_bytes)
            self.buffer_reserved.add_metric([worker, buffer.name, "peak"], buffer.peak_bytes)
            self.buffer_used.add_metric([worker, buffer.name], buffer.used_bytes)
            for dim, value in buffer.capacity:
                self.capacity.add_metric([worker, buffer.name, dim], value)
            self.buffer_grows.add_metric([worker, buffer.name], buffer.grow_events)
        counters = attrs.asdict(stats.counters)
        for name in _EVENT_COUNTERS:
            self.events.add_metric([worker, name], counters[name])
        for name in _BYTE_COUNTERS:
            self.moved.add_metric([worker, name], counters[name])

    def all(self, *, with_samples_only: bool = True) -> list[Metric]:
        families = [value for value in vars(self).values() if isinstance(value, Metric)]
        return [family for family in families if family.samples or not with_samples_only]
