"""Triton miss-plan copy (``copy_planned``, docs/kernels.md §4) against the reference, bit-exactly and within bounds."""

from __future__ import annotations

import pytest
import torch
from helpers.swap_in_scenarios import Guard

from kvplan import kernels, reference
from kvplan.counters import REPLAY_COPY_BASE, SWAP_IN_COPY_BASE, new_counters
from kvplan.kernels.copy import run_copy
from kvplan.kernels.plan_copy.launch import CopyLaunch
from kvplan.plan import MissPlan

I32, I64 = torch.int32, torch.int64


def _plan(gen, batch, columns, n_host, n_dev, *, broken=False):
    """Distinct destinations per plan; with ``broken``, some rows outside the tensors and counts out of range."""
    src = torch.randint(n_host, (batch, columns), generator=gen)
    dst = torch.randperm(n_dev, generator=gen)[: batch * columns].reshape(batch, columns).to(I32)
    count = torch.randint(0, columns + 1, (batch,), generator=gen).to(I32)
    if broken:
        src[0, :3] = torch.tensor([-1, n_host, 2**40])
        dst[0, 3:5] = torch.tensor([n_dev, -7], dtype=I32)
        count[0] = columns
        if batch > 1:
            count[1] = columns + 5  # clamped to the columns
        if batch > 2:
            count[2] = -3  # clamped to 0
    return src, dst, count


