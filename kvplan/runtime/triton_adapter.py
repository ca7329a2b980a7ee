"""Every use of Triton's private runtime in kvplan, in one place behind one version check: whether a kernel is the
interpreter's, the record of a compiled launch (its compiled kernel, grid and argument values) and its relaunch
through Triton's launcher. ``kvplan.runtime.launch_replay`` builds on these; nothing else in kvplan reaches past
Triton's public API (``triton.jit``, ``triton.language``, ``launch_pdl``).

The private surface (``CompiledKernel.run``, ``packed_metadata``, ``launch_metadata``, ``knobs.runtime``'s launch
hooks, ``driver.active``) is checked once at import: under a Triton outside ``TESTED`` or without one of these,
``RELAUNCH`` is False and every launch goes through Triton's public launch path (correct, with its host cost).
tests/kernels/test_triton_adapter.py runs under each supported Triton (CI: the pinned one and the newest served).
"""

from __future__ import annotations

import re
import threading

import torch
import triton

__all__ = ["INTERPRETER_LOCK", "RELAUNCH", "TESTED", "interpreted", "record", "relaunch"]

# The Triton releases (major, minor) this adapter is tested under: the pinned one and the newest served in CI.
TESTED = ((3, 6), (3, 9))


def _version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version text (``"3.6.0"``, ``"3.9.0+git1234"``); ``(0, 0)`` when unreadable."""
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _private_runtime() -> bool:
    """Whether this Triton has the private launcher parts a relaunch uses."""
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.driver import driver  # noqa: F401
    except ImportError:
        return False
    return (
        hasattr(CompiledKernel, "run")
        and hasattr(CompiledKernel, "launch_metadata")
        and hasattr(knobs.runtime, "launch_enter_hook")
        and hasattr(knobs.runtime, "launch_exit_hook")
    )


VERSION = _version(triton.__version__)
# Relaunch through Triton's launcher only where it was tested to work: releases from the oldest tested on, of the
# same major version, with the private parts present (a newer minor is tried: CI runs the newest served).
RELAUNCH = VERSION[0] == TESTED[0][0] and VERSION >= TESTED[0] and _private_runtime()

# Triton's interpreter (TRITON_INTERPRET=1) keeps the running program's grid index and its patched ``tl`` functions in
# module globals, so two launches from two threads mix their programs: wrong results or an InterpreterError. kvplan's
# interpreted launches therefore run one at a time, whichever thread calls (the CPU path is for tests and bring-up;
# compiled launches never take this lock).
INTERPRETER_LOCK = threading.Lock()


def interpreted(fn: object) -> bool:
    """Whether ``fn`` is a kernel Triton's interpreter runs (``triton.jit`` under ``TRITON_INTERPRET=1``)."""
    return type(fn).__name__ == "InterpretedFunction"


class _Address:
    """A tensor's address for Triton's launcher, which calls ``data_ptr()`` on pointer arguments."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _address(t: torch.Tensor) -> int | _Address:
    """A pointer argument as replayed. A GPU tensor's address is its device pointer, passed as an int: Triton's
    launcher then takes it as is instead of calling ``data_ptr()`` and ``cuPointerGetAttribute`` on it (about a
    microsecond per pointer per launch). A host tensor (the pinned KV cache) keeps ``_Address``, so the launcher
    still translates it to the pointer the device uses (registered host memory may map elsewhere)."""
    return t.data_ptr() if t.is_cuda else _Address(t.data_ptr())


def record(fn, kernel: object, grid: tuple[int, ...], args: tuple, kwargs: dict) -> tuple | None:
    """What relaunches ``fn[grid](*args, **kwargs)`` (which returned ``kernel``): ``(compiled kernel, grid of three,
    argument values)``, tensors as their addresses; ``None`` when it cannot be relaunched (no relaunch on this
    Triton, a parameter left to its default, a grid of more than three dimensions)."""
    if not RELAUNCH:
        return None
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    names = getattr(fn, "arg_names", None)
    if kernel is None or names is None or not hasattr(kernel, "packed_metadata") or len(grid) > 3:
        return None
    given = dict(zip(names, args))
    given.update((k, v) for k, v in kwargs.items() if k in names)
    if len(given) != len(names):  # a parameter left to its default: not replayed (never the case in kvplan)
        return None
    values = tuple(_address(v) if isinstance(v, torch.Tensor) else v for v in (given[n] for n in names))
    return kernel, (*grid, 1, 1)[:3], values


def relaunch(launches: list) -> None:
    """Launch recorded kernels again on the current stream (the caller made the right device current); an entry that
    is a callable (a launch made by other means than Triton) is called."""
    from triton import knobs
    from triton.runtime.driver import driver

    active = driver.active
    stream = active.get_current_stream(active.get_current_device())
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    for entry in launches:
        if callable(entry):
            entry()
            continue
        kernel, grid, values = entry
        metadata = kernel.launch_metadata(grid, stream, *values) if enter is not None else None
        kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, metadata, enter, exit_, *values)
