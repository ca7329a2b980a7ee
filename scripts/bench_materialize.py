"""Fused KV materialization on a GPU against the device copy, eager PyTorch and torch.compile.

A thin wrapper, kept for the documented `python3 scripts/bench_materialize.py ...` commands: the benchmark is the module
`kvplan.benchmarks.materialize`, installed with the package (also `kvplan bench materialize`).
"""

from kvplan.benchmarks.materialize import main

if __name__ == "__main__":  # not on import: spawned compile workers re-import this file as __mp_main__
    raise SystemExit(main())
