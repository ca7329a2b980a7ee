"""Plain-PyTorch references of the kernels: the oracles the Triton kernels are compared with exactly.

Same names and keyword arguments as ``kvplan.kernels`` (minus the kernels' ``workspace``), any device, not
capture-safe (they synchronise with the device).
"""

from kvplan.reference.materialize import materialize
from kvplan.reference.swap_in import copy_planned, expand_blocks, swap_in, swap_in_blocks

__all__ = ["copy_planned", "expand_blocks", "materialize", "swap_in", "swap_in_blocks"]
