"""Launch replay (the eager fast path): the records of checked calls, keyed by their arguments' layout, and their
relaunch under one of three policies (``PoolConfig.launch_replay``): ``"graph"`` (relaunched, and captured as one CUDA
graph on the second relaunch), ``"plain"`` (relaunched launch by launch) or ``"off"`` (nothing kept: every call checked
and launched). A ``LaunchCache`` is owned by whoever hands it to the kernels (a pool holds one); a kernel called
without one checks and launches every call, recording nothing (``UNRECORDED``). Triton's private launcher is reached
only through ``kvplan.runtime.triton_adapter``."""

from __future__ import annotations

import collections
import os
import threading

import attrs
import torch

from kvplan.config import launch_replay_error
from kvplan.runtime.device import device_guard
from kvplan.runtime.triton_adapter import INTERPRETER_LOCK, interpreted, record, relaunch

__all__ = ["CAPTURE_ERRORS", "UNRECORDED", "LaunchCache", "Recorder", "argument_key"]

# ---------------------------------------------------------------------------------------------------------------------
# Launch replay: an engine launches the same buffers with the same shapes every step. A call whose arguments have the
# layout of one that already ran (every tensor's address, shape, strides, dtype, device, pinning and the end of its
# storage; every other value with its type) gets exactly the same kernel arguments, so its checks would pass again and
# Triton would bind, specialise and look up the same compiled kernel again. ``LaunchCache`` skips all of that: it
# remembers the compiled kernels, grids and arguments of a checked call and replays them through Triton's launcher (a
# few microseconds a launch instead of tens). Tensors are remembered as their addresses only (nothing is kept alive); a
# replay happens only when the caller passes live tensors at exactly those addresses. Refused calls raise before
# anything is remembered.


def argument_key(value: object) -> object:
    """What a launch can depend on: a tensor's address, shape, strides, dtype, device, pinning (``True`` on the GPU),
    type, storage end and negative/conjugate bits (a ``torch._neg_view`` or ``conj()`` has its base's address and
    layout, but its data is not what its bits say: the checks refuse it); any other argument's type and value (which
    must be hashable), tuples and attrs records field by field. The type matters: ``8.0 == 8``, ``True == 1`` and
    ``np.int64(8) == 8``, yet the checks refuse the first of each pair, so a refused value must never match an
    accepted one."""
    if isinstance(value, torch.Tensor):
        return _tensor_key(value, type(value))
    if value is None:
        return None
    kind = type(value)
    if isinstance(value, tuple):
        return (kind, tuple(argument_key(v) for v in value))
    if attrs.has(kind):
        return (kind, tuple(argument_key(getattr(value, f.name)) for f in attrs.fields(kind)))
    hash(value)
    if isinstance(value, float):  # 0.0 == -0.0: the text tells them apart
        return (kind, repr(value))
    return (kind, value)


def _tensor_key(t: torch.Tensor, kind: type) -> tuple:
    # ``is_cuda or is_pinned()``: a CPU tensor's pinning decides whether the GPU may read it (a tensor moved from
    # pinned to pageable memory at the same address must be checked again); ``is_cuda`` skips the call on the GPU.
    # The storage's end: with the address, shape, strides and dtype it decides whether the tensor lies inside its
    # storage (a storage freed or shrunk by ``untyped_storage().resize_`` ends elsewhere, even at the same address).
    s = t.untyped_storage()
    pinned = t.is_cuda or t.is_pinned()
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, pinned, kind, s.data_ptr() + s.nbytes(), _bits(t))


def _bits(t: torch.Tensor) -> bool:
    """Whether ``t``'s data is not what its bits say: a negative view (any dtype), or a conjugate one (complex only,
    so the second read is skipped for every other dtype)."""
    return t.is_neg() or (t.dtype in _COMPLEX and t.is_conj())


