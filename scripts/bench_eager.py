"""Eager host cost per call of the pool's and kernels' entry points (issue goal: swap-ins < 60 µs, materialize no
slower than SGLang's Triton call). A thin wrapper: the benchmark is the module `kvplan.benchmarks.eager`, installed
with the package (also `kvplan bench eager`)."""

from kvplan.benchmarks.eager import main

if __name__ == "__main__":
    raise SystemExit(main())
