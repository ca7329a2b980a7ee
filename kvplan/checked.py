"""The checked mode (``PoolConfig(check=True)`` or ``KVPLAN_CHECK=1``): every pool launch beside the reference.

For bring-up and debugging, not serving: before a launch the inputs it writes are copied; after it, the plain-PyTorch
reference (``kvplan.reference``) runs on the copies and the two results are compared: outputs, hot-buffer state,
plan (each row as a set of copies), device rows and counters exactly, materialized K within the dtype's tolerance
and V exactly. The first difference raises :class:`~kvplan.CheckMismatchError` naming it; a swap-in that drops a
token for want of scratch rows raises :class:`~kvplan.TokensDroppedError` with the sizing rule. Every launch
synchronises and allocates; nothing runs while a CUDA graph is captured or dynamo traces (the launch then runs
unchecked).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvplan.counters import OVERFLOW
from kvplan.errors import CheckMismatchError, TokensDroppedError
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState

__all__ = ["checking", "swap_in", "replay", "materialize"]

_STATE_TABLES = ("device_buffer_tokens", "lru_slots")  # what a swap-in writes in the state
_TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def checking(config) -> bool:
    """Whether a launch under ``config`` is checked now (not while capturing or tracing)."""
    if not config.check or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def swap_in(launch: Callable[[], MissPlan], state: HotBufferState, top_k_tokens: Tensor, top_k_device_locs: Tensor,
            device_buffer: Tensor, counters: Tensor, speculative: bool, **inputs) -> MissPlan:  # fmt: skip
    """Run ``launch`` (a pool swap-in), then the reference on copies of what it wrote; raise on a difference."""
    ref_state = state.clone()
    ref_out, ref_dev, ref_counters = top_k_device_locs.clone(), device_buffer.clone(), torch.zeros_like(counters)
    before = counters.clone()
    plan = launch()
    from kvplan import reference

    ref_plan = reference.swap_in(ref_state, top_k_tokens, ref_out, device_buffer=ref_dev, counters=ref_counters,
                                 speculative=speculative, **inputs)  # fmt: skip
    checks = {"top_k_device_locs": (top_k_device_locs, ref_out), "device_buffer": (device_buffer, ref_dev),
              "counters": (counters - before, ref_counters), "miss_count": (plan.count, ref_plan.count)}  # fmt: skip
    checks.update({name: (getattr(state, name), getattr(ref_state, name)) for name in _STATE_TABLES})
    _compare("swap-in", checks)
    dropped = int(ref_counters[OVERFLOW])
    if dropped:
        raise TokensDroppedError(
            f"checked mode: the swap-in dropped {dropped} token(s) (output -1, counters.overflow) for want of hot "
            f"slots and scratch rows: the state has {state.scratch} scratch rows per request; "
            f"kvplan.sizing.scratch_rows(hot={state.hot}, steps={top_k_tokens.shape[1] if speculative else 1}, "
            f"top_k={top_k_tokens.shape[-1]}) rows drop none (HotBufferState.allocate(..., steps=, top_k=) sizes them)"
        )
    for row in range(plan.src.shape[0]):
        if int(ref_plan.count[row]) > 0 and plan.row_copies(row) != ref_plan.row_copies(row):
            raise CheckMismatchError(f"checked mode: the swap-in's plan row {row} holds other copies than the "
                                     "reference's (compared as sets)")  # fmt: skip
    return plan


def replay(launch: Callable[[], object], plan: MissPlan, host_cache: Tensor, device_buffer: Tensor,
           num_real_reqs: Tensor | None) -> object:  # fmt: skip
    """Run ``launch`` (a plan replay), then the reference copy on a copy of ``device_buffer``; raise on a
    difference."""
    ref_dev = device_buffer.clone()
    result = launch()
    from kvplan import reference

    reference.copy_planned(plan, host_cache, ref_dev, num_real_reqs=num_real_reqs)
    if result is not None:  # a side stream's end event
        torch.cuda.current_stream(device_buffer.device).wait_event(result)
    _compare("replay", {"device_buffer": (device_buffer, ref_dev)})
    return result


def materialize(launch: Callable[[], tuple[Tensor, Tensor]], **inputs) -> tuple[Tensor, Tensor]:
    """Run ``launch`` (a pool materialize), then the reference; K within the dtype's tolerance, V exact."""
    k_out, v_out = launch()
    from kvplan import reference

    ref_k, ref_v = reference.materialize(**inputs)
    _compare("materialize", {"v_out": (v_out, ref_v)})
    tol = _TOLERANCE.get(k_out.dtype, 1e-4)
    if not torch.allclose(k_out.float(), ref_k.float(), atol=tol, rtol=tol):
        worst = float((k_out.float() - ref_k.float()).abs().max())
        raise CheckMismatchError(f"checked mode: materialize's k_out differs from the reference by up to {worst:.3g} "
                                 f"(tolerance {tol:g} for {k_out.dtype})")  # fmt: skip
    return k_out, v_out


def _bits(t: Tensor) -> Tensor:
    """Floating rows compared bit for bit (random bytes read as floats hold NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _compare(call: str, checks: dict[str, tuple[Tensor, Tensor]]) -> None:
    for name, (got, want) in checks.items():
        if not torch.equal(_bits(got), _bits(want)):
            where = (_bits(got) != _bits(want)).nonzero()[:4].tolist() if got.shape == want.shape else "shape"
            raise CheckMismatchError(
                f"checked mode: the {call}'s {name} differs from the reference's (first differences at {where}); "
                "the launch's arguments are in the traceback"
            )
