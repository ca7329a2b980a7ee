"""Triton kernels, imported on first use: ``from kvplan.kernels import swap_in`` imports Triton then.

Lazy so that ``kvplan.kernels.layout`` (pure sizing, used by the pool) never pulls Triton in, and an engine or the CLI
can still decide TRITON_INTERPRET after building a pool. Set it before the first kernel use when running on a CPU.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "copy_planned": "kvplan.kernels.copy",
    "materialize": "kvplan.kernels.materialize",
    "swap_in": "kvplan.kernels.swap_in",
    "swap_in_spec": "kvplan.kernels.swap_in",
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
