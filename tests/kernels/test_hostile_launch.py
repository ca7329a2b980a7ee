"""Hostile inputs to the launch path (issue 20, third pass): views reaching past their storage, scalars equal to an
accepted value but of another type, and one launch cache shared by threads.

- A view outlives ``untyped_storage().resize_(0)`` (the FSDP-style free) or a shrinking resize with its shape intact,
  and every other check passes; on the H200 the kernels then hit an illegal address or overwrote unrelated live
  tensors. Every tensor any kernel reads or writes must lie inside its storage: refused naming the argument, the
  bytes its shape, strides and storage offset reach and the bytes its storage holds, by the kernels and the
  references alike, with nothing written; and a call laid out like a checked one is checked again once the storage
  changed (the storage's end is part of the layout key).
- The launch cache compared scalars with ``==``: after a call with int sizes, ``head_dim=8.0``, ``num_kv_heads=True``
  and ``rotary_dim=np.int64(8)`` were replayed unchecked. A refused call is refused every time.
- ``LaunchCache.replay`` looked a key up, then moved it to the recent end: another thread's ``remember`` could evict
  it in between and a ``KeyError`` escaped. Pools (and their launch caches) are shared between threads.
- Fourth pass (issue 27 item 7): under ``TRITON_INTERPRET=1`` kernels called from two threads gave wrong results or
  an ``InterpreterError`` (the interpreter keeps the running program in module globals); launches now run one at a
  time.

Tensors whose storage was freed are never read here (that crashes the process): they are left out of every snapshot.
"""

from __future__ import annotations

import random
import re
import threading
import time

import numpy as np
import pytest
import torch
from helpers.hostile import assert_unchanged, snapshot
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

from kvplan import kernels, reference
from kvplan.kernels import copy, fused_kv, hisparse
from kvplan.kernels.plan_copy.launch import CopyLaunch
from kvplan.runtime import launch_replay
from kvplan.runtime.launch_replay import LaunchCache, Recorder, argument_key

STORAGE = "must lie inside its storage"


