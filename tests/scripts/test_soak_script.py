"""scripts/soak.py in its smoke mode (CI): a few decode steps on the CPU, checked against the reference, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.mark.slow  # a subprocess running checked decode steps under the interpreter
def test_soak_smoke_runs_checks_and_reports(tmp_path):
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--steps", "7", "--check-every", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "soak summary" in result.stdout and "Traceback" not in result.stderr
    report = json.loads(out.read_text())
    assert report["steps"] == 7 and report["mismatch"] is None
    assert report["checked_steps"] == 3 and report["last_checked_step"] == 6  # steps 2, 5 and the last one
    assert report["single_step_calls"] + report["speculative_calls"] == 7
    assert report["grows_after_freeze"] == 0 and report["reserved_maxima"]["batch"] >= 1
    assert report["counters"]["misses_copied"] > 0
    assert [s["step"] for s in report["samples"]] == [2, 4, 6]
    assert report["memory_flat"] is None  # no CUDA device: reported as n/a, not judged


def test_soak_refuses_bad_arguments_before_running(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "missing" / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "soak: --out" in result.stderr and "does not exist" in result.stderr
