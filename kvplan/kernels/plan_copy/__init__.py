"""The plan copy: host rows -> device rows, for swap-in's own copy and for plan replay (docs/kernels.md §4, §8). The
public calls (``copy_planned``, ``run_copy``) are in ``kvplan.kernels.copy``; here, one module per job:

- ``launch``: how the copy is launched, its launch shapes and thresholds, its grid (``_copy_grid``), which entry
  kernel each job runs, every argument bound by name: the place to change how the copy picks its grid;
- ``kernels``: the entry kernels, one per job: every entry (``_copy_entries_kernel``: the flat and the ordered copy);
  with the swap-in's record of shared host rows, a replay's two launches, the entries that read the host
  (``_copy_host_reads_kernel``) then the entries that share another's host row (``_copy_shared_entries_kernel``),
  and the swap-in's own copy of both in one launch (``_copy_reads_then_shared_kernel``); their parameters, once;
- ``helpers``: the ``@triton.jit`` helpers they share: the plan's summary, the walk over work items, a work item of
  each kind, a tile, the counters, the host reads' launch.

Names (``ws``, ``ROWS``, ``WORDS``, ``PDL``, ...): the kernel glossary, ``kvplan/kernels/glossary.py``.

The copy is bound by the host link, and on a large host cache by the GPU's address translation of host memory:
random 576-byte rows read zero-copy from a 4.6 GB pinned cache reach about a third of the link, because every row in
flight touches its own translation region. What lifts it is locality of the rows in flight, so this copy reads them
in host-address order with a bounded number in flight:

- each plan row is sorted by host row (the swap-in writes a speculative plan so above small batches, whose entries'
  order is free; a single-step plan stays in miss order and the swap-in's own copy walks the host-row order the
  sort left in its workspace), and the copy walks all rows together by quantile: work item ``(q, b)`` is the
  ``q``-th of ``Q`` equal slices of row ``b``, items in ``q``-major order. Rows of random host rows sorted this way
  advance through the host cache together, so the rows in flight at any moment lie in one narrow window of addresses
  (a merge of the sorted rows, without merging them);
- one warp per program, a few rows per item, one program per SM: few rows in flight, each item one tile;
- program ``p`` takes items ``p, p + G, ...``; or, from a work counter, in strict order: that keeps the programs closer
  together on a large host cache, but every item is an atomic on one address, which serialises when the rows come from
  L2. The swap-in's own copy takes the counter when its plan spans more than ``DYNAMIC_SPAN_BYTES`` of host rows and
  shares none (decided on the device, from what the plan's sort recorded).

With the swap-in's workspace (``workspace``: the record of which entries share a host row, ``kvplan.kernels.hisparse``)
the copy reads from the host only the entries that read it (one per distinct host row) and copies every other entry
from the device row its host row went to, after those reads. A replay does it in two launches (the launch boundary
orders them); the swap-in's own copy in one: when many entries share, every program takes host reads from a work
counter, then all wait for the count of reads done (they wait only on reads that running programs took, so the wait
ends whatever order programs start in) and copy the shared entries; otherwise the ordered copy's programs copy every
entry and the rest return at once, so a plan that shares nothing pays no second launch. Small batches use a flat grid
instead, every row of the plan in flight (``FLAT_COPY_LAUNCH``).

The grids, the work counter and their thresholds: docs/benchmarks.md, "Why each threshold is what it is".

Rows are moved as the widest integer words that divide the item size; row pitches are compile-time constants so the
compiler knows each row's alignment. The loop bounds are read on the device, so a launch never synchronises and can be
captured in a CUDA graph. Every row index is checked against its tensor, counts are clamped to the plan's columns, and a
shared entry is copied from another entry's device row only when that entry holds the same host row and reads it from
the host in this copy (else from the host): a broken plan or workspace skips or re-reads an entry instead of touching
memory outside ``host_cache`` / ``device_buffer``.
"""
