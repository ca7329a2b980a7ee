"""The kernel glossary: the names and abbreviations of kvplan's Triton kernels (``kvplan/kernels/``), in one place.
Module docstrings point here instead of repeating them; docs/kernels.md §8 says how the kernels work.

Conventions
    ``*_ptr`` a pointer argument (a tensor); ``*_stride`` / ``*_strides`` its row stride / strides, in elements; an
    ``ALL_CAPS`` parameter is a compile-time constant (``tl.constexpr``); ``HAS_*`` whether an optional argument is
    read (``HAS_NUM_REAL``: ``num_real_reqs``, rows from it on are CUDA-graph padding; ``HAS_COUNTERS``:
    ``counters``); ``PDL`` the launch may start early (programmatic dependent launch, Hopper and later): the kernel
    waits for the launch before it (``gdc_wait``) before any memory access. Parameters are grouped: pointers, then
    strides, then sizes, then modes, then compile-time constants; launches bind every argument by name.

Shapes (the swap-in)
    ``B`` batch rows, ``S`` steps (1 on the single-step path), ``K`` top-k, ``N = S*K`` occurrences of a row;
    ``HOT`` LRU slots, ``P`` tail slots; ``R`` request slots of the state tables; ``NB`` block ids per row (the block
    front end: ``K = NB * block`` tokens).

The resolve (``kvplan.kernels.resolve``)
    ``TB`` a row's table entries (a power of two ``>= 2N``), ``LOG_TB`` its log2; ``CH`` / ``HCH`` occurrences / LRU
    positions per chunk, ``NOC`` / ``NHC`` chunks per row over them, ``HB`` next power of two ``>= NHC``; ``WPC``
    hit-bit words per hot chunk; ``SB`` the sort's block (a power of two ``>= `` a row's misses, at most
    ``ROW_SORT_MAX``); ``dbt`` / ``dbl`` ``device_buffer_tokens`` / ``device_buffer_locs``, ``hcl``
    ``host_cache_locs``, ``lru`` ``lru_slots``, ``rpi`` ``req_pool_indices``, ``seq`` ``seq_lens``, ``tok``
    ``top_k_tokens``, ``out`` ``top_k_device_locs``; ``rid`` the row's request slot; ``occ`` an occurrence; a *stamp*
    is an epoch tag and a table bit; ``SPEC`` the speculative path; ``SHAPE`` (``ResolveShape``), ``LAYOUT``
    (``WorkspaceRegions``), ``MODE`` (``PlanMode``) the compile-time records a launch is built from.

The workspace (``kvplan.workspace``)
    ``ws`` a row's workspace (int32 words, regions in ``kvplan.workspace``); its *row words* (``ROW_WORDS``): ``SHARED``
    (the row's entries that share a host row, or ``PADDING``: a padding row, copied never), ``DISPATCH`` (row 0's
    words 1-2: the copy's work counter, items handed out and programs done), ``DONE`` (row 1's word 2: the fused
    copy's count of host reads done), the epoch words; the *record* of shared host rows: ``shared_from`` per plan
    entry, the plan offset of the entry that reads its host row (``-1``: it reads the host itself); the *span words*:
    the lowest (as ``HOST_ROW_LIMIT - lowest``) and highest host row a plan row reads.

The plan copy (``kvplan.kernels.plan_copy``)
    ``src`` / ``dst`` a plan entry's host row / device row; ``n_host`` / ``n_dev`` rows of ``host_cache`` /
    ``device_buffer``; ``n_real`` the plan's real rows; ``columns`` a plan row's entries; a *work item* ``(q, b)`` the
    ``q``-th of ``Q`` (``slices``) equal slices of plan row ``b``, items ``q``-major; ``G`` programs of the grid; the
    *walked* entries (``walk_src`` / ``walk_dst``): the plan, or a single-step plan's host-row order in the workspace;
    ``record_at`` the word of each workspace row where the walked entries' records start; ``WORDS`` a KV row's words
    (the widest integer word that divides the row), ``BLOCK_W`` next power of two ``>= WORDS``, ``HOST_STRIDE`` /
    ``DEV_STRIDE`` row pitches in words; ``ROWS`` copies per work item at most; ``_WIDE`` tiles per item of the host
    reads when many entries share; a *tile* ``ROWS`` copies, one lane each; ``marks`` the workspace's padding marks are
    read; ``DISPATCH`` 0: static items (program ``p`` takes ``p, p + G, ...``), 1: the work counter, 2: the counter
    when the plan is wide and shares few host rows; ``dynamic`` items come from the counter; ``readers`` the fused
    copy's programs that read the host when few entries share; ``many_shared`` a sixteenth or more of the entries share
    a host row (the record is followed); ``row_bytes`` what one copy moves (K and V rows).

The materialize (``kvplan.kernels.fused_kv``)
    ``T`` tokens, ``Lyr`` (``LAYERS``) layers, ``H`` heads, ``D`` head dim, ``R`` half the rotary dims (here, not
    request slots); ``BLOCK_T`` / ``BLOCK_H`` tokens / heads per program; ``cs`` ``cos_sin_cache``, ``pos``
    ``positions``, ``w`` ``k_norm_weight``; stride suffixes ``_st`` / ``_sl`` / ``_sh`` / ``_sd`` / ``_sp`` per token,
    layer, head, dim, position.
"""