def _cut(t: torch.Tensor, how: str) -> int:
    """Free (``resize_(0)``) or shrink ``t``'s storage (2 of its rows; a partial element when it has one row); returns
    the bytes the storage holds afterwards."""
    if how == "freed":
        held = 0
    else:
        rows = 2 if t.shape[0] > 2 else t.shape[0] - 1
        held = rows * (t.numel() // t.shape[0]) * t.element_size() or t.element_size() // 2
    t.untyped_storage().resize_(held)
    return held


def _refusal(name: str, t: torch.Tensor, held: int) -> str:
    """The refusal of a dense ``t`` (storage offset 0) whose storage holds ``held`` bytes."""
    return rf"{name} {STORAGE}: .* reach {t.numel() * t.element_size()} bytes .*its storage holds {held} bytes"


def _victim(args: dict, name: str) -> torch.Tensor:
    """``args[name]`` in a storage of its own, so that cutting it touches no other argument."""
    args[name] = args[name].clone()
    return args[name]


def _assert_each_refuses(args: dict, name: str, victim: torch.Tensor, held: int, call, impls=(kernels, reference)):
    """Each of ``impls`` refuses ``call(impl)`` naming the cut ``args[name]``, and no other argument changes."""
    rest = {k: v for k, v in args.items() if k != name}
    before = snapshot(rest)
    for impl in impls:
        with pytest.raises(ValueError, match=_refusal(name, victim, held)):
            call(impl)
    assert_unchanged(before, rest)


# ---------------------------------------------------------------------------------------------------------------------
# (2) views reaching past their storage


def _swap_in_cases():
    for speculative in (False, True):
        for name in swap_in_args(speculative):
            for how in ("freed", "shrunk"):
                yield pytest.param(speculative, name, how, id=f"{'spec' if speculative else 'single'}-{name}-{how}")


@pytest.mark.parametrize(("speculative", "name", "how"), list(_swap_in_cases()))
def test_swap_in_refuses_a_tensor_past_its_storage(speculative, name, how, device):
    args = swap_in_args(speculative, device)
    victim = _victim(args, name)
    state = state_of(args)  # the tables are checked when wrapped: cut afterwards, as an engine's free would be
    held = _cut(victim, how)
    impls = (kernels,) if name == "workspace" else (kernels, reference)  # the reference takes no workspace

    def call(impl):
        _call_swap_in(impl, speculative, args, state=state)

    _assert_each_refuses(args, name, victim, held, call, impls)
    assert victim.untyped_storage().nbytes() == held


@pytest.mark.parametrize("how", ["freed", "shrunk"])
@pytest.mark.parametrize("name", list(copy_args()))
def test_copy_planned_refuses_a_tensor_past_its_storage(name, how, device):
    args = copy_args(device)
    victim = _victim(args, name)
    held = _cut(victim, how)
    _assert_each_refuses(args, name, victim, held, lambda impl: impl.copy_planned(plan_of(args), **per_call(args)))


@pytest.mark.parametrize("how", ["freed", "shrunk"])
@pytest.mark.parametrize("name", list(materialize_args()))
def test_materialize_refuses_a_tensor_past_its_storage(name, how, device):
    args = materialize_args(device)
    victim = _victim(args, name)
    held = _cut(victim, how)
    _assert_each_refuses(args, name, victim, held, lambda impl: _materialize(impl, args))


def test_the_storage_check_counts_the_offset_and_is_exact(device):
    """Rows 3..26 of a 30-row buffer: a storage cut to end exactly after row 26 holds them, one byte less does not."""
    args = copy_args(device)
    rows, item = args["device_buffer"].shape
    buffer = torch.zeros(rows + 6, item, dtype=args["device_buffer"].dtype, device=device)
    view = buffer[3 : 3 + rows]
    need = (3 + rows) * item * buffer.element_size()
    buffer.untyped_storage().resize_(need - 1)
    args["device_buffer"] = view
    message = rf"device_buffer {STORAGE}: its shape \({rows}, {item}\), strides \({item}, 1\) and storage offset "
    message += rf"{3 * item} reach {need} bytes \({need} elements of 1 B\), its storage holds {need - 1} bytes"
    with pytest.raises(ValueError, match=message):
        kernels.copy_planned(plan_of(args), **per_call(args))
    buffer.untyped_storage().resize_(need)  # (reallocated: every byte it keeps is copied, the new one is not read)
    view.zero_()
    values = {k: v.clone() for k, v in args.items()}
    kernels.copy_planned(plan_of(args), **per_call(args))
    reference.copy_planned(plan_of(values), **per_call(values))
    assert torch.equal(args["device_buffer"], values["device_buffer"]) and int(values["counters"][4]) > 0


def test_empty_views_reach_nothing(device):
    """A view with no elements reaches no byte: an empty context whose ``kv`` storage was freed passes."""
    args = materialize_args(device)
    args["kv"], args["positions"] = args["kv"][:0], args["positions"][:0]
    args["kv"].untyped_storage().resize_(0)
    args["k_out"], args["v_out"] = (torch.empty(3, 0, 2, 8, device=device) for _ in range(2))
    k, v = _materialize(kernels, args)
    assert k is args["k_out"] and v is args["v_out"]


def test_a_device_buffer_freed_between_two_steps_is_refused(device):
    """The issue's example through a state: the device buffer freed FSDP-style between two steps."""
    args = swap_in_args(True, device)
    state = state_of(args)
    _call_swap_in(kernels, True, args, state=state)
    held = _cut(args["device_buffer"], "freed")
    with pytest.raises(ValueError, match=_refusal("device_buffer", args["device_buffer"], held)):
        _call_swap_in(kernels, True, args, state=state)


@pytest.fixture
def replaying(monkeypatch) -> list:
    """The kernel wrappers' calls handed launch records are remembered (also under the interpreter); the launches a
    replay would issue are collected instead of launched."""
    launched: list = []
    monkeypatch.setattr(launch_replay, "relaunch", launched.append)
    for module in (copy, hisparse, fused_kv):
        monkeypatch.setattr(module, "Recorder", _KeepingRecorder)
    return launched


def test_a_replayed_layout_whose_storage_was_freed_is_checked_and_refused(replaying, device):
    copy_call = copy_args(device)
    swap = swap_in_args(True, device)
    state = state_of(swap)
    mat = materialize_args(device)
    records = {kind: LaunchCache() for kind in ("copy", "swap_in", "materialize")}
    calls = (
        ("copy", "device_buffer", copy_call,
         lambda: kernels.copy_planned(plan_of(copy_call), **per_call(copy_call), launch_records=records["copy"])),
        ("swap_in", "device_buffer", swap,
         lambda: _call_swap_in(kernels, True, swap, state=state, launch_records=records["swap_in"])),
        ("materialize", "k_out", mat, lambda: _materialize(kernels, mat, launch_records=records["materialize"])),
    )  # fmt: skip
    for kind, name, args, call in calls:
        for _ in range(2):  # checked and remembered, then replayed
            call()
        assert records[kind].relaunches == 1, kind
        held = _cut(args[name], "freed")
        for _ in range(2):
            with pytest.raises(ValueError, match=_refusal(name, args[name], held)):
                call()
        assert records[kind].relaunches == 1, kind


def test_the_storage_end_is_part_of_the_argument_key():
    """Two tensors alike in address, shape, strides and dtype whose storages end elsewhere key differently (one
    array's memory under two storages); a storage freed in place keys differently from the one it had."""
    memory = np.zeros(20, dtype=np.float32)
    long, short = torch.from_numpy(memory), torch.from_numpy(memory[:12])
    a, b = long[4:12], short[4:12]
    assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
    assert argument_key(a) != argument_key(b)
    assert LaunchCache.key((a,)) != LaunchCache.key((b,))
    same_end = torch.from_numpy(memory[4:12])  # another storage ending where ``short`` does: the same layout
    assert argument_key(same_end) == argument_key(b) and LaunchCache.key((same_end,)) == LaunchCache.key((b,))
    t = torch.zeros(10, 4)
    key = LaunchCache.key((t,))
    t.untyped_storage().resize_(0)
    assert LaunchCache.key((t,)) != key
    assert LaunchCache.key((t,)) == (key[0], (argument_key(t),))  # the inline key is argument_key


# ---------------------------------------------------------------------------------------------------------------------
# (5) scalars equal to an accepted one, of another type


def _materialize_args(heads: int, device) -> dict:
    """``materialize_args`` with ``heads`` KV heads (``num_kv_heads=True`` must meet an accepted call with 1)."""
    gen = torch.Generator().manual_seed(3)
    T, LYR, D, ROT = 4, 2, 8, 8
    args = dict(
        kv=torch.randn(T, LYR, 2 * heads * D, generator=gen),
        k_norm_weight=torch.rand(LYR, D, generator=gen) + 0.5,
        eps=torch.full((LYR,), 1e-6),
        cos_sin_cache=torch.randn(12, ROT, generator=gen),
        positions=torch.tensor([3, 0, 11, 7]),
        k_out=torch.zeros(LYR, T, heads, D),
        v_out=torch.zeros(LYR, T, heads, D),
    )
    return {name: t.to(device) for name, t in args.items()}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dict(head_dim=8.0), "head_dim must be an int, got float 8.0"),
        (dict(num_kv_heads=True), "num_kv_heads must be an int, got bool True"),
        (dict(rotary_dim=np.float32(8)), "rotary_dim must be an int, got float32"),
    ],
    ids=["head_dim=8.0", "num_kv_heads=True", "rotary_dim=np.float32(8)"],
)
def test_materialize_refuses_a_size_of_another_type_every_time(replaying, bad, message, device):
    sizes = dict(num_kv_heads=1, head_dim=8, rotary_dim=8)  # what True, 8.0 and np.int64(8) equal
    args = _materialize_args(1, device)
    tensors = {k: v for k, v in args.items() if k not in ("k_out", "v_out")}
    records = LaunchCache()

    def call(**override):
        outputs = dict(k_out=args["k_out"], v_out=args["v_out"])
        return kernels.materialize(**tensors, **{**sizes, **override}, **outputs, launch_records=records)

    call()
    call()
    assert records.relaunches == 1  # the int call is remembered and replayed
    for _ in range(2):
        with pytest.raises(TypeError, match=message):
            call(**bad)
    call()  # the accepted layout is still replayed
    assert records.relaunches == 2
    call(rotary_dim=np.int64(8), head_dim=np.int32(8))  # NumPy integers are ints (docs/errors.md): the same launch
    assert records.relaunches == 3
    records.clear()  # on a fresh cache: the same refusal
    with pytest.raises(TypeError, match=message):
        call(**bad)