def _rows(gen, n, item_bytes, dtype):
    raw = torch.randint(0, 256, (n, item_bytes), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(n, -1)


@pytest.mark.parametrize(
    ("item_bytes", "dtype", "num_real", "broken"),
    [
        (576, torch.bfloat16, None, False),
        (512, torch.uint8, 2, False),
        (13, torch.uint8, 5, True),  # num_real beyond the batch: clamped
        (6, torch.int16, 1, True),
        (12, torch.int32, 0, False),
        (1152, torch.float32, None, True),
    ],
)
def test_copy_planned_matches_reference_within_bounds(item_bytes, dtype, num_real, broken, device):
    gen = torch.Generator().manual_seed(item_bytes)
    batch, columns, n_host, n_dev = 3, 6, 40, 30
    host = _rows(gen, n_host, item_bytes, dtype).to(device)
    dev = _rows(gen, n_dev, item_bytes, dtype).to(device)
    src, dst, count = (t.to(device) for t in _plan(gen, batch, columns, n_host, n_dev, broken=broken))
    num_real_reqs = None if num_real is None else torch.tensor([num_real], dtype=I32, device=device)

    ref_dev, ref_counters = dev.clone(), new_counters(device)
    reference.copy_planned(
        MissPlan(src, dst, count),
        num_real_reqs=num_real_reqs,
        host_cache=host,
        device_buffer=ref_dev,
        counters=ref_counters,
    )
    guard = Guard()
    out_dev = guard.embed("device_buffer", dev, 3, row_pad=2)
    counters = guard.embed("counters", new_counters(device), 0)
    kernels.copy_planned(
        MissPlan(
            guard.embed("miss_src", src, -2), guard.embed("miss_dst", dst, -2), guard.embed("miss_count", count, 0)
        ),
        num_real_reqs=num_real_reqs,
        host_cache=guard.embed("host_cache", host, 1, row_pad=2),
        device_buffer=out_dev,
        counters=counters,
    )
    guard.check()
    assert torch.equal(out_dev.view(torch.uint8), ref_dev.view(torch.uint8))
    assert torch.equal(counters, ref_counters)
    if num_real != 0:
        assert ref_counters[REPLAY_COPY_BASE] > 0  # the case copies something


def test_copy_planned_counter_base_and_no_counters(device):
    gen = torch.Generator().manual_seed(0)
    host = _rows(gen, 20, 8, torch.uint8).to(device)
    dev = torch.zeros(10, 8, dtype=torch.uint8, device=device)
    src = torch.tensor([[4, 9, 1]], device=device)
    dst = torch.tensor([[7, 0, 3]], dtype=I32, device=device)
    count = torch.tensor([2], dtype=I32, device=device)
    counters = new_counters(device)
    plan = dict(plan=MissPlan(src, dst, count), num_real_reqs=None, host_cache=host, device_buffer=dev)
    run_copy(**plan, counters=counters, counter_base=SWAP_IN_COPY_BASE)
    assert counters.tolist() == [2, 16, 0, 0, 0, 0]
    kernels.copy_planned(**plan, counters=counters)  # the public function adds to the replay counters
    assert counters.tolist() == [2, 16, 0, 0, 2, 16]
    with pytest.raises(TypeError, match="counter_base"):  # private now: not a keyword of the public function
        kernels.copy_planned(**plan, counter_base=SWAP_IN_COPY_BASE)
    dev.zero_()
    kernels.copy_planned(**plan)
    assert torch.equal(dev[7], host[4]) and torch.equal(dev[0], host[9])
    assert not dev[3].any()  # m = 2 is past miss_count


def test_copy_planned_empty_plans_are_no_ops(device):
    host = torch.ones(4, 8, dtype=torch.uint8, device=device)
    dev = torch.zeros(4, 8, dtype=torch.uint8, device=device)
    for batch, columns in ((0, 4), (2, 0)):
        kernels.copy_planned(
            MissPlan(
                torch.zeros(batch, columns, dtype=I64, device=device),
                torch.zeros(batch, columns, dtype=I32, device=device),
                torch.ones(batch, dtype=I32, device=device),
            ),
            num_real_reqs=None,
            host_cache=host,
            device_buffer=dev,
        )
    assert not dev.any()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(miss_src=torch.zeros(2, 3, dtype=I32)), ValueError, "miss_src must be int64 and miss_dst must be int32"),
        (dict(miss_dst=torch.zeros(2, 4, dtype=I32)), ValueError, "miss_src and miss_dst must both have shape"),
        (dict(miss_count=torch.zeros(1, dtype=I32)), ValueError, r"miss_count must be a contiguous \[>= 2\]"),
        (dict(miss_count=torch.zeros(2, dtype=I64)), ValueError, r"miss_count must be int32\. Got torch.int64"),
        (dict(device_buffer=torch.zeros(4, 4, dtype=torch.uint8)), ValueError, "device_buffer must have host_cache's"),
        (dict(device_buffer=torch.zeros(4, 8, dtype=torch.int8)), ValueError, "device_buffer must have host_cache's"),
        (dict(num_real_reqs=torch.tensor([1.0])), ValueError, "num_real_reqs must be torch.int32"),
        (dict(counter_base=5), ValueError, r"counter_base must be an int in \[0, 4\], got 5"),
        (dict(counters=torch.zeros(6, dtype=I32)), ValueError, "counters must be torch.int64"),
        (dict(host_cache=None), TypeError, "host_cache must be a torch.Tensor, got NoneType"),
        (dict(plan=(torch.zeros(2, 3, dtype=I64),) * 3), TypeError, "plan must be a kvplan.MissPlan, got tuple"),
    ],
)
def test_copy_planned_argument_errors(change, error, match, device):
    args = dict(
        miss_src=torch.zeros(2, 3, dtype=I64),
        miss_dst=torch.zeros(2, 3, dtype=I32),
        miss_count=torch.zeros(2, dtype=I32),
        num_real_reqs=None,
        host_cache=torch.zeros(4, 8, dtype=torch.uint8),
        device_buffer=torch.zeros(4, 8, dtype=torch.uint8),
        counters=new_counters("cpu"),
    )
    args.update(change)
    # on the kernels' device (CPU tensors are only launchable under the interpreter)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    plan = args.pop("plan", None)
    if plan is None:
        plan = MissPlan(args.pop("miss_src"), args.pop("miss_dst"), args.pop("miss_count"))
    for name in ("miss_src", "miss_dst", "miss_count"):
        args.pop(name, None)
    # counter_base is a private knob of the kernels (the reference still takes it): the same checks on both
    for copy in (run_copy, reference.copy_planned):
        with pytest.raises(error, match=match):
            copy(plan, **args)
    if "counter_base" not in args:
        with pytest.raises(error, match=match):
            kernels.copy_planned(plan, **args)


# ---------------------------------------------------------------------------------------------------------------------
# The ordered copy: rows walked together by quantile, items from a work counter or a static schedule


def _sorted_plan(gen, counts, columns, n_host, n_dev, device):
    """Plan rows of random host rows, sorted by host row as swap-ins write them (``counts`` may exceed the columns)."""
    batch = len(counts)
    src = torch.randint(n_host, (batch, columns), generator=gen).sort(dim=1).values
    dst = torch.randperm(n_dev, generator=gen)[: batch * columns].reshape(batch, columns).to(I32)
    return MissPlan(src.to(device), dst.to(device), torch.tensor(counts, dtype=I32, device=device))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "counter"])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [9, 9, 9, 9], [1], [0, 0], [12, -4, 3]], ids=str)
