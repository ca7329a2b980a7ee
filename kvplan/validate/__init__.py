"""kvplan's one validation layer: every argument check and every message, for every entry point.

- :mod:`kvplan.validate.messages`: the raw validators engines call on their own buffers (``check_miss_plan``,
  ``check_spec_miss_plan``, ``check_materialize`` and their ``*_fits`` guards), with the exact texts of
  docs/kernels.md §6 that engines already match.
- the hot-buffer tables' rules (their dtypes, the type and dtype rules, one row stride for the slot tables, at most
  ``HOT_MAX`` hot slots) are declared once in :mod:`kvplan.table_rules`, below the state that runs them when built
  (and below this package): the call checks below run them on every swap-in.
- :mod:`kvplan.validate.arguments`: the checks of a whole kernel call (swap-in, plan copy, materialize), built on the
  raw validators and the table rules. The kernels, the ``torch.library`` ops, the reference and the pool all call
  them, so one bad argument gets one message whichever entry point it reached.

Nothing here reads tensor contents, synchronises or imports Triton.
"""

from __future__ import annotations

from kvplan.validate.messages import (
    check_materialize,
    check_miss_plan,
    check_spec_miss_plan,
    device_key,
    materialize_fits,
    miss_plan_fits,
    spec_miss_plan_fits,
)

__all__ = [
    "check_materialize",
    "check_miss_plan",
    "check_spec_miss_plan",
    "device_key",
    "materialize_fits",
    "miss_plan_fits",
    "spec_miss_plan_fits",
]
