"""Test set-up: without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is done here, at collection start.
The library itself never sets it in an engine's process (only the CLI does, when no GPU is present).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread per test process: the interpreter is single-threaded and the tensors are tiny, and under
    # `pytest -n 2` (pytest-xdist) a second thread per worker only spins waiting for a core the other worker holds.
    torch.set_num_threads(1)
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Several test processes on one GPU host: each takes its share of the cores for torch's CPU ops (the scenario
    # builders, the reference). Every process at full width oversubscribes the cores, and OpenMP's waiting threads then
    # slow each small CPU op by orders of magnitude (production-shape scenarios took over 200 s under 10 workers).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Kernel tests run on this device: the GPU when there is one, else CPU tensors under the interpreter.
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    """GPU tests sit beside the CPU tests of their module (marked ``gpu``; skipped without a GPU); the hostile passes'
    files (``test_hostile_*``) are marked ``hostile`` so that ``-m hostile`` runs them alone."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine: pytest -m gpu)")
    for item in items:
        if item.path.name.startswith("test_hostile"):
            item.add_marker(pytest.mark.hostile)
        if not HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