def test_ordered_copy_equals_reference_and_leaves_its_counter_zero(counts, dynamic, device):
    gen = torch.Generator().manual_seed(len(counts) * 7 + sum(counts))
    columns, n_host, n_dev = 9, 64, 64
    plan = _sorted_plan(gen, counts, columns, n_host, n_dev, device)
    host = _rows(gen, n_host, 24, torch.uint8).to(device)
    dev, ref_dev = (torch.zeros(n_dev, 24, dtype=torch.uint8, device=device) for _ in range(2))
    counters, ref_counters = new_counters(device), new_counters(device)
    reference.copy_planned(plan, host, ref_dev, counters=ref_counters)
    guard = Guard()
    dispatch = guard.embed("dispatch", torch.zeros(2, dtype=I32, device=device), 0) if dynamic else None
    for launch in (CopyLaunch(rows_per_program=2), CopyLaunch(rows_per_program=4, programs_per_sm=3)):
        dev.zero_()
        counters.zero_()
        run_copy(plan, host, dev, num_real_reqs=None, counters=counters, dispatch=dispatch, launch=launch)
        assert torch.equal(dev, ref_dev), launch
        assert torch.equal(counters, ref_counters), launch
        if dynamic:  # left zero: the next launch on the same counter copies everything again
            assert dispatch.tolist() == [0, 0]
    guard.check()


def test_count_rows_beyond_the_plan_are_not_copied(device):
    """Issue 20.1: the batch is the plan's rows, though ``count`` may be longer (``[>= batch]``): a plan viewed out of
    a larger slab copies its own rows only (the reference's 4 rows, not the slab's 8)."""
    gen = torch.Generator().manual_seed(3)
    slab = _sorted_plan(gen, [2, 2, 2, 2], 2, 40, 40, device)
    host = _rows(gen, 40, 8, torch.uint8).to(device)
    plan = MissPlan(slab.src[:2], slab.dst[:2], slab.count)  # [2, 2] plan rows, 4 counts
    for num_real in (None, torch.tensor([4], dtype=I32, device=device)):
        dev, ref_dev = (torch.zeros(40, 8, dtype=torch.uint8, device=device) for _ in range(2))
        counters, ref_counters = new_counters(device), new_counters(device)
        reference.copy_planned(plan, host, ref_dev, num_real_reqs=num_real, counters=ref_counters)
        kernels.copy_planned(plan, host, dev, num_real_reqs=num_real, counters=counters)
        assert torch.equal(dev, ref_dev)
        assert int(counters[REPLAY_COPY_BASE]) == int(ref_counters[REPLAY_COPY_BASE]) == 4
        written = {int(r) for r in slab.dst[2:].flatten()}
        assert not dev[sorted(written)].any()  # the slab's other rows were not copied


def test_a_plan_of_exactly_its_rows_is_read_inside_its_tensors(device):
    """Issue 20.1 on the GPU: plan tensors allocated at exactly ``[2, 2]`` with 4 counts (and counts past the
    columns): nothing past them is read (``scripts/sanitize.sh`` runs this under memcheck without the caching
    allocator, so a read past the plan is an access past its allocation)."""
    gen = torch.Generator().manual_seed(5)
    host = _rows(gen, 16, 8, torch.uint8).to(device)
    src = torch.tensor([[3, 9], [1, 12]], device=device)
    dst = torch.tensor([[0, 5], [7, 2]], dtype=I32, device=device)
    count = torch.tensor([2, 7, 2, 2], dtype=I32, device=device)  # row 1 past the columns: clamped to 2
    for dispatch in (None, torch.zeros(2, dtype=I32, device=device)):
        dev, ref_dev = (torch.zeros(8, 8, dtype=torch.uint8, device=device) for _ in range(2))
        reference.copy_planned(MissPlan(src, dst, count), host, ref_dev)
        run_copy(MissPlan(src, dst, count), host, dev, num_real_reqs=None, counters=None, dispatch=dispatch)
        assert torch.equal(dev, ref_dev) and int((ref_dev.sum(1) > 0).sum()) == 4
