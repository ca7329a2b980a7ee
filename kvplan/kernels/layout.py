"""Deprecated name of :mod:`kvplan.kernels.workspace` (kvplan 0.1): engines sized their own swap-in workspaces with
``kvplan.kernels.layout.swap_in_workspace_columns``; it is ``kvplan.swap_in_workspace_columns`` now."""

from kvplan.kernels.workspace import HOT_MAX, swap_in_workspace_columns

__all__ = ["HOT_MAX", "swap_in_workspace_columns"]
