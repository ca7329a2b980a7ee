"""The stats schema: one nested structure, one flattening rule, documented once (docs/pool.md §5) and held to the code.

The two tables of docs/pool.md §5 are parsed and expanded (``{a,b}`` to each name, ``{buffer}`` to each buffer of
the second table, ``{dim}`` to that buffer's dimensions); the keys they give must equal ``stat_keys`` and the keys a
real pool reports, with and without a materialize geometry and a budget, and each row's ``PoolStats`` attribute must
hold the value its key reports. Every concrete key quoted elsewhere in the docs or the README must be a real key.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import attrs
import pytest
import torch

from kvplan import MaterializeGeometry, PlanBufferPool, PoolConfig
from kvplan.counters import MISSES_COPIED, NAMES, REPLAYED_BYTES, read_counters
from kvplan.stats import BufferStats, DeviceCounters, GrowthCauses, PoolStats, flatten, stat_keys

ROOT = Path(__file__).resolve().parents[2]
POOL_DOC = ROOT / "docs" / "pool.md"
GEOMETRY = MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
PROJECTION = MaterializeGeometry(n_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, projection=True)
CASES = [(geometry, budget) for geometry in (None, GEOMETRY) for budget in (False, True)] + [(PROJECTION, True)]
CASE_IDS = ["plain", "plain-budget", "geometry", "geometry-budget", "projection-budget"]

# The "present" column of both tables: when a row's keys exist, for (the geometry or None, has a budget).
PRESENT = {
    "always": lambda geometry, budget: True,
    "with a budget": lambda geometry, budget: budget,
    "with a materialize geometry": lambda geometry, budget: geometry is not None,
    "with `MaterializeGeometry(..., projection=True)`": lambda geometry, budget: bool(geometry and geometry.projection),
}


# ------------------------------------------------------------------------------------------------------------------
# The documented schema


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text``: rows of cells, header and separator rows dropped."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(_cells(line))
        elif current:
            tables.append(current[2:])
            current = []
    return tables


def _statistics_section() -> str:
    text = POOL_DOC.read_text()
    start = text.index("## 5. Statistics")
    return text[start : text.index("\n## ", start + 1)]


def _documented_schema() -> tuple[list[tuple[str, str, str]], dict[str, tuple[tuple[str, ...], str]]]:
    """(key pattern, attribute, present) rows, and buffer -> (dims, present)."""
    keys, buffers = _tables(_statistics_section())
    key_rows = []
    for row in keys:
        assert len(row) == 4, row
        pattern, attribute, _, present = row
        assert pattern.startswith("`") and pattern.endswith("`") and present in PRESENT, row
        key_rows.append((pattern.strip("`"), attribute.strip("`"), present))
    buffer_rows = {}
    for name, dims, present in buffers:
        assert present in PRESENT, (name, present)
        buffer_rows[name.strip("`")] = (tuple(re.findall(r"`(\w+)`", dims)), present)
    return key_rows, buffer_rows


def _alternatives(pattern: str) -> list[str]:
    """``a.{b,c}.d`` -> ``a.b.d``, ``a.c.d`` (every ``{x,y}`` group, independently)."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*choices)]


def documented_keys(geometry: MaterializeGeometry | None, budget: bool) -> dict[str, str]:
    """Every key docs/pool.md §5 lists for such a pool -> the ``PoolStats`` attribute the table names for it."""
    key_rows, buffer_rows = _documented_schema()
    buffers = {name: dims for name, (dims, present) in buffer_rows.items() if PRESENT[present](geometry, budget)}
    out: dict[str, str] = {}
    for pattern, attribute, present in key_rows:
        if not PRESENT[present](geometry, budget):
            continue
        filled = [(pattern, attribute)]
        if "{buffer}" in pattern:
            filled = [
                (pattern.replace("{buffer}", name).replace("{dim}", dim), attribute.replace("name", repr(name)))
                for name, dims in buffers.items()
                for dim in (dims if "{dim}" in pattern else ("",))
            ]
        for concrete, attr in filled:
            for key in _alternatives(concrete):
                assert "{" not in key and key not in out, f"docs/pool.md §5 lists {key!r} twice or unexpanded"
                out[key] = attr
    return out


@pytest.mark.parametrize(("geometry", "budget"), CASES, ids=CASE_IDS)
def test_documented_keys_equal_the_keys_the_code_produces(geometry, budget):
    documented = set(documented_keys(geometry, budget))
    listed = stat_keys(geometry, budget=budget)
    assert len(set(listed)) == len(listed)
    assert documented == set(listed), (
        f"only in docs/pool.md §5: {sorted(documented - set(listed))}; only in the code: "
        f"{sorted(set(listed) - documented)}"
    )
    pool = PlanBufferPool("cpu", geometry=geometry, config=PoolConfig(max_bytes=1 << 24 if budget else None))
    assert tuple(pool.stats().as_dict()) == listed  # a fresh pool
    pool.ensure_capacity(batch=3, num_steps=2, top_k=4, total_ctx=5 if geometry is not None else 0)
    pool.trim()
    assert tuple(pool.stats().as_dict()) == listed  # the keys do not depend on what the pool went through


