"""The swap-in resolve workspace: its regions and size, importable without Triton so the pool can size it up front.

The resolve kernels (``kvplan.kernels.hisparse``) spread one batch row over many programs and pass what one program
decided to the others through this per-row scratch, read as int32 words (the tensor is int64 ``[batch, columns]``).
:func:`swap_in_workspace_regions` is the one place the offsets are computed; the kernels receive the result whole.

============ ===================== ====================================================================
region       int32 words           what it holds
============ ===================== ====================================================================
row words    ``ROW_WORDS`` (8)     ``[0]`` this row's plan entries that share a host row with another
                                   entry of the call (read by every copy of the plan), or ``PADDING`` when
                                   the call took the row for padding (every copy given the workspace then
                                   copies none of its entries, whatever its count says); ``[1:3]`` the copy's
                                   work counter (row 0), ``[2]`` of row 1 the swap-in copy's count of host
                                   reads done; ``[3]`` this call's epoch of the row; ``[4]`` the
                                   epoch of its last call; ``[5]`` the epoch its table was last emptied at;
                                   ``[6]`` its format word; ``[7]`` whether this call empties its table
shared_from  ``N``                 per plan entry: the flat plan offset of the entry whose device row holds
                                   the same host row, ``-1`` when this entry reads the host (fixed offset
                                   ``ROW_WORDS``: a replay finds it without knowing ``N``)
sync         ``1``                 the place launch's program ticket counter (the split resolve); after
                                   the on-chip resolve of a plan in miss order, the row's ready word (0
                                   until the row's plan and count are written, then 1: the copy waits on
                                   it)
span         ``2``                 the row's valid host rows, as ``HOST_ROW_LIMIT - lowest`` and ``highest + 1``
                                   (0: none), raised by the share step (or the on-chip resolve's claims)
                                   for the swap-in's copy to choose its work counter by (``atomic_max``:
                                   prep zeroes them with the flags below)
hot_counts   ``HOT_MAX / 32``      per hot chunk, its evictable positions (published with a flag bit)
occ_counts   ``N / 64 (>= 1)``     per occurrence chunk, its backed misses (published with a flag bit)
old_lru      ``HOT_MAX / 2``       the row's old ``lru_slots`` (int16), read while the row is rewritten
hit_bits     ``HOT_MAX / 32``      one bit per LRU position: its slot holds a wanted token
occ_entry    ``N``                 per occurrence: its table entry; ``-2`` wanted, not yet inserted; ``-1``
                                   not wanted (invalid, newest or tail-resolved)
miss_rank    ``N``                 per first occurrence of a backed miss: its rank within its chunk
miss_loc     ``N``                 per placed miss ``m`` (first-occurrence order): its device row, for the
                                   plan sort
miss_host    ``2 * N``             per placed miss ``m``: its host row (int64), for the plan sort
keys         ``2 * TB``            hash table of the row's wanted tokens: int64 ``stamp << 55 | token << 24
                                   | first occurrence`` per entry (open addressing). Once the row is placed
                                   it forms, with every other row's, the call's table of host rows
                                   (``stamp << 55 | host_row << 24 | plan offset``). An entry is live only
                                   under this call's stamp (the row's epoch and which table): tables are
                                   never emptied per call (see below)
hot          ``TB``                per entry: ``lru position << 16 | slot`` of the least recently used hot
                                   slot holding the token (a hit); ``INT32_MAX`` when none does
============ ===================== ====================================================================

``N = steps * top_k``; ``TB`` = the power of two >= ``2 * N`` (>= 16): a row's table is at most half full, and so is
the call's table of host rows (``batch * TB`` entries for at most ``batch * N`` plan entries). The hot regions have a
fixed size because ``lru_slots`` holds int16 slot numbers (``HOT <= HOT_MAX``): the workspace is sized by
``(steps, top_k)`` alone, as the pool sizes it. The regions prep clears per call (``sync`` to ``occ_counts``) are
contiguous.

Epochs instead of clearing: each row counts its calls (row word 4); a table entry carries a 7-bit tag of the epoch
that wrote it and one bit for which table, so entries of earlier calls read as empty and nothing is cleared per
call. A row's table is emptied only when its tags could repeat (``TAG_PERIOD`` calls since it was last emptied) or
when its words do not vouch for it: the format word (row word 6) holds ``format_word(regions, row stride)``, set
once the row has been used with this layout and row stride, and row 0's must hold it too (row 0's words sit at the
same place in every layout, so a call of another layout over the same storage, e.g. a pool's shared buffer, shows
there). A workspace that holds anything else is emptied on its first call; one kvplan allocates (a pool's, or the
kernels' own when none is given) starts so (``forget_tables``), whatever its memory held before.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "HOST_ROW_LIMIT",
    "HOT_MAX",
    "MAX_OCCURRENCES",
    "PADDING",
    "ROW_WORDS",
    "WorkspaceRegions",
    "forget_tables",
    "format_word",
    "next_pow2",
    "swap_in_workspace_columns",
    "swap_in_workspace_regions",
]

HOT_MAX = 1 << 15  # lru_slots entries are int16 slot numbers 0 .. HOT - 1
HOT_CHUNK_MIN = 32  # fewest hot positions one resolve program takes (one hit_bits word)
OCC_CHUNK_MIN = 64  # fewest occurrences one resolve program takes when a row has more than that
ROW_WORDS = 8  # the row words at the head of every workspace row (the copies read them and shared_from after them)
SHARED = 0  # row word: plan entries sharing a host row
# Row word SHARED of a row the call took for padding (past num_real_reqs, or a request slot outside the pool): a
# single-step padding row's miss_count is left as it was (docs/kernels.md §2), so the copies read this instead of it.
# A value no count of shared entries takes, and not forget_tables' -1.
PADDING = -0x7FFFFFB0
DISPATCH = 1  # row words 1-2 of row 0: the copy's work counter (items handed out, programs done)
DONE = 2  # row word 2 of row 1 (of row 0 in a batch of one): the swap-in copy's host reads done, when rows share
CURRENT = 3  # row word: this call's epoch of the row (prep writes it, every later step reads it)
EPOCH = 4  # row word: the epoch of the row's last call
CLEARED = 5  # row word: the epoch at which the row's table was last emptied
FORMAT = 6  # row word: format_word(...) once the row was used with this layout and row stride
EMPTIES = 7  # row word: 1 when this call empties the row's table (prep decides, the next step records it)
TAG_PERIOD = 128  # epochs a 7-bit tag tells apart: a table is emptied at least this often
# A table entry's occurrence or plan offset takes its low 24 bits: a row resolves fewer occurrences than this (the
# largest value stays unused, so no live entry equals the compare value of a lane that claims nothing).
MAX_OCCURRENCES = (1 << 24) - 2
# Host rows the call's table of host rows can name (31 key bits; the largest stays unused, as the kernels' no-claim
# value): a call on a larger host cache shares none. The span words hold host rows below it as positive int32.
HOST_ROW_LIMIT = (1 << 31) - 1
# A table entry, int64: stamp << STAMP_SHIFT | key << KEY_SHIFT | occurrence or plan offset (LOW_MASK); host rows hash
# onto the call's table by Fibonacci hashing of their two 32-bit halves (HASH, HASH_HI: odd multipliers). The Triton
# kernels (kvplan.kernels.resolve.constants) and the on-chip resolve (its compiler's prelude) take them from here.
STAMP_SHIFT = 55
KEY_SHIFT = 24
LOW_MASK = (1 << KEY_SHIFT) - 1
HASH = 0x61C88647  # 2**32 / golden ratio, negated
HASH_HI = 0x2545F491


class WorkspaceRegions(NamedTuple):
    """int32-word offsets of each region inside one workspace row, and the row's size (passed to the kernels as one
    compile-time constant)."""

    table_size: int  # TB, a power of two
    shared_from: int
    sync: int
    span: int
    hot_counts: int
    occ_counts: int
    old_lru: int
    hit_bits: int
    occ_entry: int
    miss_rank: int
    miss_loc: int
    miss_host: int
    keys: int
    hot: int
    words: int
    signature: int  # of the offsets above: part of the format word


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1): the table size here, and the kernels' Triton blocks."""
    return 1 << max(int(n) - 1, 0).bit_length()


