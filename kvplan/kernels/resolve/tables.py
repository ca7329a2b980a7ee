"""The Triton resolve's tables in the workspace: a row's hash table of wanted tokens (open addressing, epoch
stamps instead of clearing), the counts programs publish to each other, and bit helpers.
Names: the kernel glossary, ``kvplan/kernels/glossary.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.kernels.resolve.constants import (
    _CLEAR_BLOCK,
    _CLEARED,
    _CURRENT,
    _EMPTIES,
    _EPOCH,
    _EPOCH_MASK,
    _FORMAT,
    _HASH,
    _KEY_SHIFT,
    _LOW_MASK,
    _NO_CLAIM,
    _PADDING,
    _PUBLISHED,
    _SHARED,
    _STAMP_SHIFT,
    _TAG_PERIOD,
    _WINDOW,
)

# ---------------------------------------------------------------------------------------------------------------------
# Hash table of a row's wanted tokens: int64 entries ``stamp << 55 | token << 24 | first occurrence`` (tokens >= 0);
# an entry of another stamp (an earlier call's, the host-row table's, or -1) is free. Linear probing, nothing deleted
# within a call. The stamp: 7 bits of the row's epoch, then which table (0 tokens, 1 host rows).


@triton.jit
def _stamp(ws, TABLE: tl.constexpr):
    """This call's stamp of workspace row ``ws``'s table entries (int64): its epoch's tag, then ``TABLE``."""
    epoch = tl.load(ws + _CURRENT).to(tl.int64)
    return ((epoch % _TAG_PERIOD) << 1) | TABLE


@triton.jit
def _format_word(ws_stride, LAYOUT: tl.constexpr):
    """``kvplan.workspace.format_word``: the layout's signature and the row stride."""
    return LAYOUT.signature ^ (ws_stride & 0x3FFFFFFF)


@triton.jit
def _hash(token, LOG_TB: tl.constexpr):
    """Fibonacci hash of int32 tokens to ``[0, 2**LOG_TB)``: the top bits of ``token * _HASH`` (mod 2**32)."""
    mixed = (token * _HASH).to(tl.uint32, bitcast=True)
    return (mixed >> (32 - LOG_TB)).to(tl.int32)


@triton.jit
def _table_insert(keys_ptr, token, occ, active, stamp, LOG_TB: tl.constexpr):
    """Insert ``token`` with occurrence ``occ`` for every active lane, under ``stamp``. Returns each lane's entry (-1
    inactive) and whether the lane claimed it (one lane per entry). Lanes of one token share its entry, which keeps
    their smallest occurrence. Each round reads a window of entries (a claimed entry never changes token, so a token
    or a free entry seen there is final up to the compare-and-swap that claims it, which expects the free value
    seen)."""
    packed = (stamp << _STAMP_SHIFT) | (token.to(tl.int64) << _KEY_SHIFT) | occ.to(tl.int64)
    key = packed >> _KEY_SHIFT  # stamp and token: what a live entry of this token holds above its occurrence
    no_claim = (stamp << _STAMP_SHIFT) | _NO_CLAIM
    w = tl.arange(0, _WINDOW)
    wrap = (1 << LOG_TB) - 1
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    claimed_any = token < -1  # all False
    pending = active
    # a round finishes a lane, moves it a window on, or (a lost claim) moves it onto an entry claimed this call: a
    # table of live entries only (written between calls) ends the search, the lane unplaced, after 2 * TB rounds
    rounds = 0
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (rounds < (2 << LOG_TB)):
        rounds += 1
        cur = tl.load(keys_ptr + ((pos[:, None] + w[None, :]) & wrap), mask=pending[:, None], other=-1,
                      cache_modifier=".cg")  # fmt: skip
        live = (cur >> _STAMP_SHIFT) == stamp
        stop = ((cur >> _KEY_SHIFT) == key[:, None]) | ~live
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        at = (pos + first) & wrap
        seen = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        trying = pending & (first < _WINDOW)
        empty = trying & ((seen >> _STAMP_SHIFT) != stamp)
        # lanes not claiming compare against no_claim, which no entry holds: their compare-and-swap writes nothing
        old = tl.atomic_cas(keys_ptr + at, tl.where(empty, seen, no_claim), packed, sem="relaxed")
        claimed = empty & (old == seen)
        same = (trying & ~empty) | (empty & ~claimed & ((old >> _KEY_SHIFT) == key))
        holder = tl.where(empty, old, seen)
        tl.atomic_min(keys_ptr + at, packed, mask=same & ((holder & _LOW_MASK) > occ), sem="relaxed")
        done = claimed | same
        entry = tl.where(done, at, entry)
        claimed_any = claimed_any | claimed
        lost = empty & ~done  # another token took the free entry first: look again from there
        pos = tl.where(pending & ~trying, pos + _WINDOW, tl.where(lost, at, pos))
        pending = pending & ~done
    return entry, claimed_any


