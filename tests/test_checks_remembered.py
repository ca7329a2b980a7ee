"""The kernels' argument checks remember layouts that passed (kvplan.kernels.checks): a call laid out like an earlier
passing one skips the checks, anything that could change the outcome is checked again, refusals are never kept."""

from __future__ import annotations

import pytest
import torch
from test_hostile_kernels import copy_args

from kvplan.kernels import checks


@pytest.fixture(autouse=True)
def fresh_memory():
    checks.check_copy_args.forget()
    yield
    checks.check_copy_args.forget()


def _calls(monkeypatch) -> list[int]:
    """Count the full checks run behind ``check_copy_args`` (its inner ``check_written``)."""
    count = [0]
    inner = checks.check_written

    def counting(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(checks, "check_written", counting)
    return count


def test_a_repeated_layout_is_checked_once(monkeypatch):
    count = _calls(monkeypatch)
    args = copy_args()
    for _ in range(5):
        checks.check_copy_args(counter_base=4, **args)
    assert count[0] == 1
    fresh = {name: t.clone() for name, t in args.items()}  # same shapes, other addresses: checked again
    checks.check_copy_args(counter_base=4, **fresh)
    assert count[0] == 2
    checks.check_copy_args(counter_base=0, **args)  # another non-tensor argument: checked again
    assert count[0] == 3


def test_a_changed_layout_of_the_same_tensor_is_checked_again_and_refused(monkeypatch):
    args = copy_args()
    checks.check_copy_args(counter_base=4, **args)
    buffer = args["device_buffer"]
    buffer.as_strided_((buffer.shape[0], buffer.shape[1]), (0, 1))  # same tensor object, rows now aliased
    with pytest.raises(ValueError, match="device_buffer must not have overlapping elements"):
        checks.check_copy_args(counter_base=4, **args)


def test_refusals_are_never_remembered():
    args = copy_args()
    args["device_buffer"] = args["device_buffer"][:1].expand(24, 10)  # stride-0 rows: every row one row
    for _ in range(2):
        with pytest.raises(ValueError, match="must not have overlapping elements"):
            checks.check_copy_args(counter_base=4, **args)


def test_values_that_cannot_be_keyed_are_checked_in_full():
    args = copy_args()
    with pytest.raises((TypeError, ValueError)):
        checks.check_copy_args(counter_base=[4], **args)  # unhashable: no memory, the full check refuses it
    assert checks.check_copy_args(counter_base=4, **{k: torch.as_tensor(v) for k, v in args.items()}) is None
