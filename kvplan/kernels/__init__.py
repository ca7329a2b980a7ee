"""Triton kernels. Importing this module imports Triton; set TRITON_INTERPRET before it when running on CPU."""
from kvplan.kernels.materialize import materialize  # noqa: F401
