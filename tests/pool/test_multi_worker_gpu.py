"""Per-worker pools (issue 7): worker processes each with a pool on its own GPU (sharing cuda:0 on a one-GPU host)."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_two_worker_processes_equal_reference(tmp_path):
    out = tmp_path / "workers.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "multi_gpu_demo.py"),
            "--workers",
            "2",
            "--steps",
            "8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = json.loads(out.read_text())
    assert len(reports) == 2
    gpus = torch.cuda.device_count()
    for rank, report in enumerate(reports):
        assert "error" not in report, report
        assert report["device"] == f"cuda:{rank % gpus}"
        assert report["current_device"] == 0
        assert report["equal_to_reference"] and report["buffers_on_device"]
        assert sum(report["bytes_allocated_on_other_devices"].values()) == 0
        assert report["stats"]["counters.misses_copied"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 machine)")
def test_pool_and_kernels_follow_the_tensor_device_not_the_current_one():
    from kvplan.testing.simulation import DecodeLoop, LoopConfig

    with torch.cuda.device(0):
        before = torch.cuda.memory_allocated(0)
        loop = DecodeLoop(LoopConfig(steps=4, seed=7), "cuda:1", check=True)
        for _ in loop.run():
            pass
        torch.cuda.synchronize(1)
        assert loop.pool.counters.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(0) == before
