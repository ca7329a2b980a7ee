"""The checked mode (``PoolConfig(check=True)`` or ``KVPLAN_CHECK=1``): every pool launch beside the reference.

For bring-up and debugging, not serving: before a launch the inputs it writes are copied; after it, the plain-PyTorch
reference (``kvplan.reference``) runs on the copies and the two results are compared: outputs, hot-buffer state,
plan (each row as a set of copies), device rows and counters exactly, materialized K within the dtype's tolerance
and V exactly. The reference starts from copies of everything the launch writes, plan included, so a check never
depends on what an earlier call left in a buffer the contract leaves untouched. Before a swap-in the state's rules
are checked for the step's rows (``HotBufferState.check``: :class:`~kvplan.StateCheckError`, nothing launched). The
first difference raises :class:`~kvplan.CheckMismatchError` naming it; a swap-in that drops a token for want of
scratch rows raises :class:`~kvplan.TokensDroppedError` with the sizing rule, after the step ran and was checked (the
error carries the plan). Every launch synchronises and allocates; nothing runs while a CUDA graph is captured or
dynamo traces (the launch then runs unchecked).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvplan.calls import CopyCall, MaterializeCall, SwapInCall
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


def swap_in(launch: Callable[[], MissPlan], call: SwapInCall, state: HotBufferState) -> MissPlan:
    """Check the state's rules for the step's rows (``HotBufferState.check``: ``StateCheckError``, nothing launched),
    run ``launch`` (a pool swap-in of ``call``, the record it launches, writing ``call.plan``), then the reference on
    copies of what it wrote, from the same starting point: the reference writes a copy of the plan as it was, so what
    the contract leaves untouched (a padding row's ``miss_count``) compares equal whatever an earlier call left there.
    The block front end (``call.sparse_block_size`` set) compares the V rows too. Raises on a difference."""
    from kvplan.validate.arguments import check_swap_in

    check_swap_in(call, launch=False)  # the arguments first (the launch's own messages), then the state's rules
    blocks = call.sparse_block_size is not None
    steps = call.top_k_tokens.shape[1] if call.speculative else 1
    batch = call.top_k_tokens.shape[0]
    state.check(call.req_pool_indices[:batch], call.seq_lens, steps=steps, num_real_reqs=call.num_real_reqs)
    ref_state = state.clone()
    ref_out, ref_dev = call.top_k_device_locs.clone(), call.device_buffer.clone()
    ref_counters = torch.zeros_like(call.counters)
    ref_v = call.device_buffer_v.clone() if blocks else None
    plan = call.plan
    ref_plan = MissPlan(plan.src.clone(), plan.dst.clone(), plan.count.clone())
    before = call.counters.clone()
    plan = launch()
    from kvplan import reference

    inputs = dict(
        num_real_reqs=call.num_real_reqs, plan=ref_plan, counters=ref_counters, check_newest=call.check_newest
    )
    if blocks:
        reference.swap_in_blocks(ref_state, call.top_k_tokens, ref_out, call.req_pool_indices, call.seq_lens,
                                 call.host_cache, call.host_cache_v, ref_dev, ref_v,
                                 sparse_block_size=call.sparse_block_size, **inputs)  # fmt: skip
    else:
        reference.swap_in(ref_state, call.top_k_tokens, ref_out, call.req_pool_indices, call.seq_lens, call.host_cache,
                          ref_dev, speculative=call.speculative, **inputs)  # fmt: skip
    dev = "device_buffer_k" if blocks else "device_buffer"
    checks = {"top_k_device_locs": (call.top_k_device_locs, ref_out), dev: (call.device_buffer, ref_dev)}
    if blocks:
        checks["device_buffer_v"] = (call.device_buffer_v, ref_v)
    checks.update({"counters": (call.counters - before, ref_counters), "miss_count": (plan.count, ref_plan.count)})
    checks.update({name: (getattr(state, name), getattr(ref_state, name)) for name in _STATE_TABLES})
    _compare("swap-in", checks)
    for row in range(batch):
        if int(ref_plan.count[row]) > 0 and plan.row_copies(row) != ref_plan.row_copies(row):
            raise CheckMismatchError(f"checked mode: the swap-in's plan row {row} holds other copies than the "
                                     "reference's (compared as sets)")  # fmt: skip
    dropped = 0 if blocks else int(ref_counters[OVERFLOW])  # (the block front end: counted, as before, not raised)
    if dropped:  # the step ran and was checked: the error carries its plan
        raise TokensDroppedError(
            f"checked mode: the swap-in dropped {dropped} token(s) (output -1, counters.overflow) for want of hot "
            f"slots and scratch rows: the state has {state.scratch} scratch rows per request; "
            f"kvplan.sizing.scratch_rows(hot={state.hot}, steps={steps}, top_k={call.top_k_tokens.shape[-1]}) rows "
            "drop none (HotBufferState.allocate(..., steps=, top_k=) sizes them). The step ran: outputs, tables, "
            "device rows and counters are written as the reference writes them; the error's .plan is its MissPlan",
            plan=plan, dropped=dropped,
        )  # fmt: skip
    return plan


def replay(launch: Callable[[], object], call: CopyCall) -> object:
    """Run ``launch`` (a plan replay of ``call``, the record it launches), then the reference copy on a copy of
    ``call.device_buffer`` (and of ``call.device_buffer_v``; with the swap-in's ``workspace``: its padding rows copy
    nothing); raise on a difference."""
    device_buffer, device_buffer_v = call.device_buffer, call.device_buffer_v
    ref_dev = device_buffer.clone()
    ref_v = None if device_buffer_v is None else device_buffer_v.clone()
    result = launch()
    from kvplan import reference

    reference.copy_planned(call.plan, call.host_cache, ref_dev, num_real_reqs=call.num_real_reqs,
                           workspace=call.workspace, host_cache_v=call.host_cache_v,
                           device_buffer_v=ref_v)  # fmt: skip
    if result is not None:  # a side stream's end event
        torch.cuda.current_stream(device_buffer.device).wait_event(result)
    checks = {"device_buffer": (device_buffer, ref_dev)}
    if ref_v is not None:
        checks["device_buffer_v"] = (device_buffer_v, ref_v)
    _compare("replay", checks)
    return result


def materialize(launch: Callable[[], tuple[Tensor, Tensor]], call: MaterializeCall) -> tuple[Tensor, Tensor]:
    """Run ``launch`` (a pool materialize of ``call``, the record it launches), then the reference on the record's
    inputs (its own outputs); K within the dtype's tolerance, V exact."""
    k_out, v_out = launch()
    from kvplan import reference

    inputs = call[: MaterializeCall._fields.index("k_out")]  # (the record's fields before its outputs)
    ref_k, ref_v = reference.materialize(*inputs, check_positions=call.check_positions)
    _compare("materialize", {"v_out": (v_out, ref_v)})
    tol = _TOLERANCE.get(k_out.dtype, 1e-4)
    # (a non-finite input makes both non-finite in the same places: NaN agrees with NaN, an infinity with itself)
    if not torch.allclose(k_out.float(), ref_k.float(), atol=tol, rtol=tol, equal_nan=True):
        got, want = k_out.float(), ref_k.float()
        both = torch.isfinite(got) & torch.isfinite(want)
        worst = float((got - want)[both].abs().max()) if bool(both.any()) else 0.0
        apart = int((torch.isfinite(got) != torch.isfinite(want)).sum())
        kv = call.kv
        bad = int((~torch.isfinite(kv)).sum()) if kv.is_floating_point() else 0
        raise CheckMismatchError(
            f"checked mode: materialize's k_out differs from the reference by up to {worst:.3g} among finite values "
            f"(tolerance {tol:g} for {k_out.dtype}); {apart} value(s) finite in one and not the other"
            + (f"; kv holds {bad} non-finite value(s)" if bad else "")
        )
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
