"""Triton kernels: importing this package (or any module in it) imports Triton and decorates the kernels, so set
TRITON_INTERPRET before that when running on a CPU. ``import kvplan`` and building a pool import none of it (the
pool's sizing is :mod:`kvplan.workspace`); the pool imports the kernels at its first launch.

Modules are named for what they hold (``hisparse``: the swap-in; ``copy``: the plan copy, its kernels in
``plan_copy``; ``fused_kv``: the KV materialize), never after a function they export, so importing one never shadows
an export of this package. The names and abbreviations of the kernels' code: ``kvplan/kernels/glossary.py``.
"""

from kvplan.kernels.copy import copy_planned
from kvplan.kernels.fused_kv import _materialize_kernel, materialize
from kvplan.kernels.hisparse import swap_in, swap_in_blocks
from kvplan.runtime.triton_adapter import interpreted

# Whether Triton decorated the kernels for its interpreter (TRITON_INTERPRET=1 when they were imported): a launch on
# CPU tensors checks it, so setting the variable only after this import is named, not failed inside Triton.
INTERPRETED = interpreted(_materialize_kernel)
del _materialize_kernel, interpreted

__all__ = ["copy_planned", "materialize", "swap_in", "swap_in_blocks"]
