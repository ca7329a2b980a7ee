"""Triton kernels, imported on first use: ``from kvplan.kernels import swap_in`` imports Triton then.

Lazy so that ``kvplan.kernels.workspace`` (pure sizing, used by the pool) never pulls Triton in, and an engine or the
CLI can still decide TRITON_INTERPRET after building a pool. Set it before the first kernel use when running on a CPU.

Modules are named for what they hold (``hisparse``: the swap-in; ``copy``: the plan copy; ``fused_kv``: the KV
materialize), never after a function they export, so importing one never shadows an export of this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "copy_planned": "kvplan.kernels.copy",
    "materialize": "kvplan.kernels.fused_kv",
    "swap_in": "kvplan.kernels.hisparse",
    "swap_in_spec": "kvplan.kernels.hisparse",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvplan.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
