"""Triton kernels. Importing this module imports Triton; set TRITON_INTERPRET before it when running on CPU."""