@pytest.mark.parametrize(("good", "bad"), [(4, np.int64(4)), (1, True), (0, False)])
def test_copy_planned_refuses_a_counter_base_of_another_type_every_time(replaying, good, bad, device):
    args = copy_args(device)
    records = LaunchCache()
    for _ in range(2):
        copy.run_copy(plan_of(args), **per_call(args), counter_base=good, records=records)
    assert records.relaunches == 1
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"counter_base must be an int in \[0, 4\], got {re.escape(repr(bad))}"):
            copy.run_copy(plan_of(args), **per_call(args), counter_base=bad, records=records)
    assert records.relaunches == 1


def test_keys_of_equal_values_of_other_types_differ():
    t = torch.zeros(3)
    pairs = [(8, 8.0), (8, np.int64(8)), (1, True), (0, False), (0.0, -0.0), (8.0, np.float64(8.0))]
    pairs += [((8, 8), (8.0, 8)), ((8, 8), (np.int64(8), 8))]
    pairs += [(CopyLaunch(rows_per_program=4), CopyLaunch(rows_per_program=4.0))]
    for good, bad in pairs:
        assert good == bad  # what ``==`` alone would replay
        assert argument_key(good) != argument_key(bad), (good, bad)
        assert LaunchCache.key((t, good)) != LaunchCache.key((t, bad)), (good, bad)
    assert argument_key(CopyLaunch()) == argument_key(CopyLaunch())
    assert LaunchCache.key((t, 8, "x", None)) == LaunchCache.key((t, 8, "x", None))


