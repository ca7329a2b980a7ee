"""The Triton resolve of the swap-in (docs/kernels.md §8), one job per module: ``constants`` and ``records`` (what a
launch is built from), ``tables`` (a row's hash table in the workspace, epochs, published counts), ``stages`` (prep,
insert, place of one chunk of a row), ``split`` (their launches of many programs per row), ``per_row`` (one program
per row), ``share`` (the plan in host-row order and the call's table of host rows). ``kvplan.kernels.hisparse`` is
the public call that launches them (or the on-chip resolve, ``kvplan.kernels.onchip``) as ``kvplan.kernels.planner``
decides.

Names (``B``, ``TB``, ``NOC``, ``dbt``, ``ws``, ...): the kernel glossary, ``kvplan/kernels/glossary.py``.
"""
