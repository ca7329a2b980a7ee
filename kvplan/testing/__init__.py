"""Harnesses that drive kvplan like an engine, checked against the reference: used by ``kvplan demo``, the soak and
multi-GPU scripts and the tests, not by an engine's serving path.

- :mod:`kvplan.testing.simulation`: a simulated engine worker's decode loop (``DecodeLoop``, ``LoopConfig``).
- :mod:`kvplan.testing.sparse_attention`: an MLA-style decode step whose attention over the swapped-in rows must
  equal attention over the host rows (``SparseAttentionCheck``).
"""
