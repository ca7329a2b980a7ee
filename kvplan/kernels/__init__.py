"""Triton kernels. Importing this module imports Triton; set TRITON_INTERPRET before it when running on CPU."""

from kvplan.kernels.copy import copy_planned
from kvplan.kernels.materialize import materialize
from kvplan.kernels.swap_in import swap_in, swap_in_spec

__all__ = ["copy_planned", "materialize", "swap_in", "swap_in_spec"]