def _attribute_value(stats: PoolStats, key: str, attribute: str) -> int:
    """What the table's ``PoolStats`` attribute column names for ``key``, read off the record."""
    last = key.rsplit(".", 1)[-1]
    match = re.fullmatch(r"buffer\('(\w+)'\)\.(\w+)", attribute)
    if match:
        value = getattr(stats.buffer(match[1]), match[2])
        return dict(value)[last] if match[2] == "capacity" else value
    target: object = stats
    for name in attribute.split("."):
        target = getattr(target, last if name == "*" else name)
    return int(target)


def test_each_documented_attribute_holds_the_value_of_its_key():
    pool = PlanBufferPool("cpu", geometry=GEOMETRY, config=PoolConfig(max_bytes=1 << 24))
    pool.reserve(batch=2, num_steps=1, top_k=2, total_ctx=3)
    pool.ensure_capacity(batch=3, num_steps=2, top_k=4, total_ctx=5)
    pool.ensure_capacity(batch=1, num_steps=1, top_k=2, total_ctx=1)
    pool.trim()
    pool.counters.add_(torch.arange(1, len(NAMES) + 1))  # every counter different
    pool.freeze()
    stats = pool.stats()
    flat = stats.as_dict()
    documented = documented_keys(geometry=GEOMETRY, budget=True)
    assert set(documented) == set(flat)
    for key, attribute in documented.items():
        assert _attribute_value(stats, key, attribute) == flat[key], (key, attribute)
    assert flat["frozen"] == 1 and flat["total.trim_events"] == 1 and flat["total.grow_causes.reserve"] == 1


def test_concrete_keys_quoted_in_the_docs_are_real_keys():
    """Every backticked ``total.*`` / ``{buffer}.{metric}.*`` / ``counters.*`` name in docs/ and the README is a key."""
    keys = set(stat_keys(GEOMETRY, budget=True))
    buffers = "miss_src|miss_dst|miss_count|workspace|k_out|v_out|kv_proj"
    metrics = "reserved_bytes|used_bytes|capacity|grow_events"
    pattern = rf"`((?:total|counters)(?:\.\w+)+|(?:{buffers})\.(?:{metrics})(?:\.\w+)*)`"
    quoted = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for token in re.findall(pattern, path.read_text()):
            quoted.append(token)
            assert token in keys, f"{path.relative_to(ROOT)} quotes {token!r}, which pool.stats().as_dict() lacks"
    assert "counters.misses_copied" in quoted and "miss_src.capacity.columns" in quoted


def test_the_keys_the_pool_contract_names():
    """The pool contract's examples of ``{buffer}.{metric}.{stat}`` keys, its top-level ``generation`` and its four
    growth causes are keys, holding what they name."""
    pool = PlanBufferPool("cpu", geometry=GEOMETRY)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4, total_ctx=6)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4, total_ctx=9)
    stats = pool.stats()
    flat = stats.as_dict()
    assert flat["miss_src.reserved_bytes.current"] == stats.buffer("miss_src").reserved_bytes == 2 * 8 * 8
    assert flat["miss_src.reserved_bytes.peak"] == 2 * 8 * 8
    assert flat["k_out.capacity.ctx"] >= 9
    assert flat["total.reserved_bytes.current"] == stats.reserved_bytes == sum(b.reserved_bytes for b in stats.buffers)
    assert flat["total.grow_events"] == 2 and flat["generation"] == pool.generation == 2
    causes = {cause: flat[f"total.grow_causes.{cause}"] for cause in ("batch", "steps", "top_k", "context")}
    assert causes == {"batch": 1, "steps": 1, "top_k": 1, "context": 2}


# ------------------------------------------------------------------------------------------------------------------
# The rule and the records


def test_flatten_joins_the_path_of_names_with_dots():
    nested = {"generation": 3, "total": {"reserved_bytes": {"current": 8, "peak": 16}}, "counters": {"hits": 0}}
    assert flatten(nested) == {
        "generation": 3,
        "total.reserved_bytes.current": 8,
        "total.reserved_bytes.peak": 16,
        "counters.hits": 0,
    }
    assert flatten({}) == {}


