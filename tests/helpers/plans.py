"""Plan comparison for tests: a plan row is a set of copies (docs/kernels.md §2), so rows are compared as multisets of
``(host row, device row)`` pairs; the order a kernel writes them in is free (swap-ins write host-row order)."""

from __future__ import annotations

from torch import Tensor


def plan_row(src: Tensor, dst: Tensor, n: int) -> list[tuple[int, int]]:
    """Entries ``[0, n)`` of one plan row as sorted ``(src, dst)`` pairs."""
    return sorted(zip(src[:n].tolist(), dst[:n].tolist()))


def assert_same_plan_rows(src: Tensor, dst: Tensor, want_src: Tensor, want_dst: Tensor, counts, rows=None) -> None:
    """Rows ``rows`` (default: every row of ``counts``) hold the same copies as the wanted plan's, entries
    ``[0, counts[b])``."""
    counts = [int(n) for n in counts]
    for b in range(len(counts)) if rows is None else rows:
        n = counts[b]
        assert plan_row(src[b], dst[b], n) == plan_row(want_src[b], want_dst[b], n), f"plan row {b} differs"


def assert_host_row_order(src: Tensor, counts) -> None:
    """Swap-ins write each plan row in host-row order (what makes every replay read the host cache in order)."""
    for b, n in enumerate(int(c) for c in counts):
        row = src[b, :n].tolist()
        assert row == sorted(row), f"plan row {b} is not in host-row order"
