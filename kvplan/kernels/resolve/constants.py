"""Constants of the Triton resolve kernels: row words, table entry layout, block sizes (``tl.constexpr``)."""

from __future__ import annotations

import triton.language as tl

from kvplan.counters import HITS, OVERFLOW
from kvplan.workspace import (
    CLEARED,
    CURRENT,
    EMPTIES,
    EPOCH,
    FORMAT,
    HASH,
    HASH_HI,
    HOST_ROW_LIMIT,
    KEY_SHIFT,
    LOW_MASK,
    PADDING,
    SHARED,
    STAMP_SHIFT,
    TAG_PERIOD,
)

_HITS = tl.constexpr(HITS)
_OVERFLOW = tl.constexpr(OVERFLOW)
_SHARED = tl.constexpr(SHARED)
_CURRENT = tl.constexpr(CURRENT)
_EPOCH = tl.constexpr(EPOCH)
_CLEARED = tl.constexpr(CLEARED)
_FORMAT = tl.constexpr(FORMAT)
_EMPTIES = tl.constexpr(EMPTIES)
_PADDING = tl.constexpr(PADDING)
_TAG_PERIOD = tl.constexpr(TAG_PERIOD)
_HOST_ROW_LIMIT = tl.constexpr(HOST_ROW_LIMIT)
_EPOCH_MASK = tl.constexpr(0x7FFFFFFF)  # epochs count in 31 bits (they wrap; only differences below TAG_PERIOD matter)
_STAMP_SHIFT = tl.constexpr(STAMP_SHIFT)  # a table entry: stamp << 55 | key << 24 | occurrence or plan offset
_KEY_SHIFT = tl.constexpr(KEY_SHIFT)
_LOW_MASK = tl.constexpr(LOW_MASK)
_NO_CLAIM = tl.constexpr((1 << 55) - 1)  # key and low bits all ones: no live entry holds them (see MAX_OCCURRENCES)
_NONE = tl.constexpr(0x7FFFFFFF)  # "no hot slot holds this token" in the table's hot region
_HASH = tl.constexpr(HASH)  # odd multiplier (2**32 / golden ratio, negated): Fibonacci hashing
_HASH_HI = tl.constexpr(HASH_HI)  # a second odd multiplier, for the high word of a host row
_WINDOW = tl.constexpr(8)  # table entries one probe round reads per lane
_TAIL_BLOCK = tl.constexpr(64)  # tail slots compared per iteration of the tail search
_CLEAR_BLOCK = tl.constexpr(512)  # table entries one program clears per iteration
_FLAGS_BLOCK = tl.constexpr(1024)  # per-call flag words prep clears per iteration
SORT_SLICE = 32  # misses one program of the sort launch places
_SORT_SLICE = tl.constexpr(SORT_SLICE)
_SORT_TILE = tl.constexpr(128)  # misses each of them is compared with at a time
_PUBLISHED = tl.constexpr(1 << 30)  # flag bit of a published count
ROW_SORT_MAX = 1024  # one program per row sorts up to this many misses at once (more: the plan stays in miss order)