@triton.jit
def _table_find(keys_ptr, token, active, stamp, LOG_TB: tl.constexpr):
    """The entry holding ``token`` under ``stamp`` for every active lane, -1 when absent (the table is complete: read
    only)."""
    key = (stamp << (_STAMP_SHIFT - _KEY_SHIFT)) | token.to(tl.int64)
    w = tl.arange(0, _WINDOW)
    pos = _hash(token, LOG_TB)
    entry = tl.full(token.shape, -1, tl.int32)
    pending = active
    rounds = 0  # one pass over the table at most (a table of live entries only was written between calls)
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (rounds < ((1 << LOG_TB) + _WINDOW - 1) // _WINDOW):
        rounds += 1
        idx = (pos[:, None] + w[None, :]) & ((1 << LOG_TB) - 1)
        cur = tl.load(keys_ptr + idx, mask=pending[:, None], other=-1, cache_modifier=".cg")
        stop = ((cur >> _KEY_SHIFT) == key[:, None]) | ((cur >> _STAMP_SHIFT) != stamp)
        first = tl.min(tl.where(stop, w[None, :], _WINDOW), axis=1)
        value = tl.sum(tl.where(w[None, :] == first[:, None], cur, 0), axis=1)
        found = pending & (first < _WINDOW) & ((value >> _STAMP_SHIFT) == stamp)
        entry = tl.where(found, (pos + first) & ((1 << LOG_TB) - 1), entry)
        pending = pending & (first == _WINDOW)
        pos += _WINDOW
    return entry


# ---------------------------------------------------------------------------------------------------------------------
# Counts published between programs of the place launch (a flag bit marks a published count)


@triton.jit
def _publish(ptr, value, IN_ORDER: tl.constexpr):
    """Publish ``value`` at ``ptr`` after everything this program wrote (a barrier, then a release; a plain store
    when one program runs the row's chunks in order: only its own threads read it, after a barrier)."""
    tl.debug_barrier()
    # (the tensor first: Triton 3.7-3.9's interpreter turns ``constexpr | tensor`` into a constexpr it cannot store)
    if IN_ORDER:
        tl.store(ptr, value | _PUBLISHED)
    else:
        tl.atomic_xchg(ptr, value | _PUBLISHED, sem="release")


@triton.jit
def _wait_counts(ptr, count, NB: tl.constexpr, IN_ORDER: tl.constexpr):
    """Wait until ``ptr[0:count]`` are all published (they are written by programs with lower tickets, which have
    started and never wait on this one; in order, by this program before); returns them (0 past ``count``)."""
    idx = tl.arange(0, NB)
    inside = idx < count
    if IN_ORDER:
        tl.debug_barrier()  # this program's own earlier chunks published them
        values = tl.load(ptr + idx, mask=inside, other=0, cache_modifier=".cg")
    else:
        values = tl.atomic_add(ptr + idx, 0, mask=inside, sem="acquire")
        while tl.min(tl.where(inside, values & _PUBLISHED, _PUBLISHED), axis=0) == 0:
            values = tl.atomic_add(ptr + idx, 0, mask=inside, sem="acquire")
        tl.debug_barrier()  # threads that did not acquire themselves read the published data after this
    return tl.where(inside, values & ~_PUBLISHED, 0)


@triton.jit
def _lookup(table, index):
    """``table[index]`` for a small 1-D ``table``. A one-element table is broadcast rather than gathered: Triton 3.6
    fails to compile some kernels that gather from one element (a layout pass breaks dominance)."""
    if table.shape[0] == 1:
        return tl.zeros(index.shape, table.dtype) + tl.sum(table, axis=0)
    return tl.gather(table, index, 0)


@triton.jit
def _popcount(x):
    """Set bits of each int32 word (SWAR, no intrinsic: the interpreter runs it too)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _select_bit(word, rank):
    """Position of the ``rank``-th (0-based) set bit of each int32 word (rank < popcount)."""
    u = word.to(tl.uint32, bitcast=True)
    pos = tl.zeros(word.shape, tl.int32)
    for width in tl.static_range(4, -1, -1):
        half = 1 << width
        low = _popcount((u & ((1 << half) - 1)).to(tl.int32, bitcast=True))
        up = rank >= low
        rank = tl.where(up, rank - low, rank)
        pos = tl.where(up, pos + half, pos)
        u = tl.where(up, u >> half, u)
    return pos


@triton.jit
def _words(ws, offset, dtype: tl.constexpr):
    """A workspace region (``offset`` int32 words into the row) as ``dtype`` elements."""
    return (ws + offset).to(tl.pointer_type(dtype), bitcast=True)


@triton.jit
def _clear_table(ws, part, parts, LAYOUT: tl.constexpr):
    """Empty share ``part`` of ``parts`` of a row's token table (entries ``-1``), blocks of ``_CLEAR_BLOCK`` apart."""
    TB: tl.constexpr = LAYOUT.table_size
    keys = _words(ws, LAYOUT.keys, tl.int64)
    start = part * _CLEAR_BLOCK
    while start < TB:
        e = start + tl.arange(0, _CLEAR_BLOCK)
        tl.store(keys + e, tl.full([_CLEAR_BLOCK], -1, tl.int64), mask=e < TB)
        start += parts * _CLEAR_BLOCK


@triton.jit
def _begin_epoch(ws_ptr, ws, ws_stride, first, live, LAYOUT: tl.constexpr):
    """Prep: the row's next epoch, and whether its table must be emptied (its tags could repeat, or its words or row
    0's do not vouch for it: ``kvplan.workspace``). Reads only words the later stages write; chunk ``first``
    publishes both (row words ``CURRENT`` and ``EMPTIES``) with the row words it zeroes, and marks a row that is not
    ``live`` as padding (row word ``SHARED``: the copies skip it, whatever its plan row holds)."""
    epoch = (tl.load(ws + _EPOCH).to(tl.int64) + 1) & _EPOCH_MASK
    age = (epoch - tl.load(ws + _CLEARED).to(tl.int64)) & _EPOCH_MASK
    vouched = (tl.load(ws + _FORMAT) == _format_word(ws_stride, LAYOUT)) & (
        tl.load(ws_ptr + _FORMAT) == _format_word(ws_stride, LAYOUT)
    )
    empties = ~vouched | (age == 0) | (age >= _TAG_PERIOD)
    if first:
        # the row words: no shared entries, the copy's work counter at zero (row 0), this call's epoch and decision
        w = tl.arange(0, 8)
        words = tl.where(w == _CURRENT, epoch.to(tl.int32), tl.where(w == _EMPTIES, empties.to(tl.int32), 0))
        words = tl.where((w == _SHARED) & ~live, _PADDING, words)
        tl.store(ws + w, words, mask=(w <= _CURRENT) | (w == _EMPTIES))
    return empties


@triton.jit
def _end_epoch(ws, ws_stride, vouch, LAYOUT: tl.constexpr):
    """After every prep program of the row has read its words: the epoch the row used, when its table was last
    emptied, and (``vouch``) the format word that vouches for the table from now on. Row 0's format word is read by
    every row's prep: it is written only once every prep program of the call has run."""
    epoch = tl.load(ws + _CURRENT)
    if tl.load(ws + _EMPTIES) != 0:
        tl.store(ws + _CLEARED, epoch)
    tl.store(ws + _EPOCH, epoch)
    if vouch:
        tl.store(ws + _FORMAT, _format_word(ws_stride, LAYOUT))
