"""The hot-buffer tables' rules are declared once (``kvplan.table_rules``) and run by both checks that guard the
tables: ``HotBufferState`` when it is built, and the swap-in's call check (``check_swap_in``, the kernels', ops', pool's
and reference's) on a call record built around a state. One broken table gets one text from either.

Texts are written out here rather than imported, so the tests check the module against the docs, not against itself.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers.kernel_calls import STATE_TABLES, per_call, plan_of, state_of, swap_in_args

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