class Recorder:
    """Launches of one call, recorded for replay. ``relaunchable`` turns False when a launch cannot be replayed (the
    interpreter, a Triton without ``CompiledKernel.run``)."""

    __slots__ = ("launches", "relaunchable")

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.relaunchable = True

    def launch(self, fn, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
        """``fn[grid](*args, **kwargs)``, remembering what to replay. Interpreted launches run one at a time (see
        ``triton_adapter.INTERPRETER_LOCK``) and are never replayed."""
        if interpreted(fn):
            with INTERPRETER_LOCK:
                fn[grid](*args, **kwargs)
            self.relaunchable = False
            return
        kernel = fn[grid](*args, **kwargs)
        if not self.relaunchable:
            return
        entry = record(fn, kernel, grid, args, kwargs)
        if entry is None:
            self.relaunchable = False
            return
        self.launches.append(entry)

    def launch_callable(self, run) -> None:
        """Record a launch made by other means than Triton (the on-chip resolve): ``run()`` launches it again, its
        arguments packed, on the current stream."""
        self.launches.append(run)


class _Unrecorded(Recorder):
    """Launches that are not recorded: a kernel called without launch records launches through ``UNRECORDED`` (one
    shared instance: it keeps nothing, so any number of threads may use it)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.launches: tuple = ()
        self.relaunchable = False

    def launch(self, fn, grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
        """``fn[grid](*args, **kwargs)`` (interpreted launches one at a time, as ``Recorder.launch``)."""
        if interpreted(fn):
            with INTERPRETER_LOCK:
                fn[grid](*args, **kwargs)
            return
        fn[grid](*args, **kwargs)

    def launch_callable(self, run) -> None:
        """A launch made by other means than Triton (already launched): nothing to keep."""


UNRECORDED: Recorder = _Unrecorded()


class _Entry(list):
    """A call's recorded launches, with the full key they were recorded under (entries are found by its hash), the
    CUDA graph of them once it is captured (``False``: capture failed, never tried again), and the lock that guards
    the graph.

    Threads: a relaunch holds ``lock`` from its first launch to its last. CUDA's graph objects are not internally
    synchronised (two threads must never capture into, instantiate or launch one executable graph at the same time),
    so the graph is captured and launched by one thread at a time; and a call's launches are queued together, never
    interleaved with another relaunch of the same call (the same workspace: interleaved, one relaunch would clear what
    the other is resolving). A graph launch goes to the calling thread's current stream, and CUDA orders each launch of
    an executable graph behind its earlier launches, on whatever stream; plain launches go to the current stream, as
    an eager call's do. Uncontended, the lock costs about 0.1 µs; a graph launch holds it a few microseconds."""

    __slots__ = ("key", "graph", "relaunched", "lock")


def _capture(launches: list[tuple]) -> torch.cuda.CUDAGraph | bool:
    """The recorded launches as a CUDA graph, captured on a side stream (thread-local capture mode: other threads'
    CUDA calls meanwhile do not disturb it); ``False`` when capture fails. Capturing runs nothing."""
    try:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                relaunch(launches)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph
    except Exception as error:  # e.g. a launch that cannot be captured: relaunch plainly from now on
        CAPTURE_ERRORS.append(f"{type(error).__name__}: {error}")
        return False


# Why the last captures failed (their calls relaunch launch by launch): the eager benchmark reports them.
CAPTURE_ERRORS: collections.deque[str] = collections.deque(maxlen=8)


def _interpret_setting() -> str | None:
    """``os.environ.get("TRITON_INTERPRET")``, read from the environment's backing dict: the mapping's ``get``
    encodes the key and decodes the value on every call (0.7 µs on a slow host, on every eager launch), the dict
    lookup takes 0.05 µs and decodes only a value that is set (the interpreter's path)."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # (not CPython's os.environ)
        return os.environ.get("TRITON_INTERPRET")
    raw = data.get(_INTERPRET_KEY)
    return None if raw is None else os.environ.decodevalue(raw)


def _record_key(value: object) -> object:
    """``argument_key(value)``, remembered per object for frozen attrs records of plain values (the launch shapes a
    call passes every time, e.g. ``ResolveLaunch``): keying one field by field costs about a microsecond a field.
    The record is kept alive with its key, so its ``id`` is not reused while remembered."""
    hit = _RECORD_KEYS.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    key = argument_key(value)
    kind = type(value)
    if (
        attrs.has(kind)
        and getattr(kind.__setattr__, "__name__", "") == "_frozen_setattrs"  # attrs' frozen classes
        and all(type(getattr(value, f.name)) in _SCALARS for f in attrs.fields(kind))
    ):
        if len(_RECORD_KEYS) >= 256:
            _RECORD_KEYS.clear()
        _RECORD_KEYS[id(value)] = (value, key)
    return key


_RECORD_KEYS: dict[int, tuple[object, object]] = {}
_SCALARS = frozenset({int, bool, float, str, type(None)})
_INTERPRET_KEY = os.environ.encodekey("TRITON_INTERPRET") if hasattr(os.environ, "encodekey") else None
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})  # the dtypes a conjugate view can have
_PLAIN = (int, bool, str)  # keyed inline as (type, value): equal values of one of these types launch alike


class LaunchCache:
    """Checked, recorded calls by argument layout (least recently used dropped first), relaunched under the policy
    ``replay``:

    - ``"graph"``: a call laid out like a recorded one skips its checks and relaunches the recorded launches; on the
      GPU a call of several launches is captured as one CUDA graph on its second relaunch (not while the caller
      captures a graph of its own: then the launches go into that one) and launched as that graph from then on;
    - ``"plain"``: relaunched launch by launch, never captured (no graph memory; a few microseconds more host time
      per launch);
    - ``"off"``: nothing is kept, every call is checked and launched.

    Safe to share between threads: a lookup and its move to the most recent end are one step under a lock, so
    another thread's eviction cannot fall between them (uncontended, the lock costs about 0.1 µs; the launches run
    outside it), and the relaunches of one call take their entry's lock (``_Entry``), so any number of threads and
    streams may relaunch it. Entries are found by the key's hash, computed once per call, and the key itself is
    compared only on a hit."""

    def __init__(self, limit: int = 256, replay: str = "graph") -> None:
        if error := launch_replay_error("LaunchCache: replay", replay):  # (PoolConfig.launch_replay's rule)
            raise error
        self._limit = limit
        self._replay = replay
        self._graphs = replay == "graph"  # (read on every relaunch)
        self._keep = replay != "off"
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.relaunches = 0  # calls launched again from their record (tests and the eager benchmark read it)

    @staticmethod
    def key(values: tuple) -> tuple | None:
        """The layout key of a call's argument values, or ``None`` when one is not hashable (e.g. a fake tensor)."""
        tensor = torch.Tensor
        try:  # plain tensors, None and ints inline (this runs on every eager launch), anything else via argument_key
            keys = [
                (
                    v.data_ptr(), v.shape, v.stride(), (dtype := v.dtype), v.device, v.is_cuda or v.is_pinned(),
                    tensor, (s := v.untyped_storage()).data_ptr() + s.nbytes(),
                    v.is_neg() or (dtype in _COMPLEX and v.is_conj()),
                )
                if (kind := type(v)) is tensor
                else None if v is None else (kind, v) if kind in _PLAIN else _record_key(v)
                for v in values
            ]  # fmt: skip
            return (_interpret_setting(), tuple(keys))
        except Exception:
            return None

    def relaunch(self, key: tuple | None, anchor: torch.Tensor) -> bool:
        """Replay the call of ``key`` on ``anchor``'s device; False (nothing launched) when it is not cached. The
        anchor is read only on a hit: then it was part of a checked call's key, so it is a tensor."""
        if key is None:
            return False
        h = hash(key)
        with self._lock:
            launches = self._entries.get(h)
            if launches is None or launches.key != key:
                return False
            self._entries.move_to_end(h)
            self.relaunches += 1
        with device_guard(anchor.device), launches.lock:  # one relaunch of a call at a time (see _Entry)
            if len(launches) > 1 and self._graphs and anchor.is_cuda and not torch.cuda.is_current_stream_capturing():
                # (not while the caller captures its own graph: then the launches go into that one)
                graph = launches.graph
                if graph is None and launches.relaunched:  # the second relaunch: capture once
                    graph = launches.graph = _capture(launches)
                launches.relaunched = True
                if graph:
                    graph.replay()
                    return True
            relaunch(launches)
        return True

    def remember(self, key: tuple | None, recorder: Recorder) -> None:
        """Keep ``recorder``'s launches for calls of ``key`` (only once the call was checked and launched; never under
        ``replay="off"``)."""
        if key is None or not recorder.relaunchable or not self._keep:
            return
        entry = _Entry(recorder.launches)
        entry.key, entry.graph, entry.relaunched, entry.lock = key, None, False, threading.Lock()
        h = hash(key)
        with self._lock:
            self._entries[h] = entry
            self._entries.move_to_end(h)
            while len(self._entries) > self._limit:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        """Calls recorded (at most ``limit``)."""
        return len(self._entries)

    @property
    def replay(self) -> str:
        """The relaunch policy: ``"graph"``, ``"plain"`` or ``"off"``."""
        return self._replay

    @property
    def limit(self) -> int:
        """Calls kept at most (the least recently used dropped first; 0: none, every call checked in full)."""
        return self._limit

    def graphs(self) -> int:
        """Recorded calls relaunched as a CUDA graph (each holds its graph's device memory until dropped)."""
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.graph)
