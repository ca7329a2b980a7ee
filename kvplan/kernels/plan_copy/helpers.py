"""The ``@triton.jit`` helpers the plan copy's entry kernels share (``kvplan.kernels.plan_copy.kernels``): the plan's
summary every kernel starts with, the walk over work items, a work item of each kind of entry, a tile, the counters;
the host reads' launch (two entry kernels'). Names: the kernel glossary, ``kvplan/kernels/glossary.py``; how the copy
works: ``kvplan.kernels.plan_copy``."""

from __future__ import annotations

import triton
import triton.language as tl

from kvplan.workspace import HOST_ROW_LIMIT, PADDING, ROW_WORDS, SHARED

_COUNT_BLOCK = tl.constexpr(256)  # batch rows whose counts one step of the max-count loop reads
_WIDE = tl.constexpr(8)  # tiles per item of the host reads when many entries share host rows
_ROW_WORDS = tl.constexpr(ROW_WORDS)
_SHARED = tl.constexpr(SHARED)
_PADDING = tl.constexpr(PADDING)
_HOST_ROW_LIMIT = tl.constexpr(HOST_ROW_LIMIT)


@triton.jit
def _real_rows(num_real_ptr, batch, HAS_NUM_REAL: tl.constexpr):
    """The plan rows that are real: ``num_real_reqs`` clamped to ``[0, batch]`` (all ``batch`` without it)."""
    n_real = batch
    if HAS_NUM_REAL:
        n_real = tl.minimum(tl.maximum(tl.load(num_real_ptr), 0), batch)
    return n_real


@triton.jit
def _row_count(count_ptr, ws_ptr, ws_stride, marks, row, columns):
    """Copies of plan row ``row``: its count clamped to ``[0, columns]``, 0 for a row the swap-in marked padding
    (``marks``: the workspace's row words are read; else ``ws_ptr`` is a stand-in of at least one word, stride 0)."""
    count = tl.load(count_ptr + row)
    word = tl.load(ws_ptr + row.to(tl.int64) * ws_stride + _SHARED)
    count = tl.where((word == _PADDING) & (marks != 0), 0, count)
    return tl.minimum(tl.maximum(count, 0), columns)


@triton.jit
def _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
               src_row, dst_row, m, in_list, take, n_host, n_dev, HOST_STRIDE: tl.constexpr,
               DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    """One tile: the copies ``m`` (lanes where ``in_list``) that ``take`` holds for moved; 1 per lane that copied.
    The entries load under ``in_list`` alone, so they load while ``take`` is still being worked out. With V rows
    (``host_v_ptr`` not ``None``, same row pitches) each copy moves its K row and its V row, both loads in flight
    before either store."""
    words = tl.arange(0, BLOCK_W)
    src = tl.load(src_row + m, mask=in_list, other=-1)
    dst = tl.load(dst_row + m, mask=in_list, other=-1).to(tl.int64)
    ok = take & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
    tile_ok = ok[:, None] & (words < WORDS)[None, :]
    values = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
    if host_v_ptr is not None:
        values_v = tl.load(host_v_ptr + (src[:, None] * HOST_STRIDE + words[None, :]), mask=tile_ok)
        tl.store(dev_v_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values_v, mask=tile_ok)
    tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=tile_ok)
    return ok.to(tl.int32)


