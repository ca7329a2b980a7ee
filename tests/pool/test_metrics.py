"""kvplan.metrics: the Prometheus collector's exposition text, parsed back, equals the pools' stats."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvplan import MaterializeGeometry, PlanBufferPool, PoolConfig  # noqa: E402
from kvplan.metrics import PoolCollector  # noqa: E402
from kvplan.testing.sparse_attention import AttentionCheckConfig, SparseAttentionCheck  # noqa: E402


def _scrape(collector: PoolCollector) -> dict[str, tuple[str, dict[tuple, float]]]:
    """``{family name: (type, {sorted label items: value})}`` from the text a Prometheus server would read."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = (family.type, {tuple(sorted(s.labels.items())): s.value for s in family.samples})
    return out


def test_exposition_matches_the_stats_of_two_workers():
    geometry = MaterializeGeometry(2, 2, 16, torch.float32)
    pools = {
        "0": PlanBufferPool("cpu", geometry=geometry, config=PoolConfig(max_bytes=1 << 30)),
        "1": PlanBufferPool("cpu"),
    }
    pools["0"].ensure_capacity(batch=4, num_steps=2, top_k=8, total_ctx=16)
    pools["1"].reserve(batch=2, num_steps=1, top_k=4)
    pools["1"].freeze()
    metrics = _scrape(PoolCollector(pools))
    for worker, pool in pools.items():
        flat = pool.stats().as_dict()
        w = ("worker", worker)
        assert metrics["kvplan_pool_reserved_bytes"][1][(("stat", "peak"), w)] == flat["total.reserved_bytes.peak"]
        assert metrics["kvplan_pool_generation"][1][(w,)] == flat["generation"]
        assert metrics["kvplan_pool_frozen"][1][(w,)] == flat["frozen"]
        assert metrics["kvplan_pool_grow_events"][1][(w,)] == flat["total.grow_events"]
        names = {b.name for b in pool.stats().buffers}
        checked = set()
        for key, value in flat.items():
            parts = key.split(".")
            if parts[0] in names and parts[1] == "reserved_bytes":
                labels = (("buffer", parts[0]), ("stat", parts[2]), w)
                assert metrics["kvplan_pool_buffer_reserved_bytes"][1][labels] == value
            elif parts[0] in names and parts[1] == "capacity":
                assert metrics["kvplan_pool_buffer_capacity"][1][(("buffer", parts[0]), ("dim", parts[2]), w)] == value
            elif parts[:2] == ["total", "grow_causes"]:
                assert metrics["kvplan_pool_grow_causes"][1][(("cause", parts[2]), w)] == value
            else:
                continue
            checked.add(parts[1])
        assert checked == {"reserved_bytes", "capacity", "grow_causes"}
    assert metrics["kvplan_pool_budget_bytes"][1] == {(("worker", "0"),): float(1 << 30)}  # only the pool with one
    buffers = {b for (b, _, _) in metrics["kvplan_pool_buffer_capacity"][1]}
    assert buffers >= {("buffer", "k_out"), ("buffer", "miss_src")}
    types = {name: kind for name, (kind, _) in metrics.items()}
    assert types["kvplan_pool_reserved_bytes"] == types["kvplan_pool_buffer_used_bytes"] == "gauge"
    assert types["kvplan_pool_grow_events"] == types["kvplan_pool_device_events"] == "counter"
    assert all(name.startswith("kvplan_pool_") for name in metrics)


def test_device_counters_are_counters_that_follow_the_kernels(device):
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=2, context=40), device)
    collector = PoolCollector(check.pool, worker="gpu0")
    before = _scrape(collector)["kvplan_pool_device_events"][1][(("stat", "misses_copied"), ("worker", "gpu0"))]
    check.step()
    after = _scrape(collector)
    counters = check.pool.stats().as_dict()
    events, moved = after["kvplan_pool_device_events"][1], after["kvplan_pool_device_bytes"][1]
    assert before == 0 < events[(("stat", "misses_copied"), ("worker", "gpu0"))] == counters["counters.misses_copied"]
    assert events[(("stat", "hits"), ("worker", "gpu0"))] == counters["counters.hits"]
    assert moved[(("stat", "bytes_moved"), ("worker", "gpu0"))] == counters["counters.bytes_moved"] > 0
    text = generate_latest(_registry(collector)).decode()
    assert "# TYPE kvplan_pool_device_events_total counter" in text and "kvplan_pool_device_events_total{" in text


def _registry(collector: PoolCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_registering_reads_nothing_and_bad_arguments_are_refused():
    class Counting(PlanBufferPool):
        reads = 0

        def stats(self):
            Counting.reads += 1
            return super().stats()

    collector = PoolCollector(Counting("cpu"))
    _registry(collector)
    assert Counting.reads == 0  # describe() lists the families without samples: registration reads no device
    generate_latest(_registry(collector))
    assert Counting.reads == 1  # one stats() per pool per scrape
    with pytest.raises(TypeError, match="PlanBufferPool or a non-empty"):
        PoolCollector({})
    with pytest.raises(TypeError, match="str worker labels"):
        PoolCollector({0: PlanBufferPool("cpu")})