def swap_in_workspace_regions(num_steps: int, top_k: int) -> WorkspaceRegions:
    """Where each region of the resolve workspace starts, for ``num_steps * top_k`` occurrences per row."""
    n = num_steps * top_k
    tb = max(16, next_pow2(2 * n))
    chunks = max(1, -(-n // OCC_CHUNK_MIN))
    shared_from = ROW_WORDS
    sync = shared_from + n
    span = sync + 1
    hot_counts = span + 2
    occ_counts = hot_counts + HOT_MAX // HOT_CHUNK_MIN
    old_lru = occ_counts + chunks
    hit_bits = old_lru + HOT_MAX // 2
    occ_entry = hit_bits + HOT_MAX // 32
    miss_rank = occ_entry + n
    miss_loc = miss_rank + n
    miss_host = miss_loc + n
    miss_host += miss_host % 2  # int64 regions start on an even word
    keys = miss_host + 2 * n
    hot = keys + 2 * tb
    words = hot + tb
    signature = 0x6B76706C  # "kvpl"
    for offset in (tb, shared_from, sync, span, occ_counts, occ_entry, keys, hot, words):
        signature = ((signature ^ offset) * 0x01000193) & 0x7FFFFFFF  # FNV-1a steps, kept a positive int32
    return WorkspaceRegions(
        tb, shared_from, sync, span, hot_counts, occ_counts, old_lru, hit_bits, occ_entry, miss_rank, miss_loc,
        miss_host, keys, hot, words, signature,
    )  # fmt: skip


def format_word(regions: WorkspaceRegions, row_stride: int) -> int:
    """The format word of a workspace row (int32 words ``row_stride`` apart) laid out as ``regions``: the kernels
    compute it the same way (``kvplan.kernels.resolve.tables._format_word``)."""
    return regions.signature ^ (row_stride & 0x3FFFFFFF)


def forget_tables(workspace) -> None:
    """Make a freshly allocated workspace (int64 ``[rows, columns]``, or a pool's flat storage, row 0 first) vouch
    for nothing: row 0's words all -1, which no format word equals, so its first call empties every row's table.
    ``torch.empty`` may hand back an earlier workspace's storage whose words still vouch for tables that other
    tensors have since overwritten."""
    if workspace.numel():
        (workspace if workspace.dim() == 1 else workspace[0])[: ROW_WORDS // 2].fill_(-1)


def swap_in_workspace_columns(num_steps: int, top_k: int) -> int:
    """int64 columns per batch row the swap-in resolve kernels need for ``num_steps * top_k`` occurrences (none
    without occurrences: then nothing is resolved through the workspace)."""
    if num_steps * top_k == 0:
        return 0
    return -(-swap_in_workspace_regions(num_steps, top_k).words // 2)
