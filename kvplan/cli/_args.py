"""Argument types shared by the CLI subcommands."""

from __future__ import annotations

import argparse


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
