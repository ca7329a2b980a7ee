"""The SGLang adapter's kernel calls relaunch from the launch records of its per-thread pool (the kernels keep none of
their own): its plan copy, called again with the same tensors, skips its checks, counted in ``pool_for(dev).stats()``.
On the CPU a recorder that keeps its launches stands in for the GPU's, and a relaunch is a list."""

from __future__ import annotations

from helpers.kernel_calls import _KeepingRecorder, copy_args

from kvplan.compat import sglang as sg
from kvplan.kernels import copy
from kvplan.runtime import launch_replay


def test_the_adapters_plan_copy_relaunches_from_its_pools_records(monkeypatch, device):
    monkeypatch.setattr(copy, "Recorder", _KeepingRecorder)
    relaunched: list = []
    monkeypatch.setattr(launch_replay, "relaunch", relaunched.append)
    checks = [0]
    check = copy.check_copy

    def counting(*args, **kwargs):
        checks[0] += 1
        return check(*args, **kwargs)

    monkeypatch.setattr(copy, "check_copy", counting)
    pool = sg.pool_for(device)
    before = pool.stats().relaunches
    args = copy_args(device)
    plan = (args["miss_src"], args["miss_dst"], args["miss_count"])
    item = args["host_cache"].shape[1]
    for _ in range(3):
        sg.copy_cache_planned_mla(*plan, args["num_real_reqs"], args["host_cache"], args["device_buffer"], item)
    assert checks[0] == 1 and len(relaunched) == 2
    assert pool.stats().relaunches - before == 2
