"""The hot-buffer tables' rules are declared once (``kvplan.table_rules``) and run by both checks that guard the
tables: ``HotBufferState`` when it is built, and the swap-in's call check (``check_swap_in``, the kernels', ops', pool's
and reference's) on a call record built around a state. One broken table gets one text from either: its type, dtype,
2-D shape and rows, stored values, one device, and the rules relating the tables.

Texts are written out here rather than imported, so the tests check the module against the docs, not against itself.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers.kernel_calls import STATE_TABLES, per_call, plan_of, state_of, swap_in_args
from torch._subclasses.fake_tensor import FakeTensorMode

from kvplan.calls import swap_in_call
from kvplan.state import HotBufferState
from kvplan.table_rules import TABLES
from kvplan.validate.arguments import check_swap_in

DTYPES = {
    "device_buffer_tokens": torch.int32,
    "device_buffer_locs": torch.int32,
    "lru_slots": torch.int16,
    "host_cache_locs": torch.int64,
    "scratch_locs": torch.int32,
}
# Each table's shape as the texts name it ({R}, {W}: device_buffer_tokens' rows and columns).
SHAPES = {
    "device_buffer_tokens": "[requests, hot + tail]",
    "device_buffer_locs": "[{R}, {W}] (device_buffer_tokens')",
    "lru_slots": "[{R}, hot]",
    "host_cache_locs": "[{R}, max_len]",
    "scratch_locs": "[{R}, scratch]",
}


def _both_refuse(args: dict, error: type[Exception], text: str, **tables: object) -> None:
    """The state built from ``args``' tables with ``tables`` swapped in, and the speculative call of ``args`` whose
    record carries them (built around the good state, as a record built field by field may be), both raise ``error``
    with exactly ``text``."""
    with pytest.raises(error) as built:
        HotBufferState(**{name: args.get(name) for name in STATE_TABLES} | tables)
    rest = per_call(args)
    call = swap_in_call(True, state_of(args), plan=plan_of(args), **rest)._replace(**tables)
    with pytest.raises(error) as checked:
        check_swap_in(call, launch=False)
    assert str(built.value) == text
    assert str(checked.value) == text


def test_the_declaration_is_the_states_fields_and_dtypes():
    assert tuple(t.name for t in TABLES) == tuple(f.name for f in attrs.fields(HotBufferState)) == STATE_TABLES
    assert {t.name: t.dtype for t in TABLES} == DTYPES
    assert [t.name for t in TABLES if t.optional] == ["scratch_locs"]
    state = HotBufferState.allocate(2, 4, 2, 8, scratch=3)
    assert {name: getattr(state, name).dtype for name in STATE_TABLES} == DTYPES


@pytest.mark.parametrize("name", STATE_TABLES)
def test_a_tables_dtype_one_text_from_the_state_and_the_call(name):
    args = swap_in_args(speculative=True)
    other = torch.int64 if DTYPES[name] != torch.int64 else torch.int32
    _both_refuse(args, ValueError, f"{name} must be {DTYPES[name]}, got {other}.", **{name: args[name].to(other)})


@pytest.mark.parametrize("name", STATE_TABLES[:4])
def test_a_table_that_is_not_a_tensor_one_text_from_the_state_and_the_call(name):
    args = swap_in_args(speculative=True)
    _both_refuse(args, TypeError, f"{name} must be a torch.Tensor, got list.", **{name: args[name].tolist()})


def test_the_slot_tables_row_stride_one_text_from_the_state_and_the_call():
    args = swap_in_args(speculative=True)
    locs = args["device_buffer_locs"]
    rows, width = locs.shape
    padded = torch.zeros(rows, width + 3, dtype=locs.dtype)[:, :width]
    padded.copy_(locs)
    text = f"device_buffer_locs must have device_buffer_tokens' row stride {width}, got {width + 3}."
    _both_refuse(args, ValueError, text, device_buffer_locs=padded)


def test_the_state_refuses_another_row_stride_even_for_one_row():
    """The state's rule holds for every table; the call check skips it for one request (its one row's stride is never
    used to address another): one declaration, each check's own reach, as before it was shared."""
    good = {name: getattr(HotBufferState.allocate(1, 4, 2, 8), name) for name in STATE_TABLES}
    padded = torch.zeros(1, 9, dtype=torch.int32)[:, :6]
    with pytest.raises(ValueError, match=r"^device_buffer_locs must have device_buffer_tokens' row stride 6, got 9\.$"):
        HotBufferState(**good | {"device_buffer_locs": padded})


def test_at_most_hot_max_hot_slots_one_text_from_the_state_and_the_call():
    args = swap_in_args(speculative=True)
    rows = args["lru_slots"].shape[0]
    hot = (1 << 15) + 1
    wide = dict(
        device_buffer_tokens=torch.full((rows, hot + 3), -1, dtype=torch.int32),
        device_buffer_locs=torch.zeros(rows, hot + 3, dtype=torch.int32),
        lru_slots=torch.zeros(rows, hot, dtype=torch.int16),
    )
    text = f"lru_slots must have at most {1 << 15} columns (int16 slot numbers), got hot = {hot}."
    _both_refuse(args, ValueError, text, **wide)
    with pytest.raises(ValueError) as allocated:  # (refused before anything is allocated)
        HotBufferState.allocate(rows, hot, 3, 8)
    assert str(allocated.value) == text


def _shape_text(name: str, requests: int, width: int, bad: torch.Tensor) -> str:
    return f"{name} must have shape {SHAPES[name].format(R=requests, W=width)}, got {tuple(bad.shape)}."


def _stored_text(name: str, requests: int, width: int, bad: torch.Tensor) -> str:
    return (
        f"{name} must hold its values as stored, got a negative view (torch applies its negative bit on read; the "
        f"kernel reads the stored values); pass {name}.resolve_neg(), a plain copy."
    )


# rule: (the tables it is shown on, how a table breaks it, its text)
RULES = {
    "2-D": (STATE_TABLES, torch.flatten, _shape_text),
    "rows": (("lru_slots", "host_cache_locs"), lambda t: torch.cat([t, t[:1]]), _shape_text),
    "stored values": (STATE_TABLES, torch._neg_view, _stored_text),
}


@pytest.mark.parametrize(("rule", "name"), [(rule, name) for rule, (names, _, _) in RULES.items() for name in names])
def test_a_tables_shape_and_stored_values_one_text_from_the_state_and_the_call(rule, name):
    _, breaking, text = RULES[rule]
    args = swap_in_args(speculative=True)
    requests, width = args["device_buffer_tokens"].shape
    bad = breaking(args[name])
    _both_refuse(args, ValueError, text(name, requests, width, bad), **{name: bad})


@pytest.mark.parametrize("name", STATE_TABLES[1:])
def test_a_table_on_another_device_one_rule_from_the_state_and_the_call(name, device):
    """One rule and one text, each check naming its own owner of the device: the state its ``device_buffer_tokens``,
    the call its ``top_k_tokens`` (the reference, launching nothing, runs wherever the tensors are). Without a GPU the
    table elsewhere is a fake CUDA tensor (its device is all either check reads before refusing it)."""
    args = swap_in_args(speculative=True, device=device)
    if device.type == "cuda":
        elsewhere = args[name].cpu()
    else:
        with FakeTensorMode():
            elsewhere = torch.empty(args[name].shape, dtype=args[name].dtype, device="cuda")
    given, kernels = elsewhere.device, args["device_buffer_tokens"].device
    with pytest.raises(ValueError) as built:
        HotBufferState(**{n: args.get(n) for n in STATE_TABLES} | {name: elsewhere})
    call = swap_in_call(True, state_of(args), plan=plan_of(args), **per_call(args))._replace(**{name: elsewhere})
    with pytest.raises(ValueError) as checked:
        check_swap_in(call)
    rule = f"{name} must be on the kernels' device {kernels} (that of {{owner}}), got {given}."
    assert str(built.value) == rule.format(owner="device_buffer_tokens")
    assert str(checked.value) == rule.format(owner="top_k_tokens")
