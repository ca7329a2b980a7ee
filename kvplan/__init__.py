"""kvplan: step-scoped buffers and Triton kernels for HiSparse swap-in and fused KV materialization.

One :class:`PlanBufferPool` per GPU worker owns the miss plan and the materialize slabs, grows them when batch,
speculative steps, top_k or context change, and launches the kernels against them. Public names are resolved lazily
so ``import kvplan`` stays cheap and never imports Triton before the caller has chosen its environment.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    "PlanBufferPool": "kvplan.pool",
    "MissPlan": "kvplan.plan",
    "PoolConfig": "kvplan.config",
    "MaterializeGeometry": "kvplan.config",
    "PoolStats": "kvplan.stats",
    "required_bytes": "kvplan.sizing",
    "scratch_rows": "kvplan.sizing",
    "swap_in_workspace_columns": "kvplan.workspace",
    "forget_tables": "kvplan.workspace",
    "PoolCapacityError": "kvplan.errors",
    "PoolBudgetError": "kvplan.errors",
    "PoolFrozenError": "kvplan.errors",
    "CheckMismatchError": "kvplan.errors",
    "TokensDroppedError": "kvplan.errors",
    "StateCheckError": "kvplan.errors",
    "NotAnIntError": "kvplan.errors",
    "FusedKVMaterializer": "kvplan.materializer",
    "HotBufferState": "kvplan.state",
    "check_miss_plan": "kvplan.validate",
    "check_spec_miss_plan": "kvplan.validate",
    "check_materialize": "kvplan.validate",
    "miss_plan_fits": "kvplan.validate",
    "spec_miss_plan_fits": "kvplan.validate",
    "materialize_fits": "kvplan.validate",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
