"""The launch runtime: what launches kernels, knowing none of them. Below ``kvplan.kernels`` in the layering: the
kernels import it, the pool imports it for its launch records, and nothing here imports a kernel (importing any
module of ``kvplan.kernels`` runs that package's ``__init__``, which imports every kernel).

- :mod:`kvplan.runtime.triton_adapter`: every use of Triton's private runtime, behind one version check;
- :mod:`kvplan.runtime.device`: the launchers' device helpers (device guard, SM count, early launch, row words);
- :mod:`kvplan.runtime.launch_replay`: launch records and their replay under a policy (``PoolConfig.launch_replay``).

Importing ``kvplan.runtime.triton_adapter`` or ``kvplan.runtime.launch_replay`` imports Triton (a pool imports them at
its first launch); this package's ``__init__`` imports nothing.
"""
