"""The Triton resolve of the swap-in (docs/kernels.md §8), one job per module: ``constants`` and ``records`` (what a
launch is built from), ``tables`` (a row's hash table in the workspace, epochs, published counts), ``stages`` (prep,
insert, place of one chunk of a row), ``split`` (their launches of many programs per row), ``per_row`` (one program
per row), ``share`` (the plan in host-row order and the call's table of host rows). ``kvplan.kernels.hisparse`` is
the public call that launches them (or the on-chip resolve, ``kvplan.kernels.onchip``) as ``kvplan.kernels.planner``
decides.

Glossary of the names the kernels use: ``B`` batch rows, ``S`` steps, ``K`` top-k, ``N = S*K`` occurrences of a row,
``HOT`` LRU slots, ``P`` tail slots; ``TB`` a row's table entries (a power of two >= 2N); ``CH``/``HCH`` occurrences /
LRU positions per chunk, ``NOC``/``NHC`` chunks per row over them; ``dbt``/``dbl`` ``device_buffer_tokens`` /
``device_buffer_locs``, ``hcl`` ``host_cache_locs``, ``lru`` ``lru_slots``; ``ws`` a row's workspace (int32 words,
regions in ``kvplan.workspace``); ``rid`` the row's request slot; a *stamp* is an epoch tag and a table bit.
"""