@triton.jit
def _copy_shared_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                      src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, ws_ptr, ws_stride,
                      m, shared_from, take, n_real, columns, plan_stride, n_host, n_dev,
                      HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
                      BLOCK_W: tl.constexpr):  # fmt: skip
    """One tile of shared entries (lanes ``take``, entries ``m`` of the walked row ``src_ptr``/``dst_ptr``):
    each copied from the device row of the plan entry at offset ``shared_from`` (of ``plan_src_ptr``/``plan_dst_ptr``,
    row stride ``plan_stride``) when that entry holds the same host row and read it from the host in this copy, else
    from the host. Returns 1 per lane that copied."""
    words = tl.arange(0, BLOCK_W)
    src = tl.load(src_ptr + m, mask=take, other=-1)
    dst = tl.load(dst_ptr + m, mask=take, other=-1).to(tl.int64)
    ok = take & (src >= 0) & (src < n_host) & (dst >= 0) & (dst < n_dev)
    at = shared_from.to(tl.int64)
    owner_row = at // tl.maximum(plan_stride, 1)  # (a plan of one row may have any row stride, 0 included)
    owner_m = at - owner_row * plan_stride
    owner = ok & (owner_row < n_real) & (owner_m < columns)
    owner_count = tl.load(count_ptr + owner_row, mask=owner, other=0)
    owner = owner & (owner_m < tl.minimum(tl.maximum(owner_count, 0), columns))
    owner_ws = ws_ptr + owner_row * ws_stride
    owner_word = tl.load(owner_ws + _SHARED, mask=owner, other=0)
    owner = owner & (owner_word != _PADDING)  # a padding row's entries are not copied: nothing to copy from
    owner_shares = owner_word > 0
    owner_from = tl.load(owner_ws + _ROW_WORDS + owner_m, mask=owner & owner_shares, other=-1)
    owner_src = tl.load(plan_src_ptr + at, mask=owner, other=-1)
    owner_dst = tl.load(plan_dst_ptr + at, mask=owner, other=-1).to(tl.int64)
    on_device = owner & (owner_from < 0) & (owner_src == src) & (owner_dst >= 0) & (owner_dst < n_dev)
    in_row = (words < WORDS)[None, :]
    # (.cg: in a fused copy the owner's row was written by another program of the same launch, past this SM's L1)
    from_dev = tl.load(dev_ptr + (owner_dst[:, None] * DEV_STRIDE + words[None, :]), mask=on_device[:, None] & in_row,
                       cache_modifier=".cg")  # fmt: skip
    from_host = tl.load(host_ptr + (src[:, None] * HOST_STRIDE + words[None, :]),
                        mask=(ok & (on_device == 0))[:, None] & in_row)  # fmt: skip
    values = tl.where(on_device[:, None], from_dev, from_host)
    if host_v_ptr is not None:  # the V row the same way, both in flight before either store
        from_dev_v = tl.load(dev_v_ptr + (owner_dst[:, None] * DEV_STRIDE + words[None, :]),
                             mask=on_device[:, None] & in_row, cache_modifier=".cg")  # fmt: skip
        from_host_v = tl.load(host_v_ptr + (src[:, None] * HOST_STRIDE + words[None, :]),
                              mask=(ok & (on_device == 0))[:, None] & in_row)  # fmt: skip
        values_v = tl.where(on_device[:, None], from_dev_v, from_host_v)
        tl.store(dev_v_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values_v, mask=ok[:, None] & in_row)
    tl.store(dev_ptr + (dst[:, None] * DEV_STRIDE + words[None, :]), values, mask=ok[:, None] & in_row)
    return ok.to(tl.int32)


