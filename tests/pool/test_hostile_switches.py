"""Hostile inputs, fourth pass (issue 27, the lesser items): environment switches, one rule for a non-int where an int
belongs, ``MissPlan.row_copies`` bounds, the materializer's geometry from its pool, device names torch cannot parse,
and the demo's ``--hot``. Each refusal names the argument, what it expects and what was given."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvplan import FusedKVMaterializer, HotBufferState, MaterializeGeometry, MissPlan, NotAnIntError, PlanBufferPool
from kvplan.compat import sglang
from kvplan.config import PoolConfig, env_flag
from kvplan.counters import check_counter_base

# ---------------------------------------------------------------------------------------------------------------------
# environment switches


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on", " On "])
def test_kvplan_check_on_spellings(monkeypatch, text):
    monkeypatch.setenv("KVPLAN_CHECK", text)
    assert PoolConfig().check is True


@pytest.mark.parametrize("text", ["", "0", "false", "False", "no", "off", " 0", "OFF "])
def test_kvplan_check_off_spellings(monkeypatch, text):
    monkeypatch.setenv("KVPLAN_CHECK", text)
    assert PoolConfig().check is False


@pytest.mark.parametrize("text", ["00", "2", "disable", "n", "of", "-1"])
def test_kvplan_check_refuses_anything_else_by_name(monkeypatch, text):
    monkeypatch.setenv("KVPLAN_CHECK", text)
    with pytest.raises(ValueError, match=rf"^KVPLAN_CHECK must be one of 1, true, yes, on \(on\) or 0, false, no, off "
                                         rf"\(off\), got {text!r}$"):  # fmt: skip
        PoolConfig()
    assert PoolConfig(check=False).check is False  # an explicit setting never reads the environment


def test_env_flag_default_when_unset(monkeypatch):
    monkeypatch.delenv("KVPLAN_TEST_FLAG", raising=False)
    assert env_flag("KVPLAN_TEST_FLAG", True) is True and env_flag("KVPLAN_TEST_FLAG", False) is False


@pytest.mark.parametrize(
    ("text", "policy"),
    [("false", "plain"), ("off", "plain"), ("0", "plain"), (" No ", "plain"), ("yes", "graph"), ("1", "graph"),
     ("", "graph")],
)  # fmt: skip
def test_kvplan_graph_relaunch_spellings(monkeypatch, text, policy):
    """The default of ``PoolConfig.launch_replay``, read per config built: off is ``"plain"`` (relaunched launch by
    launch, no CUDA graph)."""
    monkeypatch.setenv("KVPLAN_GRAPH_RELAUNCH", text)
    assert PoolConfig().launch_replay == policy
    for given in ("graph", "plain", "off"):  # a policy given is never overridden by the environment
        assert PoolConfig(launch_replay=given).launch_replay == given


@pytest.mark.parametrize("text", ["disable", "00", "graph"])
def test_kvplan_graph_relaunch_refuses_anything_else_by_name(monkeypatch, text):
    monkeypatch.setenv("KVPLAN_GRAPH_RELAUNCH", text)
    with pytest.raises(ValueError, match=rf"^KVPLAN_GRAPH_RELAUNCH must be one of 1, true, yes, on \(on\) or 0, false, "
                                         rf"no, off \(off\), got {text!r}$"):  # fmt: skip
        PoolConfig()


def test_kvplan_graph_relaunch_is_not_read_at_import():
    """Importing the launch runtime reads no environment switch: a bad spelling is refused where a config is built."""
    code = "import kvplan.runtime.launch_replay, kvplan.kernels, kvplan.ops; print('imported')"
    env = {**os.environ, "KVPLAN_GRAPH_RELAUNCH": "disable", "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"


# ---------------------------------------------------------------------------------------------------------------------
# one rule for a non-int where an int belongs: a TypeError (NotAnIntError, also a ValueError where that was raised)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.append(0, True, [1]), r"start must be an int in \[0, max_len = 8\]"),
        (lambda s: s.append(True, 0, [1]), r"rid must be an int in \[0, 2\), got bool True"),
        (lambda s: s.append(0, 1.0, [1]), r"start must be an int"),
        (lambda s: s.fill_short(0, True, [1]), r"seq_len must be in \[0, hot = 4\]"),
        (lambda s: s.finish(np.bool_(True)), r"rid must be an int"),
        (lambda s: s.set_hot(torch.tensor(0), [1]), r"rid must be an int"),
        (lambda s: HotBufferState.allocate(True, 4, 2, 8), r"num_reqs must be an int >= 1, got True"),
        (lambda s: HotBufferState.allocate(2, 4.0, 2, 8), r"hot must be an int >= 1, got 4.0"),
        (lambda s: s.check(steps=True), r"steps must be an int >= 1, got True"),
        (lambda s: check_counter_base(True), r"counter_base must be an int in \[0, 4\], got True"),
        (lambda s: MissPlan.allocate(2, 3, "cpu").row_copies(True), r"row must be an int in \[0, 2\), got True"),
    ],
)
def test_a_non_int_is_a_type_error_everywhere(call, message):
    s = HotBufferState.allocate(2, 4, 2, 8)
    with pytest.raises(TypeError, match=message) as info:
        call(s)
    assert isinstance(info.value, NotAnIntError) and isinstance(info.value, ValueError)  # callers of ValueError too


def test_an_int_out_of_range_stays_a_value_error():
    s = HotBufferState.allocate(2, 4, 2, 8)
    for call in (lambda: s.append(0, 9, [1]), lambda: s.append(2, 0, [1]), lambda: s.fill_short(0, 5, [1])):
        with pytest.raises(ValueError) as info:
            call()
        assert not isinstance(info.value, TypeError)
    s.append(np.int64(1), np.int32(0), [1])  # NumPy integers are ints


# ---------------------------------------------------------------------------------------------------------------------
# MissPlan.row_copies


def _plan() -> MissPlan:
    src = torch.arange(6, dtype=torch.int64).view(2, 3)
    return MissPlan(src, (src + 10).to(torch.int32), torch.tensor([1, 5], dtype=torch.int32))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1,), r"^MissPlan.row_copies: row must be an int in \[0, 2\), got -1$"),
        ((2,), r"^MissPlan.row_copies: row must be an int in \[0, 2\), got 2$"),
        ((0, -1), r"^MissPlan.row_copies: count must be an int in \[0, 3\] \(the plan's columns\), got -1$"),
        ((0, 4), r"^MissPlan.row_copies: count must be an int in \[0, 3\] \(the plan's columns\), got 4$"),
    ],
)
def test_row_copies_refuses_rows_and_counts_outside_the_plan(args, message):
    with pytest.raises(ValueError, match=message):
        _plan().row_copies(*args)


def test_row_copies_answers_for_rows_inside_the_plan():
    plan = _plan()
    assert plan.row_copies(0) == [(0, 10)] and plan.row_copies(0, 3) == [(0, 10), (1, 11), (2, 12)]
    assert plan.row_copies(1) == [(3, 13), (4, 14), (5, 15)]  # a stored count past the columns is clamped
    assert plan.row_copies(np.int64(1), 0) == []
    with pytest.raises(TypeError, match="count must be an int"):
        plan.row_copies(0, 2.0)


# ---------------------------------------------------------------------------------------------------------------------
# FusedKVMaterializer's geometry from its pool


def _weights(layers=2, heads=2, dim=8, hidden=16):
    return [torch.randn(2 * heads * dim, hidden) for _ in range(layers)], torch.ones(layers, dim)


@pytest.mark.parametrize("given", [{"head_dim": 8}, {"num_kv_heads": 2}, {}, {"num_kv_heads": 2, "head_dim": 8}])
def test_the_materializer_takes_what_was_not_given_from_the_pools_geometry(given):
    weights, norms = _weights()
    pool = PlanBufferPool("cpu", geometry=MaterializeGeometry(2, 2, 8, torch.float32, projection=True))
    mat = FusedKVMaterializer(weights, norms, 1e-6, torch.randn(16, 8), pool=pool, **given)
    assert (mat.num_kv_heads, mat.head_dim) == (2, 8)


def test_the_materializer_checks_what_was_given_against_the_pools_geometry():
    weights, _ = _weights()  # 2 * 4 * 4 rows, like 2 * 2 * 8
    pool = PlanBufferPool("cpu", geometry=MaterializeGeometry(2, 2, 8, torch.float32, projection=True))
    with pytest.raises(ValueError, match="pool geometry must match the materializer's"):
        FusedKVMaterializer(weights, torch.ones(2, 4), 1e-6, torch.randn(16, 8), pool=pool, head_dim=4,
                            num_kv_heads=4)  # fmt: skip


@pytest.mark.parametrize("given", [{"head_dim": 8}, {}, {"num_kv_heads": 2, "head_dim": 8}])
def test_the_materializer_says_a_pool_without_geometry_has_no_slabs(given):
    weights, norms = _weights()
    with pytest.raises(ValueError, match=r"^FusedKVMaterializer: pool has no materialize slabs; build it with "
                                         r"geometry=MaterializeGeometry"):  # fmt: skip
        FusedKVMaterializer(weights, norms, 1e-6, torch.randn(16, 8), pool=PlanBufferPool("cpu"), **given)


# ---------------------------------------------------------------------------------------------------------------------
# device names torch cannot parse


@pytest.mark.parametrize(
    ("call", "owner"),
    [
        (lambda: sglang.last_miss_plan("nope"), "last_miss_plan"),
        (lambda: sglang.pool_for("nope"), "pool_for"),
        (lambda: MissPlan.allocate(2, 3, device="nope"), "MissPlan.allocate"),
        (lambda: HotBufferState.allocate(2, 4, 2, 8, device="nope"), "HotBufferState.allocate"),
    ],
)
def test_an_unknown_device_name_is_refused_without_torchs_device_list(call, owner):
    with pytest.raises(ValueError, match=rf"^{owner}: device must name a torch device \(e.g. 'cpu', 'cuda', "
                                         r"'cuda:0'\), got 'nope'$") as info:  # fmt: skip
        call()
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_device_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match=r"^last_miss_plan: device must be a torch.device, str or int, got float 1.5$"):
        sglang.last_miss_plan(1.5)
    assert sglang.last_miss_plan("cpu") is None or isinstance(sglang.last_miss_plan("cpu"), MissPlan)


# ---------------------------------------------------------------------------------------------------------------------
# the demo names its flags


def test_demo_names_the_hot_flag_past_the_int16_slot_numbers(capsys):
    from kvplan.cli import main

    assert main(["demo", "--hot", "40000"]) == 2
    assert capsys.readouterr().err == "kvplan demo: --hot: expected an integer <= 32768 (int16 hot-slot numbers), " \
                                      "got 40000\n"  # fmt: skip
