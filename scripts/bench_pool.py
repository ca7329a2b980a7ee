"""Steady-state cost of PlanBufferPool against fresh allocation.

A thin wrapper, kept for the documented `python3 scripts/bench_pool.py ...` commands: the benchmark is the module
`kvplan.benchmarks.pool`, installed with the package (also `kvplan bench pool`).
"""

from kvplan.benchmarks.pool import main

if __name__ == "__main__":  # not on import: spawned compile workers re-import this file as __mp_main__
    raise SystemExit(main())