@triton.jit
def _host_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
               src_ptr, dst_ptr, ws_ptr, ws_stride, record_at, b, lo, hi, m, in_list,
               many_shared, n_host, n_dev, HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
               BLOCK_W: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """One work item of the entries that read the host (entries ``[lo, hi)`` of plan row ``b``, walked at
    ``src_ptr``/``dst_ptr``, that row's entries); 1 per lane copied.
    With ``many_shared`` the item spans ``_WIDE`` tiles: the item's records (and the row word) at once, then each tile
    holding an entry that reads the host (a row that shares nothing has no record: every entry reads it)."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    if many_shared:
        row_ws = ws_ptr + b * ws_stride
        row_word = tl.load(row_ws + _SHARED)  # <= 0: no entry of the row shares (no record to read)
        wide = lo + tl.arange(0, ROWS * _WIDE)
        in_wide = wide < hi
        record = tl.load(row_ws + record_at + wide, mask=in_wide, other=-1)
        # (the row word broadcast to the tile first: with a scalar in it, Triton 3.9's interpreter gives the mask a
        # dtype its loads refuse)
        reads = in_wide & ((record < 0) | (tl.zeros([ROWS * _WIDE], tl.int32) + row_word <= 0))
        tiles = tl.max(tl.reshape(reads.to(tl.int32), [_WIDE, ROWS]), axis=1)
        free = tl.zeros([ROWS], tl.int32) + row_word <= 0  # the row shares nothing: each entry reads the host
        for t in tl.static_range(_WIDE):
            if tl.sum(tl.where(tl.arange(0, _WIDE) == t, tiles, 0), axis=0) > 0:
                mt = lo + t * ROWS + tl.arange(0, ROWS)
                in_tile = mt < hi
                tile_record = tl.load(row_ws + record_at + mt, mask=in_tile, other=-1)
                copied += _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, src_ptr, dst_ptr, mt, in_tile,
                                     in_tile & ((tile_record < 0) | free), n_host, n_dev, HOST_STRIDE, DEV_STRIDE,
                                     WORDS, BLOCK_W)  # fmt: skip
    else:
        copied += _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                             src_ptr, dst_ptr, m, in_list, in_list, n_host, n_dev,
                             HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
    return copied


@triton.jit
def _shared_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                 src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr, ws_ptr, ws_stride,
                 record_at, b, m, in_list, n_real, columns, plan_stride, n_host, n_dev,
                 HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                 ROWS: tl.constexpr):  # fmt: skip
    """One work item of the entries that share another's host row (entries ``m`` of plan row ``b``, walked at
    ``src_ptr``/``dst_ptr``, that row's entries); 1 per lane copied."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    row_ws = ws_ptr + b * ws_stride
    row_shares = tl.zeros([ROWS], tl.int32) + tl.load(row_ws + _SHARED) > 0
    shared_from = tl.load(row_ws + record_at + m, mask=in_list, other=-1)
    take = in_list & (shared_from >= 0) & row_shares
    if tl.max(take.to(tl.int32), axis=0) > 0:
        copied += _copy_shared_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                    src_ptr, dst_ptr, plan_src_ptr, plan_dst_ptr, count_ptr,
                                    ws_ptr, ws_stride, m, shared_from, take, n_real, columns, plan_stride,
                                    n_host, n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
    return copied


