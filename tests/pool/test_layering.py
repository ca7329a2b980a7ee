"""Imports run one way (docs/architecture.md, "Modules"): the pool, its arena and the materializer reach the kernels
only through ``kvplan.ops``, and the launch runtime (``kvplan/runtime/``), which the kernels and the pool both import,
imports nothing above it. Every import statement counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvplan"


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports (``from a.b import c`` as ``a.b.c`` too: ``c`` may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _reaching(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(name for name in _imported(path) if name.startswith(prefixes))


@pytest.mark.parametrize("module", ["pool.py", "arena.py", "materializer.py"])
def test_the_pool_reaches_the_kernels_only_through_ops(module):
    path = PACKAGE / module
    assert _reaching(path, ("kvplan.kernels",)) == [], f"kvplan/{module} imports the kernels' internals"
    if module == "pool.py":  # (the control: the pool's imports are seen, the ops and the runtime among them)
        assert {"kvplan.ops", "kvplan.runtime.launch_replay"} <= _imported(path)


def test_the_launch_runtime_imports_nothing_above_it():
    """``kvplan.kernels``' package ``__init__`` imports every kernel, and every kernel imports the runtime: a runtime
    module importing any ``kvplan.kernels`` module would be an import cycle, and one importing the pool or the ops
    would put the runtime above them."""
    paths = sorted((PACKAGE / "runtime").glob("*.py"))
    assert {p.name for p in paths} >= {"__init__.py", "launch_replay.py", "triton_adapter.py", "device.py"}
    for path in paths:
        above = ("kvplan.kernels", "kvplan.ops", "kvplan.pool", "kvplan.arena", "kvplan.materializer", "kvplan.compat")
        assert _reaching(path, above) == [], f"kvplan/runtime/{path.name} imports from above the runtime"
    assert "kvplan.runtime.triton_adapter" in _imported(PACKAGE / "runtime" / "launch_replay.py")  # (the control)


def test_the_kernels_import_the_launch_runtime_not_a_copy_of_it():
    """No module under ``kvplan/kernels/`` holds launch replay, the Triton adapter or the device helpers again."""
    kernels = PACKAGE / "kernels"
    moved = ("launch_cache", "launch_replay", "triton_adapter", "device")
    assert [p.name for p in kernels.rglob("*.py") if p.stem in moved] == []
    assert "kvplan.runtime.launch_replay" in _imported(kernels / "hisparse.py")  # (the control)


def test_the_launch_replay_policy_is_one_rule_below_the_runtime():
    """``PoolConfig.launch_replay`` and a ``LaunchCache``'s ``replay`` take the values of one declaration, checked by
    one rule with one text, each naming itself: the rule lives in ``kvplan.config``, below the runtime, which imports
    it (the runtime holds no copy of the values)."""
    from kvplan.config import LAUNCH_REPLAY_POLICIES, PoolConfig
    from kvplan.runtime.launch_replay import LaunchCache

    source = (PACKAGE / "runtime" / "launch_replay.py").read_text()
    assert "kvplan.config.launch_replay_error" in _imported(PACKAGE / "runtime" / "launch_replay.py")
    assert "LAUNCH_REPLAY_POLICIES" not in source and "must be one of" not in source
    for value in ("cuda", "Graph", None, 1):
        with pytest.raises(ValueError) as config:
            PoolConfig(launch_replay=value)
        with pytest.raises(ValueError) as cache:
            LaunchCache(replay=value)
        rule = f"{{name}} must be one of 'graph', 'plain', 'off', got {value!r}"
        assert str(config.value) == rule.format(name="PoolConfig.launch_replay")
        assert str(cache.value) == rule.format(name="LaunchCache: replay")
    for value in LAUNCH_REPLAY_POLICIES:
        assert PoolConfig(launch_replay=value).launch_replay == value
        LaunchCache(replay=value)