@pytest.mark.parametrize(
    ("nested", "message"),
    [
        ({"a.b": 1}, "stats key component must be a non-empty str without '.', got 'a.b' under ''"),
        ({"a": {"": 1}}, "stats key component must be a non-empty str without '.', got '' under 'a'"),
        ({"a": {1: 1}}, "stats key component must be a non-empty str without '.', got 1 under 'a'"),
        ({"a": {"b": -1}}, "stats value 'a.b' must be a non-negative int, got -1"),
        ({"a": True}, "stats value 'a' must be a non-negative int, got True"),
        ({"a": 1.0}, "stats value 'a' must be a non-negative int, got 1.0"),
        ({"a": None}, "stats value 'a' must be a non-negative int, got None"),
    ],
)
def test_flatten_refuses_what_its_rule_cannot_carry(nested, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        flatten(nested)


def test_as_dict_is_the_flattened_nested_snapshot():
    pool = PlanBufferPool("cpu", geometry=GEOMETRY)
    pool.ensure_capacity(batch=2, top_k=4, total_ctx=3)
    stats = pool.stats()
    nested = stats.as_nested()
    assert list(nested) == ["generation", "frozen", "total", *(b.name for b in stats.buffers), "counters"]
    assert nested["generation"] == stats.generation and nested["frozen"] == 0
    assert all(nested[b.name] == b.as_nested() for b in stats.buffers)
    assert nested["counters"] == attrs.asdict(stats.counters)
    assert nested["total"]["grow_causes"] == attrs.asdict(stats.grow_causes)
    assert stats.as_dict() == flatten(nested)
    assert "budget_bytes" not in nested["total"]


def test_device_counters_share_one_set_of_names():
    """The counter vector's names (kvplan.counters.NAMES), the record's fields, read_counters and the keys agree."""
    assert tuple(attrs.fields_dict(DeviceCounters)) == NAMES
    pool = PlanBufferPool("cpu")
    pool.counters[MISSES_COPIED] += 5
    pool.counters[REPLAYED_BYTES] += 7
    read = read_counters(pool.counters)
    assert tuple(read) == NAMES
    flat = pool.stats().as_dict()
    assert {k.removeprefix("counters."): v for k, v in flat.items() if k.startswith("counters.")} == read
    assert flat["counters.misses_copied"] == 5 and flat["counters.replayed_bytes"] == 7


def _buffer(**changes) -> BufferStats:
    fields = dict(name="miss_src", reserved_bytes=0, peak_bytes=0, used_bytes=0, capacity=(("batch", 0),))
    return BufferStats(**{**fields, "grow_events": 0, **changes})


def _pool_stats(**changes) -> PoolStats:
    fields = dict(
        generation=0,
        frozen=False,
        reserved_bytes=0,
        peak_bytes=0,
        used_bytes=0,
        budget_bytes=None,
        grow_events=0,
        trim_events=0,
        grow_causes=GrowthCauses(),
        buffers=(_buffer(),),
        counters=DeviceCounters(),
    )
    return PoolStats(**{**fields, **changes})


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: _pool_stats(generation=-1), ValueError, "PoolStats.generation must be a non-negative int, got -1"),
        (lambda: _pool_stats(frozen=1), ValueError, "PoolStats.frozen must be a bool, got 1"),
        (lambda: _pool_stats(budget_bytes=-5), ValueError, "PoolStats.budget_bytes must be a non-negative int"),
        (lambda: _pool_stats(peak_bytes=True), ValueError, "PoolStats.peak_bytes must be a non-negative int"),
        (lambda: _pool_stats(grow_causes={}), TypeError, "grow_causes"),
        (lambda: _pool_stats(buffers=({},)), TypeError, "buffers"),
        (lambda: _pool_stats(counters=None), TypeError, "counters"),
        (lambda: _buffer(name="a.b"), ValueError, "BufferStats.name must be a str without '.' and not one of"),
        (lambda: _buffer(name=""), ValueError, "BufferStats.name must be a str without '.'"),
        (lambda: _buffer(name="total"), ValueError, "['counters', 'frozen', 'generation', 'total'], got 'total'"),
        (lambda: _buffer(capacity=(("batch", -1),)), ValueError, "BufferStats.capacity['batch'] must be a non-neg"),
        (lambda: GrowthCauses(batch=1.5), ValueError, "GrowthCauses.batch must be a non-negative int, got 1.5"),
        (lambda: DeviceCounters(hits=-1), ValueError, "DeviceCounters.hits must be a non-negative int, got -1"),
    ],
)
def test_records_validate_on_construction(build, error, message):
    with pytest.raises(error, match=re.escape(message)):
        build()


def test_records_are_frozen_and_a_budget_adds_one_key():
    stats = _pool_stats()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.generation = 1  # type: ignore[misc]
    with_budget = attrs.evolve(stats, budget_bytes=64).as_dict()
    assert set(with_budget) - set(stats.as_dict()) == {"total.budget_bytes"} and with_budget["total.budget_bytes"] == 64
