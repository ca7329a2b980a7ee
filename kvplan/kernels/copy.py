"""The plan copy's public calls: ``copy_planned`` (docs/kernels.md §4), ``run_copy`` (its knobs) and ``run_copy_call``
(the launch of a copy's record, ``kvplan.calls.CopyCall``, which both build: the ops' route). The copy itself
(host rows -> device rows, for the swap-in's own copy and for plan replay) is ``kvplan.kernels.plan_copy``: how it
works (its package docstring), its entry kernels (``plan_copy/kernels.py``, one per job), their helpers
(``plan_copy/helpers.py``) and how it is launched, its grid included (``plan_copy/launch.py``). Names: the kernel
glossary, ``kvplan/kernels/glossary.py``.
"""

from __future__ import annotations

import torch

from kvplan.calls import CopyCall
from kvplan.counters import REPLAY_COPY_BASE
from kvplan.kernels.plan_copy.launch import COPY_LAUNCH, CopyLaunch, launch_copy
from kvplan.plan import MissPlan
from kvplan.runtime.launch_replay import UNRECORDED, LaunchCache, Recorder
from kvplan.validate.arguments import check_copy


def copy_planned(
    plan: MissPlan,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    *,
    num_real_reqs: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    launch_records: LaunchCache | None = None,
    host_cache_v: torch.Tensor | None = None,
    device_buffer_v: torch.Tensor | None = None,
) -> None:
    """Replay a miss plan: copy host row ``plan.src[r, m]`` to device row ``plan.dst[r, m]`` for real rows ``r`` and
    ``m < plan.count[r]`` (docs/kernels.md §4). Layers sharing the anchor's top-k call this with their own caches.

    Parameters
    ----------
    plan : MissPlan
        Read. ``src`` int64 / ``dst`` int32 ``[batch, columns]`` (one row stride), ``count`` int32 ``[>= batch]``: what
        a swap-in wrote this step. ``batch`` is the plan's rows; counts are clamped to ``[0, columns]``.
    host_cache : Tensor
        Read. ``[host_rows, item]``, pinned host memory (or on the device), any dtype.
    device_buffer : Tensor
        Written (rows ``plan.dst``). ``[device_rows, item]``, ``host_cache``'s dtype, on the device.
    num_real_reqs : Tensor, optional
        Read on the device. ``[1]`` int32: plan rows from it on are CUDA-graph padding (``None``: all are real).
    counters : Tensor, optional
        Written. ``kvplan.counters.new_counters(device)``: adds the rows and bytes copied (``replayed_*``).
    workspace : Tensor, optional
        Read. The workspace of the swap-in that wrote ``plan`` (``pool.replay`` passes the pool's): its record of
        the entries that share a host row, so each distinct host row is read from the host once and copied on the
        device to the others. Any int64 ``[>= batch, >= ceil((8 + columns) / 2)]`` tensor is safe: an entry is
        copied from another's device row only when that one holds the same host row and read it in this copy.
    launch_records : LaunchCache, optional
        Where a checked call's launches are recorded, so that a later call laid out alike skips its checks and
        relaunches them under the records' policy (``kvplan.runtime.launch_replay``; a pool passes its own). ``None``
        (the default): every call is checked and launched, nothing is recorded.
    host_cache_v, device_buffer_v : Tensor, optional
        Both or neither: the V rows of an MHA layer beside its K rows (``host_cache``/``device_buffer``), each with its
        K twin's shape, dtype and row stride. Each entry copies its K row and its V row in one pass (the plan of
        :func:`kvplan.kernels.swap_in_blocks` replayed into another layer's K and V caches); the counters add the
        entry once and the bytes of both rows.

    Allocates nothing and never synchronises (CUDA-graph capturable). Rows are read in host-address order when each
    plan row is sorted by ``src``, as swap-ins above small batches write them (faster on large host caches).
    """
    call = CopyCall(plan, host_cache, device_buffer, num_real_reqs, counters, REPLAY_COPY_BASE, workspace, host_cache_v,
                    device_buffer_v)  # fmt: skip
    run_copy_call(call, records=launch_records)


def run_copy(
    plan: MissPlan, host_cache: torch.Tensor, device_buffer: torch.Tensor, *, num_real_reqs: torch.Tensor | None,
    counters: torch.Tensor | None, counter_base: int = REPLAY_COPY_BASE, dispatch: torch.Tensor | None = None,
    launch: CopyLaunch | None = None, workspace: torch.Tensor | None = None, records: LaunchCache | None = None,
    host_cache_v: torch.Tensor | None = None, device_buffer_v: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """:func:`copy_planned` with the package's knobs, argument by argument (the benchmarks, the compile check): the
    counters it adds to, a work counter (``dispatch``: two int32 words, zero, that no other launch uses at the same
    time; left zero), the launch shape, the launch records (``None``: checked and launched, nothing recorded). Builds
    the call's record for :func:`run_copy_call`."""
    call = CopyCall(plan, host_cache, device_buffer, num_real_reqs, counters, counter_base, workspace, host_cache_v,
                    device_buffer_v)  # fmt: skip
    run_copy_call(call, dispatch=dispatch, launch=launch, records=records)


def run_copy_call(
    call: CopyCall, *, dispatch: torch.Tensor | None = None, launch: CopyLaunch | None = None,
    records: LaunchCache | None = None,
) -> None:  # fmt: skip
    """Check and launch one plan copy's record (``kvplan.calls.CopyCall``): every entry point's launch
    (:func:`copy_planned`, :func:`run_copy`, ``kvplan.ops.run_copy`` and the custom ops, so the pool and the adapter).
    ``dispatch`` and ``launch`` as :func:`run_copy`'s. With ``records`` (a pool's), a call laid out like a checked one
    is launched again from its record (``kvplan.runtime.launch_replay``); without, every call is checked and launched,
    nothing recorded."""
    launch = launch or COPY_LAUNCH  # keyed as launched (tests and benchmarks swap the default)
    key = None
    if records is not None:
        key = records.key((*plan_tensors(call.plan), *call[1:], dispatch, launch))
        if records.relaunch(key, call.device_buffer):
            return
    (plan, host_cache, device_buffer, num_real_reqs, counters, counter_base, workspace, host_cache_v,
     device_buffer_v) = call  # fmt: skip
    check_copy(
        plan, host_cache, device_buffer, num_real_reqs=num_real_reqs, counters=counters, counter_base=counter_base,
        workspace=workspace, host_cache_v=host_cache_v, device_buffer_v=device_buffer_v,
    )  # fmt: skip
    recorder = UNRECORDED if records is None else Recorder()
    launch_copy(
        plan,
        host_cache,
        device_buffer,
        host_cache_v=host_cache_v,
        device_buffer_v=device_buffer_v,
        num_real_reqs=num_real_reqs,
        counters=counters,
        counter_base=counter_base,
        recorder=recorder,
        dispatch=dispatch,
        launch=launch,
        workspace=None if workspace is None or plan.src.shape[1] == 0 else workspace.view(torch.int32),
    )
    if records is not None:
        records.remember(key, recorder)


def plan_tensors(plan: object) -> tuple:
    """``(src, dst, count)`` of a ``MissPlan`` for a layout key (anything else keys as itself and is refused by the
    checks)."""
    return (plan.src, plan.dst, plan.count) if isinstance(plan, MissPlan) else (plan, None, None)
