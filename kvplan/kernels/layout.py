"""Sizes of the kernels' step-scoped scratch, importable without Triton so the pool can size it up front."""

from __future__ import annotations


def swap_in_workspace_columns(num_steps: int, top_k: int) -> int:
    """int64 columns per batch row the swap-in resolve kernel needs for ``num_steps * top_k`` occurrences."""
    return 3 * num_steps * top_k