@triton.jit
def _ready_word(word_ptr):
    """The ready word at ``word_ptr``, loaded with acquire semantics (what its row's resolve wrote before its release
    store is visible after it); a zero (not ready) backs off 256 ns before returning, so waiting programs leave the
    issue slots of an SM and the word's L2 slice to the resolve."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred not_ready; ld.acquire.gpu.global.b32 $0, [$1]; setp.eq.s32 not_ready, $0, 0; "
        "@not_ready nanosleep.u32 256; }",
        "=r,l", [word_ptr], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _wait_ready(word_ptr):
    """Wait until the on-chip resolve has published a plan row: its ready word (row word ``sync`` of the swap-in's
    workspace) turns 1 once the row's plan entries, its count and its padding mark are written
    (``kvplan/kernels/onchip/resolve.cu``, ``publish_ready``); the resolve zeroes it before the copy may launch."""
    while _ready_word(word_ptr) == 0:
        pass


@triton.jit
def _walk_published_rows(
    # pointers: the KV rows; the walked entries; counts, the workspace's rows (padding marks, ready words)
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src, walk_dst, count_ptr, ws_ptr,
    # strides, sizes, modes: as _walk's; ready_at: the ready word's place in each workspace row
    walk_strides, ws_stride, n_real, columns, n_host, n_dev, marks, ready_at,
    # compile-time: row pitches and widths, rows per tile
    HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The flat copy after the on-chip resolve, each row as the resolve publishes it: the grid splits evenly over the
    rows (``Q = grid // n_real`` programs a row, at least one); program ``q`` of a row waits once for the row's ready
    word, then copies tiles ``q, q + Q, ...`` of its entries (every row's tiles in flight at once, as in the flat
    copy; with more rows than programs a program takes rows in turn). Returns the copies per lane."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    grid = tl.num_programs(0)
    per_row = tl.maximum(grid // tl.maximum(n_real, 1), 1).to(tl.int64)
    units = n_real * per_row
    unit = tl.zeros([], tl.int64) + tl.program_id(0)
    while unit < units:
        q = unit // n_real
        b = unit - q * n_real
        _wait_ready(ws_ptr + b * ws_stride + ready_at)
        count = _row_count(count_ptr, ws_ptr, ws_stride, marks, b, columns).to(tl.int64)
        own_src, own_dst = walk_src + b * walk_strides[0], walk_dst + b * walk_strides[1]
        tile = q
        while tile * ROWS < count:
            m = tile * ROWS + tl.arange(0, ROWS)
            in_list = m < count
            copied += _copy_tile(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, own_src, own_dst, m, in_list, in_list,
                                 n_host, n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W)  # fmt: skip
            tile += per_row
        unit += grid
    return copied


@triton.jit
def _walk(
    # pointers: the KV rows; the walked entries; the plan (where records point); counts, work counter, workspace
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src, walk_dst, src_ptr, dst_ptr, count_ptr, dispatch_ptr, ws_ptr,
    # strides: the walked entries' rows (src, dst), the plan's rows, the workspace's rows
    walk_strides, plan_stride, ws_stride,
    # sizes: this program's first item and its step, the items and slices per row, the plan's real rows and columns,
    # the KV rows, the word of each workspace row where the walked entries' records start
    first, stride, items, slices, n_real, columns, n_host, n_dev, record_at,
    # modes: padding marks read, items from the work counter, host reads in items of _WIDE tiles
    marks, from_counter, wide,
    # compile-time: which entries (host reads, else shared entries), row pitches and widths, rows per item
    READS: tl.constexpr, HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Work items ``(q, b)`` below ``items`` (``slices`` per row): ``first``, ``first + stride``, ... or, with
    ``from_counter``, each from ``dispatch_ptr``, over the entries of ``walk_src``/``walk_dst`` (row strides
    ``walk_strides``, their records at word ``record_at`` of each workspace row: the plan, or the swap-in's copy of a
    single-step plan in host-row order); ``src_ptr``/``dst_ptr``/``plan_stride``: the plan, where records point (read
    for shared entries only). ``READS``: the entries that read the host (``wide``: items of ``_WIDE`` tiles, the tiles
    that hold a reader); else the entries that share another's host row. Returns the copies per lane and the items
    done."""
    copied = tl.zeros([ROWS], dtype=tl.int32)
    done = tl.zeros([], tl.int64)
    if from_counter:
        # (relaxed: a ticket orders nothing; what follows the walk orders what the programs read of one another)
        item = tl.atomic_add(dispatch_ptr, 1, sem="relaxed").to(tl.int64)
    else:
        item = tl.zeros([], tl.int64) + first
    while item < items:
        q = item // n_real
        b = item - q * n_real
        count = _row_count(count_ptr, ws_ptr, ws_stride, marks, b, columns).to(tl.int64)
        lo = q * count // slices
        hi = (q + 1) * count // slices
        m = lo + tl.arange(0, ROWS)
        in_list = m < hi
        # the walked row (its two arrays may have different row strides)
        own_src, own_dst = walk_src + b * walk_strides[0], walk_dst + b * walk_strides[1]
        if READS:
            copied += _host_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                 own_src, own_dst, ws_ptr, ws_stride, record_at, b, lo, hi,
                                 m, in_list, wide, n_host, n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W,
                                 ROWS)  # fmt: skip
        else:
            copied += _shared_item(host_ptr, dev_ptr, host_v_ptr, dev_v_ptr,
                                   own_src, own_dst, src_ptr, dst_ptr, count_ptr, ws_ptr,
                                   ws_stride, record_at, b, m, in_list, n_real, columns, plan_stride, n_host,
                                   n_dev, HOST_STRIDE, DEV_STRIDE, WORDS, BLOCK_W, ROWS)  # fmt: skip
        done += 1
        if from_counter:
            item = tl.atomic_add(dispatch_ptr, 1, sem="relaxed").to(tl.int64)
        else:
            item += stride
    return copied, done


@triton.jit
def _plan_summary(
    # pointers: the plan's counts, num_real_reqs, the workspace (or padding marks, or a stand-in of one word)
    count_ptr, num_real_ptr, ws_ptr,
    # strides: the workspace's rows
    ws_stride,
    # sizes: the plan's rows and columns; the span words' place, and the span and entries that take the counter
    batch, columns, span_at, dynamic_span, dynamic_entries,
    # modes: padding marks read
    marks,
    # compile-time: count the entries that share (the record is read), the work counter's mode, num_real_reqs read
    SHARES: tl.constexpr, DISPATCH: tl.constexpr, HAS_NUM_REAL: tl.constexpr,
):  # fmt: skip
    """What every copy reads first, of every batch row at once: ``(n_real, longest, many_shared, dynamic)``, the real
    rows, the most copies of one row, whether the record of shared host rows is followed (``SHARES``: a sixteenth or
    more of the entries share a host row) and whether items come from the work counter (``DISPATCH`` 1: always; 2:
    when the plan spans more than ``dynamic_span`` host rows, has ``dynamic_entries`` entries or more and few share).

    Every batch row's words load at once, beside num_real_reqs (rows past it are dropped once it arrives): one round
    of loads, not two. A row's words: its count, its padding mark and (the record) its entries that share; with
    ``DISPATCH`` 2 the span of its host rows that the sort left (``HOST_ROW_LIMIT - lowest``, ``highest + 1``, 0 for
    none)."""
    n_real = _real_rows(num_real_ptr, batch, HAS_NUM_REAL)
    rows = tl.arange(0, _COUNT_BLOCK)
    most = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    shared = tl.zeros([_COUNT_BLOCK], dtype=tl.int64)
    entries = tl.zeros([_COUNT_BLOCK], dtype=tl.int64)
    near = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    far = tl.zeros([_COUNT_BLOCK], dtype=tl.int32)
    while tl.min(rows, axis=0) < batch:  # (a while loop: the interpreter cannot take tensors as range() bounds)
        inside = rows < batch
        row_count = tl.load(count_ptr + rows, mask=inside, other=0)
        # (the row words: a padding mark, and with the record the entries that share; a stand-in's word otherwise)
        word = tl.load(ws_ptr + rows.to(tl.int64) * ws_stride + _SHARED, mask=inside, other=0)
        row_count = tl.where((word == _PADDING) & (marks != 0), 0, row_count)
        if DISPATCH == 2:
            span_words = ws_ptr + rows.to(tl.int64) * ws_stride + span_at
            row_near = tl.load(span_words, mask=inside, other=0)
            row_far = tl.load(span_words + 1, mask=inside, other=0)
        real = rows < n_real
        row_count = tl.where(real, tl.minimum(tl.maximum(row_count, 0), columns), 0)
        most = tl.maximum(most, row_count)
        if SHARES:
            shared += tl.where(real, tl.maximum(word, 0), 0).to(tl.int64)
            entries += row_count.to(tl.int64)
        if DISPATCH == 2:
            near = tl.maximum(near, tl.where(row_count > 0, row_near, 0))
            far = tl.maximum(far, tl.where(row_count > 0, row_far, 0))
        rows += _COUNT_BLOCK
    n_shared = tl.sum(shared, axis=0)
    n_entries = tl.sum(entries, axis=0)
    # the record is used when a sixteenth or more of the entries share a host row: then few entries read the host, so
    # the host reads' items span _WIDE tiles and copy only the tiles that hold a reader. Below that (chance collisions
    # of random rows) the copy is the plain ordered copy: a few rows read twice cost less than consulting the record
    # for every entry
    many_shared = (n_shared > 0) & (n_shared * 16 >= n_entries)
    longest = tl.max(most, axis=0)
    if DISPATCH == 2:
        # the work counter pays on plans over a wide host span when few entries share a host row (docs/benchmarks.md,
        # "Work counter")
        far_most = tl.max(far, axis=0).to(tl.int64)
        span = tl.where(far_most > 0, far_most - 1 - (_HOST_ROW_LIMIT - tl.max(near, axis=0).to(tl.int64)), -1)
        dynamic = ~many_shared & (span > dynamic_span) & (n_entries >= dynamic_entries)
    else:
        dynamic = tl.zeros([], tl.int1) | (DISPATCH == 1)  # (a tensor, as the branch above makes it)
    return n_real, longest, many_shared, dynamic


@triton.jit
def _hand_back_counter(dispatch_ptr, grid):
    """The last program to finish (every other one has taken its last item) leaves the work counter zero for the
    next launch on it (``dispatch_ptr``: items handed out, programs done)."""
    if tl.atomic_add(dispatch_ptr + 1, 1, sem="acq_rel") == grid - 1:
        tl.atomic_xchg(dispatch_ptr, 0)
        tl.atomic_xchg(dispatch_ptr + 1, 0)


@triton.jit
def _add_copy_counters(counters_ptr, counter_base, rows, row_bytes):
    """Add (rows, bytes) at ``counters[counter_base : counter_base + 2]`` (nothing for zero rows)."""
    if rows > 0:
        n = rows.to(tl.int64)
        tl.atomic_add(counters_ptr + counter_base, n, sem="relaxed")
        tl.atomic_add(counters_ptr + counter_base + 1, n * row_bytes, sem="relaxed")


@triton.jit
def _copy_host_reads(
    # pointers: KV rows (K, then V or None), the walked entries, counts, num_real_reqs, counters, work counter, ws
    host_ptr, dev_ptr, host_v_ptr, dev_v_ptr, walk_src_ptr, walk_dst_ptr, count_ptr, num_real_ptr, counters_ptr,
    dispatch_ptr, ws_ptr,
    # strides, sizes (``record_at``: read with ``SHARES`` only), modes
    walk_strides, ws_stride, batch, columns, n_host, n_dev, counter_base, row_bytes, record_at, marks,
    # compile-time: the record followed; row pitches and widths, rows per item; modes
    SHARES: tl.constexpr, HOST_STRIDE: tl.constexpr, DEV_STRIDE: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr, ROWS: tl.constexpr, DISPATCH: tl.constexpr, HAS_NUM_REAL: tl.constexpr,
    HAS_COUNTERS: tl.constexpr,
):  # fmt: skip
    """A launch of the entries that read the host (``_copy_entries_kernel``, ``_copy_host_reads_kernel``): every
    entry; with ``SHARES`` (the record of shared host rows) items of ``_WIDE`` tiles when many entries share, copying
    only the tiles that hold a reader. ``DISPATCH`` 0 or 1."""
    n_real, longest, many_shared, dynamic = _plan_summary(
        count_ptr, num_real_ptr, ws_ptr, ws_stride, batch, columns, 0, 0, 0, marks, SHARES, DISPATCH, HAS_NUM_REAL
    )  # fmt: skip
    grid = tl.num_programs(0)
    # (without the record, ROWS and wide False stay constants: the tiles' branch folds at compile time)
    slices = tl.cdiv(longest, tl.where(many_shared, ROWS * _WIDE, ROWS) if SHARES else ROWS).to(tl.int64)
    copied = _walk(
        host_ptr=host_ptr, dev_ptr=dev_ptr, host_v_ptr=host_v_ptr, dev_v_ptr=dev_v_ptr, walk_src=walk_src_ptr,
        walk_dst=walk_dst_ptr, src_ptr=None, dst_ptr=None, count_ptr=count_ptr, dispatch_ptr=dispatch_ptr,
        ws_ptr=ws_ptr, walk_strides=walk_strides, plan_stride=None, ws_stride=ws_stride, first=tl.program_id(0),
        stride=grid, items=slices * n_real, slices=slices, n_real=n_real, columns=columns, n_host=n_host, n_dev=n_dev,
        record_at=record_at, marks=marks, from_counter=dynamic, wide=many_shared if SHARES else False, READS=True,
        HOST_STRIDE=HOST_STRIDE, DEV_STRIDE=DEV_STRIDE, WORDS=WORDS, BLOCK_W=BLOCK_W, ROWS=ROWS,
    )[0]  # fmt: skip
    if DISPATCH > 0:
        if dynamic:
            _hand_back_counter(dispatch_ptr, grid)
    if HAS_COUNTERS:
        _add_copy_counters(counters_ptr, counter_base, tl.sum(copied, axis=0), row_bytes)
