"""`kvplan bench`: the benchmarks run from an installed package (no scripts/ beside it), report their goals, and
`--strict` turns a missed goal into exit status 1 (goals not evaluated never fail it)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvplan.benchmarks import goal, materialize, pool, swap_in
from kvplan.cli import main
from kvplan.cli.bench import verdict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A folder holding kvplan as a wheel installs it: built from a copy of the sources and unpacked; a copy of the
    package files when no wheel can be built here. Nothing else of the repository (no scripts/) is beside it."""
    base = tmp_path_factory.mktemp("installed")
    src, site = base / "src", base / "site"
    shutil.copytree(ROOT / "kvplan", src / "kvplan", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base / "dist"),
         str(src)],
        capture_output=True, text=True, timeout=180,
    )
    wheels = sorted((base / "dist").glob("kvplan-*.whl")) if built.returncode == 0 else []
    if wheels:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(site)
            names = wheel.namelist()
        for module in ("__init__", "pool", "materialize", "swap_in"):
            assert f"kvplan/benchmarks/{module}.py" in names, names
    else:
        shutil.copytree(src / "kvplan", site / "kvplan")
    assert not (site / "scripts").exists()
    return site


def _run(site: Path, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_installed_package_runs_bench_without_scripts(installed, tmp_path):
    where = _run(installed, tmp_path, "-c", "import kvplan.benchmarks.swap_in as m; print(m.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout  # not the source checkout

    help_text = _run(installed, tmp_path, "-m", "kvplan", "bench", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--strict" in help_text.stdout and "not evaluated" in help_text.stdout

    out = tmp_path / "results"
    result = _run(installed, tmp_path, "-m", "kvplan", "bench", "pool", "swap_in", "--smoke", "--strict",
                  "--out-dir", str(out))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "Traceback" not in result.stderr and "not found" not in result.stderr
    for name in ("pool", "swap_in"):
        goals = json.loads((out / f"bench_{name}.json").read_text())["goals"]
        assert goals and all(g["met"] is None and g["note"].startswith("--smoke") for g in goals), goals
    assert "pool goals:" in result.stdout and "swap_in goals:" in result.stdout
    assert "kvplan bench: 0 goals met, 0 missed, 22 not evaluated" in result.stdout


def test_strict_exits_1_when_a_goal_is_missed(monkeypatch, tmp_path, capsys):
    missed = [goal("steady state <= 2.0 us per step in every case", "slowest 3.000 us (decode)", False)]
    monkeypatch.setattr(pool, "evaluate_goals", lambda result: missed)
    argv = ["bench", "pool", "--smoke", "--out-dir", str(tmp_path)]
    assert main(argv) == 0  # missed, but not --strict
    assert json.loads((tmp_path / "bench_pool.json").read_text())["goals"] == missed
    capsys.readouterr()
    assert main([*argv, "--strict"]) == 1
    captured = capsys.readouterr()
    assert "[MISSED] steady state <= 2.0 us" in captured.out
    assert "kvplan bench: pool: goal missed: steady state <= 2.0 us per step in every case" in captured.err


def test_verdict_counts_only_measured_misses():
    met, not_run = goal("a", "1", True), goal("b", None, None, "--smoke")
    assert verdict([("x", met), ("x", not_run)], strict=True) == 0
    assert verdict([("x", goal("c", "9", False)), ("x", met)], strict=True) == 1
    assert verdict([("x", goal("c", "9", False))], strict=False) == 0
    assert verdict([], strict=True) == 0


def test_pool_goals():
    cases = [{"case": "decode", "steady_us": 1.1, "speedup": 20.2}, {"case": "mixed", "steady_us": 2.5, "speedup": 8.0}]
    steady, speedup = pool.evaluate_goals({"cases": cases})
    assert steady["met"] is False and "2.500 us (mixed)" in steady["measured"]
    assert speedup["met"] is False and "8.0x (mixed)" in speedup["measured"]
    assert [g["met"] for g in pool.evaluate_goals({"cases": cases[:1]})] == [True, True]
    assert [g["met"] for g in pool.evaluate_goals({"cases": cases, "smoke": True})] == [None, None]


def test_materialize_goals():
    rows = [
        {"T": 2048, "ratio_to_copy": 0.5, "speedup_vs_compiled": 0.5},  # below T=8192: not judged
        {"T": 8192, "ratio_to_copy": 0.92, "speedup_vs_compiled": 2.82},
        {"T": 32768, "ratio_to_copy": 0.96, "speedup_vs_compiled": 2.88},
    ]
    assert [g["met"] for g in materialize.evaluate_goals({"rows": rows})] == [True, True]
    rows[1]["ratio_to_copy"] = 0.80
    bandwidth, compiled = materialize.evaluate_goals({"rows": rows})
    assert bandwidth["met"] is False and "0.80 (T=8192)" in bandwidth["measured"] and compiled["met"] is True
    no_compile = [{"T": 8192, "ratio_to_copy": 0.9, "compiled_us": "skipped"}]
    assert [g["met"] for g in materialize.evaluate_goals({"rows": no_compile})] == [True, None]
    assert [g["met"] for g in materialize.evaluate_goals({"rows": rows[:1]})] == [None, None]


def _swap_in_result(us_by_line: dict, copy_ratio: float) -> dict:
    runs = [{"host_gb": gb, "call": call, "batch": b, "us_per_call": us} for (gb, call, b), us in us_by_line.items()]
    copy = {"label": "default launch", "host_gb": 4.6, "ratio": copy_ratio, "gbps": 20.9, "rows_per_call": 50048}
    return {"runs": runs, "copy_planned": [copy], "smoke": False}


def test_swap_in_goals():
    # docs/benchmarks.md's 2026-12-03 figures for three lines: single 0.6 GB batch 64 is 0.92x SGLang (missed at 0.8x)
    result = _swap_in_result({(0.6, "single", 1): 40.0, (0.6, "single", 64): 375.0, (4.6, "spec", 64): 1577.0}, 0.38)
    goals = {g["goal"]: g for g in swap_in.evaluate_goals(result)}
    assert len(goals) == 18 + 2
    assert goals["single 0.6 GB batch 1: <= 0.8x SGLang"]["met"] is True  # 40.0 <= 0.8 * 51.3
    assert goals["single 0.6 GB batch 64: <= 0.8x SGLang"]["met"] is False
    assert goals["spec 0.6 GB batch 8: <= 0.8x SGLang"]["met"] is None  # not measured
    copy = goals["copy_planned >= 0.85 of the pinned copy ceiling, random rows of the 4.6 GB cache"]
    assert copy["met"] is False and copy["measured"].startswith("0.38")
    assert goals["speculative batch 64 from 4.6 GB <= 650 µs"]["met"] is False
    sglang = swap_in.SGLANG_US
    lines = {(gb, call, b): 0.5 * us for (gb, call), by_batch in sglang.items() for b, us in by_batch.items()}
    lines[(4.6, "spec", 64)] = 600.0
    assert all(g["met"] is True for g in swap_in.evaluate_goals(_swap_in_result(lines, 0.9)))
    assert all(g["met"] is None for g in swap_in.evaluate_goals({**result, "smoke": True}))


def test_scripts_stay_thin_wrappers(tmp_path):
    """The documented `python3 scripts/bench_*.py` commands still run; importing one by path runs nothing, and the
    compile warm-up's worker function is importable by module name (spawned processes pickle it)."""
    spec = importlib.util.spec_from_file_location("bench_swap_in", ROOT / "scripts" / "bench_swap_in.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main is swap_in.main
    assert pickle.loads(pickle.dumps(swap_in._warm)) is swap_in._warm
    out = tmp_path / "pool.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pool.py"), "--smoke", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [c["case"] for c in json.loads(out.read_text())["cases"]] == list(pool.CASES)


def test_eager_goals_are_judged_from_the_json():
    from kvplan.benchmarks import eager

    rows = {
        "pool.swap_in_spec (B=1, S=3, K=64)": 59.0,
        "pool.swap_in (B=1, K=64)": 61.0,
        "kernels.materialize T=1 (outputs given)": 20.0,
        "kernels.materialize T=128 (outputs given)": 50.0,
    }
    goals = eager.evaluate_goals({"device": "cuda:0", "rows_us": rows})
    assert [g["met"] for g in goals] == [True, False, True, False]
    assert all(g["met"] is None for g in eager.evaluate_goals({"device": "cpu", "rows_us": rows}))
    del rows["kernels.materialize T=128 (outputs given)"]
    assert eager.evaluate_goals({"device": "cuda:0", "rows_us": rows})[3]["met"] is None


def test_eager_smoke_runs_on_the_cpu(tmp_path):
    out = tmp_path / "eager.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_eager.py"), "--smoke", "--calls", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and "pool.swap_in_spec (B=1, S=3, K=64)" in data["rows_us"]
    assert all(v > 0 for v in data["rows_us"].values())
