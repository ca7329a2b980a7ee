"""The adapter in front of Triton's private runtime (kvplan.runtime.triton_adapter), under whichever Triton is
installed: CI runs this file under the pinned Triton and under the newest one served."""

import pytest
import torch
import triton

from kvplan.kernels import hisparse
from kvplan.runtime import triton_adapter
from kvplan.runtime.launch_replay import Recorder


def test_the_installed_triton_is_one_the_adapter_was_tested_under():
    version = triton_adapter._version(triton.__version__)
    oldest, newest = triton_adapter.TESTED[0], triton_adapter.TESTED[-1]
    assert oldest <= version, f"Triton {triton.__version__} is older than the oldest tested, {oldest}"
    # a newer Triton is run, not refused: the adapter checks its private parts instead, and CI says which it tested
    assert version[0] == newest[0], f"Triton {triton.__version__}: a new major version, untested"
    assert triton_adapter._private_runtime(), "this Triton lacks a private launcher part a relaunch uses"
    assert triton_adapter.RELAUNCH


@pytest.mark.parametrize(
    ("text", "version"), [("3.6.0", (3, 6)), ("3.9.0+git1a2b", (3, 9)), ("3.10.1", (3, 10)), ("nightly", (0, 0))]
)
def test_version_texts(text, version):
    assert triton_adapter._version(text) == version


def test_a_record_is_refused_without_relaunch_support(monkeypatch):
    """Where the private launcher is missing (RELAUNCH False) nothing is recorded: every call takes Triton's public
    launch path."""
    monkeypatch.setattr(triton_adapter, "RELAUNCH", False)
    assert triton_adapter.record(hisparse._insert_kernel, object(), (1,), (), {}) is None


def test_interpreted_launches_are_never_recorded():
    if not triton_adapter.interpreted(hisparse._insert_kernel):
        pytest.skip("compiled kernels: the GPU suite records and relaunches them")
    recorder = Recorder()
    ran = []

    class Kernel:  # stands in for an interpreted kernel: launched under the interpreter lock, never recorded
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append((grid, args))

    Kernel.__name__ = "InterpretedFunction"
    recorder.launch(Kernel(), (2,), torch.zeros(1))
    assert ran and recorder.launches == [] and recorder.relaunchable is False
