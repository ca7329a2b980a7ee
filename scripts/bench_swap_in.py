"""HiSparse swap-in on a GPU beside SGLang's CUDA kernels and the host link.

A thin wrapper, kept for the documented `python3 scripts/bench_swap_in.py ...` commands: the benchmark is the module
`kvplan.benchmarks.swap_in`, installed with the package (also `kvplan bench swap_in`).
"""

from kvplan.benchmarks.swap_in import main

if __name__ == "__main__":  # not on import: spawned compile workers re-import this file as __mp_main__
    raise SystemExit(main())
