"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse
import os
import pathlib


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
    """A file the command will write at its end, checked before the work starts: its folder exists and is
    writable, and it is not a folder itself. ``ValueError`` naming the option otherwise."""
    target = pathlib.Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable")
    return target


def check_output_dir(option: str, path: str) -> pathlib.Path:
    """A folder the command writes into, created if missing and checked before the work starts."""
    folder = pathlib.Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: folder is not writable")
    return folder
