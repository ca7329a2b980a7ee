"""Launch replay (kvplan.runtime.launch_replay): a kernel call handed launch records, laid out like an earlier checked
one, replays the recorded launches without checking again; a call handed none is checked every time. Anything that
could change the outcome (a tensor's address, shape, strides, dtype, storage end; any other argument's type and value)
keys differently, unhashable values are never keyed, refusals are never recorded, and under the interpreter nothing is
recorded at all: every call is checked. The records relaunch under their policy: as one CUDA graph, launch by launch,
or not at all.

Replay itself needs compiled kernels (a GPU); on the CPU it is exercised with a recorder that keeps its launches and a
stand-in for Triton's launcher, which is enough to test what the wrappers decide to replay.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.kernel_calls import (
    _call_swap_in,
    _KeepingRecorder,
    _materialize,
    copy_args,
    materialize_args,
    per_call,
    plan_of,
    state_of,
    swap_in_args,
)
from helpers.swap_in_scenarios import PATHS, small_launch

from kvplan import kernels
from kvplan.kernels import copy, fused_kv, hisparse
from kvplan.kernels.plan_copy.launch import CopyLaunch, launch_copy
from kvplan.plan import MissPlan
from kvplan.runtime import device as device_helpers
from kvplan.runtime import launch_replay, triton_adapter
from kvplan.runtime.launch_replay import UNRECORDED, LaunchCache, Recorder, argument_key

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
OVERLAP = "must not have overlapping elements"


def _copy(args: dict, **private) -> None:
    """``copy_planned`` on a flat argument dict (``private``: ``_copy_planned``'s knobs, e.g. ``counter_base``)."""
    copy.run_copy(plan_of(args), **per_call(args), **private)


def _counting(monkeypatch, module, name: str) -> list[int]:
    """Count the calls of ``module.name`` (a check the kernel wrapper runs before a launch)."""
    count = [0]
    inner = getattr(module, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return count


# ---------------------------------------------------------------------------------------------------------------------
# argument_key and LaunchCache


def test_argument_key_changes_with_address_shape_strides_and_dtype():
    buf = torch.zeros(40, dtype=torch.int32)
    t = buf[:24].view(4, 6)
    key = argument_key(t)
    assert argument_key(t) == key
    assert argument_key(buf[:24].view(4, 6)) == key  # another tensor object, same memory and layout: same key
    assert argument_key(buf[6:30].view(4, 6)) != key  # address only
    assert argument_key(buf[:18].view(3, 6)) != key  # shape only
    assert argument_key(buf.as_strided((4, 6), (7, 1))) != key  # strides only
    assert argument_key(t.view(torch.float32)) != key  # dtype only
    assert argument_key(torch.zeros(4, 6, dtype=torch.int32)) != key  # an equal tensor elsewhere
    t.as_strided_((4, 6), (0, 1))  # the same tensor object re-laid in place
    assert argument_key(t) != key


def test_pinning_is_part_of_a_host_tensors_key():
    # a GPU may read pinned memory only: the same address and layout, pinned or not, are two layouts
    t = torch.zeros(4, 6)
    key = argument_key(t)
    assert key[5] is False and argument_key(t.view(4, 6)) == key
    assert LaunchCache.key((t,)) == (os.environ.get("TRITON_INTERPRET"), (key,))  # the inline key is argument_key


def test_a_host_tensor_is_replayed_as_an_address_triton_translates():
    t = torch.zeros(3)
    address = triton_adapter._address(t)
    assert (
        isinstance(address, triton_adapter._Address) and address.data_ptr() == t.data_ptr()
    )  # GPU tensors: plain ints


def test_argument_key_of_other_values_is_their_type_and_value():
    # the type too: 4.0, True and np.int64(4) equal 4 but are refused where 4 is accepted
    # (tests/kernels/test_hostile_launch.py)
    assert argument_key(4) == (int, 4) and argument_key(4) != argument_key(0) and argument_key(4) != argument_key(4.0)
    assert argument_key(None) is None
    assert argument_key(CopyLaunch()) == argument_key(CopyLaunch())
    with pytest.raises(TypeError):
        argument_key([4])


def test_cache_key_is_none_for_unhashable_values(monkeypatch):
    t = torch.zeros(3, 2)
    key = LaunchCache.key((t, 4, None))
    assert key is not None and LaunchCache.key((t, 4, None)) == key
    assert LaunchCache.key((t, 0, None)) != key  # another value: another key
    assert LaunchCache.key((t.clone(), 4, None)) != key  # another address: another key
    assert LaunchCache.key((t, [4], None)) is None
    assert LaunchCache.key((t, {"a": 1}, None)) is None
    assert LaunchCache.key(([t], 4, None)) is None
    # launches compiled for the GPU never serve an interpreted call, and the reverse
    monkeypatch.setenv("TRITON_INTERPRET", "0" if INTERPRETED else "1")
    assert LaunchCache.key((t, 4, None)) != key


@pytest.fixture
def replayed(monkeypatch) -> list:
    """Stand-in for Triton's launcher: the launch lists ``LaunchCache.replay`` would launch."""
    launched: list = []
    monkeypatch.setattr(launch_replay, "relaunch", launched.append)
    return launched


def _recorder(relaunchable: bool) -> Recorder:
    recorder = Recorder()
    recorder.launches.append(("kernel", (1, 1, 1), ()))
    recorder.relaunchable = relaunchable
    return recorder


def test_remember_ignores_a_recorder_that_is_not_relaunchable(replayed):
    cache = LaunchCache()
    t = torch.zeros(2)
    key = cache.key((t, 1))
    cache.remember(key, _recorder(relaunchable=False))
    assert not cache.relaunch(key, t)
    assert replayed == [] and cache.relaunches == 0
    good = _recorder(relaunchable=True)  # the control: a relaunchable recorder under the same key is kept and replayed
    cache.remember(key, good)
    assert cache.relaunch(key, t)
    assert replayed == [good.launches] and cache.relaunches == 1


def test_remember_ignores_a_call_without_a_key(replayed):
    cache = LaunchCache()
    cache.remember(None, _recorder(relaunchable=True))
    assert not cache.relaunch(None, torch.device("cpu"))
    assert replayed == [] and cache.relaunches == 0


def test_replay_returns_false_for_unknown_keys(replayed):
    cache = LaunchCache()
    t = torch.zeros(2)
    assert not cache.relaunch(cache.key((t, 1)), t.device)
    cache.remember(cache.key((t, 1)), _recorder(relaunchable=True))
    assert not cache.relaunch(cache.key((t, 2)), t.device)
    assert not cache.relaunch(cache.key((t.clone(), 1)), t.device)
    assert replayed == [] and cache.relaunches == 0
    cache.clear()
    assert not cache.relaunch(cache.key((t, 1)), t.device)
    assert replayed == []


class _Colliding:
    """A value whose hash is the same whatever its value: keys differing only in it have one hash."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Colliding) and other.value == self.value


def test_keys_with_one_hash_never_replay_each_other(replayed):
    # entries are found by the key's hash, then the key itself is compared: a collision is a miss, never a replay
    cache = LaunchCache()
    t = torch.zeros(2)
    first, second = cache.key((t, _Colliding(1))), cache.key((t, _Colliding(2)))
    assert hash(first) == hash(second) and first != second
    cache.remember(first, _recorder(relaunchable=True))
    assert not cache.relaunch(second, t) and replayed == []
    assert cache.relaunch(cache.key((t, _Colliding(1))), t)  # the control: the key itself, built again, is replayed
    cache.remember(second, _recorder(relaunchable=True))  # takes the slot over
    assert cache.relaunch(second, t) and not cache.relaunch(first, t)
    assert cache.relaunches == 2 and len(replayed) == 2


def test_the_least_recently_used_entry_is_dropped_past_the_limit(replayed):
    cache = LaunchCache(limit=2)
    t = torch.zeros(2)
    keys = [cache.key((t, i)) for i in range(3)]
    cache.remember(keys[0], _recorder(relaunchable=True))
    cache.remember(keys[1], _recorder(relaunchable=True))
    assert cache.relaunch(keys[0], t)  # now the most recently used
    cache.remember(keys[2], _recorder(relaunchable=True))
    assert not cache.relaunch(keys[1], t)
    assert cache.relaunch(keys[0], t) and cache.relaunch(keys[2], t)


# ---------------------------------------------------------------------------------------------------------------------
# The relaunch policy: graph, plain, off


class _Graph:
    """Stands in for a captured CUDA graph: counts its launches."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _GpuAnchor:
    """A call's anchor tensor as a relaunch reads it on the GPU (``is_cuda``), on a device that needs no guard."""

    is_cuda = True
    device = torch.device("cpu")


@pytest.fixture
def captured(monkeypatch, replayed) -> list:
    """The graphs captured (the capture stubbed: the CPU has no CUDA graphs); plain relaunches go to ``replayed``."""
    graphs: list = []

    def capture(launches):
        graphs.append(_Graph())
        return graphs[-1]

    monkeypatch.setattr(launch_replay, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return graphs


def _relaunched_four_times(replay: str) -> LaunchCache:
    """A call of two launches, recorded under ``replay`` and then relaunched four times on a GPU anchor."""
    cache = LaunchCache(replay=replay)
    t = torch.zeros(2)
    key = cache.key((t, 1))
    recorder = _recorder(relaunchable=True)
    recorder.launches.append(("kernel", (2, 1, 1), ()))  # two launches: worth a graph
    cache.remember(key, recorder)
    for _ in range(4):
        cache.relaunch(key, _GpuAnchor())
    return cache


def test_graph_replay_captures_a_call_on_its_second_relaunch(captured, replayed):
    cache = _relaunched_four_times("graph")
    assert cache.replay == "graph" and cache.relaunches == 4
    assert len(replayed) == 1 and len(captured) == 1  # the first relaunch plainly, then one capture...
    assert captured[0].replays == 3 and cache.graphs() == 1  # ...launched as a graph from then on


def test_plain_replay_relaunches_launch_by_launch_and_never_captures(captured, replayed):
    cache = _relaunched_four_times("plain")
    assert cache.replay == "plain" and cache.relaunches == 4
    assert len(replayed) == 4 and captured == [] and cache.graphs() == 0


def test_replay_off_keeps_nothing(captured, replayed):
    cache = _relaunched_four_times("off")
    assert cache.replay == "off" and cache.relaunches == 0 and len(cache) == 0
    assert replayed == [] and captured == []


def test_graph_replay_never_captures_a_single_launch_or_a_host_anchor(captured, replayed):
    cache = LaunchCache(replay="graph")
    t = torch.zeros(2)
    one, two = cache.key((t, 1)), cache.key((t, 2))
    cache.remember(one, _recorder(relaunchable=True))  # one launch: a graph would save nothing
    pair = _recorder(relaunchable=True)
    pair.launches.append(("kernel", (2, 1, 1), ()))
    cache.remember(two, pair)
    for _ in range(3):
        assert cache.relaunch(one, _GpuAnchor()) and cache.relaunch(two, t)  # (t: a CPU tensor)
    assert len(replayed) == 6 and captured == []


@pytest.mark.parametrize("bad", ["graphs", "GRAPH", "", None, 1])
def test_an_unknown_replay_policy_is_refused(bad):
    with pytest.raises(ValueError, match=r"LaunchCache: replay must be one of 'graph', 'plain', 'off', got "):
        LaunchCache(replay=bad)


# ---------------------------------------------------------------------------------------------------------------------
# The kernel wrappers: what is checked, what is replayed


def test_refused_calls_raise_every_time(device):
    args = copy_args(device)
    args["device_buffer"] = args["device_buffer"][:1].expand(24, 10)  # stride-0 rows: every row one row
    for _ in range(2):
        with pytest.raises(ValueError, match=f"device_buffer {OVERLAP}"):
            kernels.copy_planned(plan_of(args), **per_call(args))

    swap = swap_in_args(True, device)
    swap["lru_slots"] = swap["lru_slots"][:1].expand(swap["lru_slots"].shape)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"lru_slots {OVERLAP}"):
            _call_swap_in(kernels, True, swap)

    mat = materialize_args(device)
    mat["k_out"] = mat["k_out"][:, :1].expand(mat["k_out"].shape)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"k_out {OVERLAP}"):
            _materialize(kernels, mat)


def test_a_changed_layout_of_the_same_tensor_is_checked_again_and_refused(device):
    args = copy_args(device)
    kernels.copy_planned(plan_of(args), **per_call(args))
    buffer = args["device_buffer"]
    buffer.as_strided_((buffer.shape[0], buffer.shape[1]), (0, 1))  # same tensor object, rows now aliased
    with pytest.raises(ValueError, match=f"device_buffer {OVERLAP}"):
        kernels.copy_planned(plan_of(args), **per_call(args))


def test_values_that_cannot_be_keyed_are_checked_in_full(device):
    args = copy_args(device)
    with pytest.raises(ValueError, match=r"counter_base must be an int in \[0, 4\], got \[4\]"):
        _copy(args, counter_base=[4])  # unhashable: no key, the full check refuses it
    _copy(args, counter_base=4)


@pytest.fixture
def records(monkeypatch, replayed) -> LaunchCache:
    """Fresh launch records for the kernel wrappers, whose calls are remembered (every launch kept, as the GPU's
    recorder keeps them), replays going to ``replayed``."""
    for module in (copy, hisparse, fused_kv):
        monkeypatch.setattr(module, "Recorder", _KeepingRecorder)
    return LaunchCache()


def test_a_repeated_copy_layout_is_checked_once_then_replayed(monkeypatch, records, replayed, device):
    checks = _counting(monkeypatch, copy, "check_copy")
    args = copy_args(device)
    for _ in range(5):
        _copy(args, counter_base=4, records=records)
    assert checks[0] == 1 and records.relaunches == 4 and len(replayed) == 4
    fresh = {name: t.clone() for name, t in args.items()}  # same shapes, other addresses: checked again
    _copy(fresh, counter_base=4, records=records)
    assert checks[0] == 2
    _copy(args, counter_base=0, records=records)  # another non-tensor argument: checked again
    assert checks[0] == 3
    _copy(args, counter_base=4, launch=CopyLaunch(rows_per_program=8), records=records)  # another shape: checked again
    assert checks[0] == 4 and records.relaunches == 4
    args["device_buffer"].as_strided_(tuple(args["device_buffer"].shape), (0, 1))  # re-laid in place: refused
    with pytest.raises(ValueError, match=f"device_buffer {OVERLAP}"):
        _copy(args, counter_base=4, records=records)
    assert checks[0] == 5 and records.relaunches == 4


def test_refusals_are_never_remembered(monkeypatch, records, replayed, device):
    checks = _counting(monkeypatch, copy, "check_copy")
    args = copy_args(device)
    args["device_buffer"] = args["device_buffer"][:1].expand(24, 10)
    for attempt in range(1, 3):
        with pytest.raises(ValueError, match=OVERLAP):
            _copy(args, counter_base=4, records=records)
        assert checks[0] == attempt
    assert records.relaunches == 0 and len(records) == 0 and replayed == []


def test_a_repeated_swap_in_layout_is_replayed_only_when_nothing_is_allocated(monkeypatch, records, device):
    checks = _counting(monkeypatch, hisparse, "check_swap_in")
    args = swap_in_args(True, device)
    state = state_of(args)
    for _ in range(3):
        _call_swap_in(kernels, True, args, state=state, launch_records=records)
    assert checks[0] == 1 and records.relaunches == 2
    no_workspace = {k: v for k, v in args.items() if k != "workspace"}  # allocated per call: never replayed
    for calls in (2, 3):
        _call_swap_in(kernels, True, no_workspace, state=state, launch_records=records)
        assert checks[0] == calls
    assert records.relaunches == 2


def test_a_repeated_materialize_layout_is_replayed_only_with_both_outputs(monkeypatch, records, device):
    checks = _counting(monkeypatch, fused_kv, "check_materialize_args")
    args = materialize_args(device)
    for _ in range(3):
        k, v = _materialize(kernels, args, launch_records=records)
        assert k is args["k_out"] and v is args["v_out"]
    assert checks[0] == 1 and records.relaunches == 2
    for calls in (2, 3):
        _materialize(kernels, dict(args, v_out=None), launch_records=records)  # allocates v_out: never replayed
        assert checks[0] == calls
    assert records.relaunches == 2


def test_without_launch_records_every_call_is_checked_and_nothing_recorded(monkeypatch, replayed, device):
    """The kernels keep no records of their own: a call handed none is checked and launched every time, through the
    recorder that keeps nothing, even where launches could be recorded (the keeping recorder stands in for the
    GPU's), and no layout key is even built."""
    for module in (copy, hisparse, fused_kv):
        monkeypatch.setattr(module, "Recorder", _KeepingRecorder)
    keyed, key = [0], LaunchCache.key

    def counting_key(values):
        keyed[0] += 1
        return key(values)

    monkeypatch.setattr(LaunchCache, "key", staticmethod(counting_key))
    copy_checks = _counting(monkeypatch, copy, "check_copy")
    swap_checks = _counting(monkeypatch, hisparse, "check_swap_in")
    mat_checks = _counting(monkeypatch, fused_kv, "check_materialize_args")
    args, swap, mat = copy_args(device), swap_in_args(True, device), materialize_args(device)
    state = state_of(swap)
    for calls in (1, 2, 3):
        kernels.copy_planned(plan_of(args), **per_call(args))
        _call_swap_in(kernels, True, swap, state=state)
        _materialize(kernels, mat)
        assert (copy_checks[0], swap_checks[0], mat_checks[0]) == (calls, calls, calls)
    assert keyed[0] == 0 and replayed == []
    assert UNRECORDED.launches == () and not UNRECORDED.relaunchable  # the shared recorder kept nothing
    with_records = LaunchCache()  # the control: the same calls handed records are relaunched
    for _ in range(2):
        kernels.copy_planned(plan_of(args), **per_call(args), launch_records=with_records)
    assert copy_checks[0] == 4 and with_records.relaunches == 1 and len(replayed) == 1 and keyed[0] == 2


def _module_launch_caches(module) -> list[str]:
    return [name for name, value in vars(module).items() if isinstance(value, LaunchCache)]


def test_no_kernel_module_keeps_launch_records_of_its_own():
    """Launch records belong to whoever hands them to the kernels (a pool): no module of ``kvplan.kernels`` (nor
    ``kvplan.ops``) holds a ``LaunchCache`` at module level."""
    import importlib
    import pkgutil

    import kvplan.kernels
    import kvplan.ops

    names = [info.name for info in pkgutil.walk_packages(kvplan.kernels.__path__, "kvplan.kernels.")]
    assert {"kvplan.kernels.copy", "kvplan.kernels.hisparse", "kvplan.kernels.fused_kv"} <= set(names)
    for name in [*names, "kvplan.kernels", "kvplan.ops"]:
        module = importlib.import_module(name)
        assert _module_launch_caches(module) == [], name
        assert not hasattr(module, "LAUNCHES"), name


def test_every_launch_binds_every_parameter_of_its_kernel_by_name(monkeypatch, device):
    """Every Triton launch of kvplan passes its kernel's parameters by name, none by position and none left out, so its
    record holds every value in the kernel's parameter order (``triton_adapter.record``). The swap-in on each path,
    single-step and speculative, a replay with the swap-in's workspace and a materialize launch every kernel."""
    launched = []
    for kind in (Recorder, type(UNRECORDED)):  # (calls handed no records launch through UNRECORDED)
        original = kind.launch

        def recording(self, fn, grid, *args, original=original, **kwargs):
            launched.append((fn, args, kwargs))
            return original(self, fn, grid, *args, **kwargs)

        monkeypatch.setattr(kind, "launch", recording)
    for path in PATHS:
        monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
        for speculative in (True, False):
            args = swap_in_args(speculative, device)
            _call_swap_in(kernels, speculative, args)
            kernels.copy_planned(plan_of(args), args["host_cache"], torch.zeros_like(args["device_buffer"]),
                                 workspace=args["workspace"])  # fmt: skip
    _materialize(kernels, materialize_args(device))
    for fn, args, kwargs in launched:
        assert args == () and set(fn.arg_names) <= kwargs.keys(), (fn.arg_names, len(args), sorted(kwargs))
    names = {fn.fn.__name__ for fn, _, _ in launched}
    assert names == {
        "_prep_kernel", "_insert_kernel", "_place_kernel", "_resolve_row_kernel", "_sort_plan_kernel",
        "_copy_entries_kernel", "_copy_host_reads_kernel", "_copy_shared_entries_kernel",
        "_copy_reads_then_shared_kernel", "_materialize_kernel",
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Under the interpreter nothing is recorded: every call is checked


interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="the interpreter's launches (TRITON_INTERPRET=1)")


@interpreted_only
def test_a_recorder_of_an_interpreted_launch_is_not_relaunchable():
    args = copy_args()
    recorder = Recorder()
    launch_copy(
        plan_of(args),
        args["host_cache"],
        args["device_buffer"],
        num_real_reqs=args["num_real_reqs"],
        counters=args["counters"],
        counter_base=4,
        recorder=recorder,
    )
    assert int(args["counters"][4]) > 0  # the launch ran
    assert not recorder.relaunchable and recorder.launches == []


@interpreted_only
def test_under_the_interpreter_every_call_is_checked(monkeypatch, replayed):
    """Even handed launch records: an interpreted launch is never recorded."""
    records = LaunchCache()
    copy_checks = _counting(monkeypatch, copy, "check_copy")
    args = copy_args()
    for _ in range(3):
        kernels.copy_planned(plan_of(args), **per_call(args), launch_records=records)
    assert copy_checks[0] == 3

    swap_checks = _counting(monkeypatch, hisparse, "check_swap_in")
    swap = swap_in_args(True)
    state = state_of(swap)
    for _ in range(2):  # plan and workspace given: the call would be keyed, yet nothing was recorded
        _call_swap_in(kernels, True, swap, state=state, launch_records=records)
    assert swap_checks[0] == 2

    mat_checks = _counting(monkeypatch, fused_kv, "check_materialize_args")
    mat = materialize_args()
    for _ in range(2):
        _materialize(kernels, mat, launch_records=records)
    assert mat_checks[0] == 2

    assert records._entries == {} and records.relaunches == 0
    assert replayed == []


def test_no_launch_starts_early_off_hopper_or_under_the_interpreter(monkeypatch):
    """Programmatic dependent launch needs compiled kernels on Hopper or later: a CPU tensor's launch, an interpreted
    kernel (whatever the device) and a pre-Hopper GPU launch in order."""
    interpreted = hisparse._insert_kernel
    assert not device_helpers.dependent_launch(torch.device("cpu"), interpreted)
    monkeypatch.setattr(device_helpers, "_hopper_or_later", lambda device: True)
    if triton_adapter.interpreted(interpreted):
        assert not device_helpers.dependent_launch(torch.device("cuda", 0), interpreted)

    class Compiled:  # a stand-in for a compiled kernel (not Triton's interpreter's function)
        pass

    assert device_helpers.dependent_launch(torch.device("cuda", 0), Compiled())
    monkeypatch.setattr(device_helpers, "_hopper_or_later", lambda device: False)
    assert not device_helpers.dependent_launch(torch.device("cuda", 0), Compiled())


def test_frozen_launch_records_are_keyed_once_and_by_identity():
    """A frozen record of plain values (a launch shape passed on every call) is keyed once per object; an equal
    record of other field types keys as itself (128.0 is not 128), and a record holding a tensor is keyed afresh
    every time (its tensor may move)."""
    shape = hisparse.ResolveLaunch(occ_chunk=128)
    first = LaunchCache.key((shape,))
    assert LaunchCache.key((shape,)) == first == (first[0], (argument_key(shape),))
    assert launch_replay._RECORD_KEYS[id(shape)][0] is shape
    as_float = hisparse.ResolveLaunch(occ_chunk=128.0)
    assert as_float == shape  # equal as attrs records...
    assert LaunchCache.key((as_float,)) != first  # ...but not launched alike
    plan = MissPlan.allocate(1, 4, "cpu")
    before = LaunchCache.key((plan,))
    assert id(plan) not in launch_replay._RECORD_KEYS
    plan.src.untyped_storage().resize_(0)  # the record's tensor no longer lies inside its storage
    assert LaunchCache.key((plan,)) != before
