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


def test_a_launch_bound_by_name_records_the_values_in_parameter_order(monkeypatch):
    """kvplan's launches bind every argument by name: the record holds the values in the kernel's parameter order,
    as for a launch bound by position; launch options (``num_warps``, ``launch_pdl``) are not values; a parameter
    left out is not recorded (the call is not relaunched)."""
    monkeypatch.setattr(triton_adapter, "RELAUNCH", True)

    class Kernel:
        arg_names = ["a_ptr", "n", "strides", "BLOCK"]

    class Compiled:
        packed_metadata = ()

    def values(entry):
        return tuple(v.ptr if isinstance(v, triton_adapter._Address) else v for v in entry[2])

    t = torch.zeros(4)
    by_position = triton_adapter.record(Kernel, Compiled(), (2,), (t, 5, (1, 2)), {"BLOCK": 4, "num_warps": 1})
    by_name = triton_adapter.record(
        Kernel, Compiled(), (2,), (), {"BLOCK": 4, "strides": (1, 2), "n": 5, "a_ptr": t, "num_warps": 1,
                                       "launch_pdl": False},
    )  # fmt: skip
    assert by_name[1] == by_position[1] == (2, 1, 1)
    assert values(by_name) == values(by_position) == (t.data_ptr(), 5, (1, 2), 4)
    assert triton_adapter.record(Kernel, Compiled(), (2,), (), {"a_ptr": t, "n": 5, "BLOCK": 4}) is None