# ---------------------------------------------------------------------------------------------------------------------
# (6) one launch cache, several threads


class _Yielding:
    """A launch argument whose hash lets other threads run (``time.sleep(0)`` releases the GIL): a thread switch
    then falls inside every cache lookup instead of once in thousands, so a race shows in a few hundred calls."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __hash__(self) -> int:
        time.sleep(0)
        return hash(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Yielding) and other.value == self.value


def test_the_launch_cache_is_safe_under_threads(monkeypatch):
    """The issue's example: 4 threads over 12 layouts with room for 8, so lookups race evictions. Every call either
    replays or misses and remembers; nothing escapes, the count of replays is exact and the cache keeps its limit."""
    launched = []
    monkeypatch.setattr(launch_replay, "relaunch", launched.append)  # list.append: atomic, so every launch is counted
    cache = LaunchCache(limit=8)
    t = torch.zeros(2)
    keys = [cache.key((t, _Yielding(i))) for i in range(12)]
    errors: list[BaseException] = []
    hits = [0] * 4
    start = threading.Barrier(4)

    def work(index: int) -> None:
        rng = random.Random(index)
        recorder = Recorder()
        recorder.launches.append(("kernel", (1, 1, 1), ()))
        start.wait()
        try:
            for _ in range(1000):
                key = keys[rng.randrange(len(keys))]
                if cache.relaunch(key, t):
                    hits[index] += 1
                else:
                    cache.remember(key, recorder)
        except BaseException as error:  # what escaped a thread is the finding
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert cache.relaunches == sum(hits) == len(launched) > 0
    assert len(cache._entries) <= 8


# ---------------------------------------------------------------------------------------------------------------------
# Triton's interpreter under threads (issue 27 item 7)


def _swap_in_and_copy(seed: int, results: list) -> None:
    try:
        for speculative in (True, False):
            swap = swap_in_args(speculative)
            want = {name: t.clone() for name, t in swap.items()}
            _call_swap_in(kernels, speculative, swap)
            _call_swap_in(reference, speculative, want)
            for name in ("top_k_device_locs", "device_buffer_tokens", "lru_slots", "device_buffer", "counters"):
                if not torch.equal(swap[name], want[name]):
                    results.append(f"thread {seed}: swap-in {name} differs")
            args = copy_args()
            args["host_cache"] = args["host_cache"] + seed
            ref = {name: t.clone() for name, t in args.items()}
            kernels.copy_planned(plan_of(args), **per_call(args))
            reference.copy_planned(plan_of(ref), **per_call(ref))
            if not torch.equal(args["device_buffer"], ref["device_buffer"]):
                results.append(f"thread {seed}: copy differs")
    except Exception as error:  # an InterpreterError from a launch mixed with another thread's
        results.append(f"thread {seed}: {error!r}"[:300])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path (a GPU compiles the kernels)")
def test_kernels_called_from_two_threads_under_the_interpreter_equal_the_reference():
    results: list = []
    threads = [threading.Thread(target=_swap_in_and_copy, args=(seed, results)) for seed in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == []
