"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile


def integer(text: str) -> int:
    """An integer option: argparse reports anything else as ``--flag: expected an integer, got 'text'``."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    """A number option (``nan`` and ``inf`` parse; the command checks the range)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def check_int(option: str, value: int, low: int, high: int | None = None, *, meaning: str = "") -> int:
    """``value`` of ``option`` (as the user typed it) in ``[low, high)``, else ``ValueError`` naming the option, what
    it expects (``meaning``: what the value is) and what was given."""
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {_power(high)})"
        about = f" ({meaning})" if meaning else ""
        raise ValueError(f"{option}: expected an integer {bound}{about}, got {value}")
    return value


def _power(n: int) -> str:
    """2**64 rather than 18446744073709551616."""
    return f"2**{n.bit_length() - 1}" if n > 1 << 20 and n & (n - 1) == 0 else str(n)


def int_list(text: str) -> tuple[int, ...]:
    """``"4,8"`` -> ``(4, 8)``; argparse reports anything else with the text given."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_list(text: str) -> tuple[int, ...]:
    """:func:`int_list` with at least one value, every one >= 1."""
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def check_output_file(option: str, path: str) -> pathlib.Path:
    """A file the command will write at its end, checked before the work starts by opening it for writing (so it
    holds as root and on /proc or /sys too): not empty, not a folder, in a folder that exists. An existing file is
    left as it was (opened for appending, nothing written); a new one is removed again. ``ValueError`` naming the
    option otherwise."""
    if not path:
        raise ValueError(f"{option}: expected a file name, got ''")
    target = pathlib.Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: folder {folder} does not exist")
    existed = os.path.lexists(target)
    try:  # O_NONBLOCK: a FIFO without a reader is refused instead of blocking
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as exc:
        raise ValueError(f"{option} {path}: not writable ({exc.strerror or exc})") from None
    if not existed:
        target.unlink(missing_ok=True)
    return target


def check_output_dir(option: str, path: str) -> pathlib.Path:
    """A folder the command writes into, created if missing and checked before the work starts by creating (and
    removing) a file in it."""
    if not path:
        raise ValueError(f"{option}: expected a folder, got ''")
    folder = pathlib.Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create the folder ({exc.strerror or exc})") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".kvplan-write-check-", dir=folder)
    except OSError as exc:
        raise ValueError(f"{option} {path}: folder is not writable ({exc.strerror or exc})") from None
    os.close(handle)
    os.unlink(probe)
    return folder


def check_device(option: str, text: str | None, default: str):
    """``--device``: ``None`` gives ``default``; otherwise a CPU (index 0 or none) or a visible CUDA GPU, checked
    before the work starts. ``ValueError`` naming the option otherwise."""
    import torch

    if text is None:
        return torch.device(default)
    if not text:
        raise ValueError(f"{option}: expected cpu, cuda or cuda:N, got ''")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{option} {text!r} is not a torch device ({reason})") from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ValueError(f"{option} {text}: the CPU is device cpu or cpu:0, got index {device.index}")
        return torch.device("cpu")  # cpu:0 is the CPU; tensors made there report "cpu"
    if device.type != "cuda":
        raise ValueError(f"{option} must be cpu or cuda[:N], got {device}")
    if not torch.cuda.is_available():
        raise ValueError(f"{option} {device} needs a CUDA GPU, none is visible; use {option} cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{option} {text}: only {count} CUDA device(s) visible, cuda:0 to cuda:{count - 1}")
    return device
