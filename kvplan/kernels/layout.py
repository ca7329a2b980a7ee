"""The swap-in resolve workspace: its regions and size, importable without Triton so the pool can size it up front.

The resolve kernels (``kvplan.kernels.swap_in``) spread one batch row over many programs and pass what one phase
decided to the next through this per-row scratch, read as int32 words (the tensor is int64 ``[batch, columns]``):

========== ================== =========================================================================
region     int32 words        what it holds
========== ================== =========================================================================
keys       ``TB``             hash table of the row's wanted tokens (open addressing, ``-1`` empty)
first      ``TB``             per table entry: the token's first wanted occurrence
hot        ``TB``             per table entry: ``lru position << 16 | slot`` of the least recently used hot
                              slot holding the token (a hit), ``INT32_MAX`` when none does
occ_entry  ``N``              per occurrence: its table entry, ``-2`` wanted but not yet inserted, ``-1`` not
                              wanted (invalid, newest or tail-resolved)
miss_rank  ``N``              per first occurrence of a backed miss: its rank within its occurrence chunk
evict_list ``N``              the first ``N`` evictable hot slots in LRU order (only those can be filled)
hit_bits   ``HOT_MAX / 32``   one bit per LRU position: its slot holds a wanted token
evict_cnt  ``HOT_MAX / 32``   evictable positions per hot chunk (``HOT_CHUNK_MIN`` positions or more)
miss_cnt   ``N / 64`` (>= 1)  backed misses per occurrence chunk (64 occurrences or more)
========== ================== =========================================================================

``N = steps * top_k``; ``TB`` = the power of two >= ``2 * N`` (>= 16): the table is at most half full. The hot regions
have a fixed size because ``lru_slots`` holds int16 slot numbers (``HOT <= HOT_MAX``): the workspace is sized by
``(steps, top_k)`` alone, as the pool sizes it, whatever the engine's hot-buffer size.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HOT_MAX", "WorkspaceLayout", "swap_in_workspace_columns", "swap_in_workspace_layout"]

HOT_MAX = 1 << 15  # lru_slots entries are int16 slot numbers 0 .. HOT - 1
HOT_CHUNK_MIN = 32  # fewest hot positions one resolve program takes (one hit_bits word)
OCC_CHUNK_MIN = 64  # fewest occurrences one resolve program takes when a row has more than that


class WorkspaceLayout(NamedTuple):
    """int32-word offsets of each region inside one workspace row, and the row's size."""

    table_size: int  # TB
    keys: int
    first: int
    hot: int
    occ_entry: int
    miss_rank: int
    evict_list: int
    hit_bits: int
    evict_cnt: int
    miss_cnt: int
    words: int


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def swap_in_workspace_layout(num_steps: int, top_k: int) -> WorkspaceLayout:
    """Where each region of the resolve workspace starts, for ``num_steps * top_k`` occurrences per row."""
    n = num_steps * top_k
    tb = max(16, _next_pow2(2 * n))
    keys = 0
    first = keys + tb
    hot = first + tb
    occ_entry = hot + tb
    miss_rank = occ_entry + n
    evict_list = miss_rank + n
    hit_bits = evict_list + n
    evict_cnt = hit_bits + HOT_MAX // 32
    miss_cnt = evict_cnt + HOT_MAX // HOT_CHUNK_MIN
    words = miss_cnt + max(1, -(-n // OCC_CHUNK_MIN))
    return WorkspaceLayout(tb, keys, first, hot, occ_entry, miss_rank, evict_list, hit_bits, evict_cnt, miss_cnt, words)


def swap_in_workspace_columns(num_steps: int, top_k: int) -> int:
    """int64 columns per batch row the swap-in resolve kernels need for ``num_steps * top_k`` occurrences."""
    return -(-swap_in_workspace_layout(num_steps, top_k).words // 2)
