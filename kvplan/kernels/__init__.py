"""Triton kernels, imported on first use: ``from kvplan.kernels import swap_in`` imports Triton then.

Lazy so that ``kvplan.kernels.layout`` (pure sizing, used by the pool) never pulls Triton in, and an engine or the CLI
can still decide TRITON_INTERPRET after building a pool. Set it before the first kernel use when running on a CPU.

``swap_in`` is both a function and the submodule defining it. Importing a submodule makes Python set it as an
attribute of this package, which would shadow the lazily exported function of the same name (``kernels.swap_in``
would then be the module once anything imported ``kvplan.kernels.swap_in``, e.g. via ``swap_in_spec``). The package's
``__setattr__`` therefore keeps the exported function whenever the import system records such a submodule.
"""

from __future__ import annotations

import importlib
import sys
import types
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


class _KernelsPackage(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)  # the import system records a fully executed submodule: take its export
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
