"""Hostile inputs to the kernels: every tensor argument of swap_in (both paths), copy_planned and materialize in
padded, permuted and expanded views, inside guard buffers. Each call either equals the reference run on the same
values (and writes nothing outside its views), or is refused with a ValueError naming the argument and changes
nothing. Which one is stated per argument and layout below, so a kernel that silently reads a view wrong, or a check
that starts refusing a layout the kernels honour, fails here.

The swap-in's hot-buffer tables travel as one ``HotBufferState`` and the plan as one ``MissPlan``; the tests keep them
as flat named tensors (each placed in its own guard buffer) and build the records per call. A table layout that
``HotBufferState`` itself refuses is asserted refused there, naming the table, and the kernel's own check is still
asserted to refuse it when the same layout reaches a state built from good tables (a table re-laid in place).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from helpers.hostile import Arena, assert_unchanged, snapshot
from helpers.kernel_calls import (
    LYR,
    PLAN_TENSORS,
    ROT,
    STATE_TABLES,
    D,
    H,
    T,
    _call_swap_in,
    _materialize,
    copy_args,
    materialize_args,
    per_call,
    plan_of,
    state_of,
    swap_in_args,
)
from helpers.plans import assert_same_plan_rows

from kvplan import check_materialize, kernels, reference

I32, I64 = torch.int32, torch.int64
OK = None


class StateRefuses(NamedTuple):
    """A table layout ``HotBufferState`` refuses (``state``: its message, naming the table); ``kernel``: the kernel
    check's message for the same layout given to the kernel through a state built from good tables."""

    state: str
    kernel: str


# ---------------------------------------------------------------------------------------------------------------------
# swap_in

UNIT_COLUMNS = "must have unit column stride"
OVERLAP = "must not have overlapping elements"
ROW_STRIDE = "device_buffer_locs must have device_buffer_tokens' row stride"

# (arguments given that layout, layout) -> None (the call runs and equals the reference), the refusal's text (the
# kernel's and the reference's check), or StateRefuses (HotBufferState refuses the tables; the kernel check still does)
SWAP_IN_EXPECT = {
    ("top_k_tokens", "padded"): OK,
    ("top_k_tokens", "permuted"): OK,
    ("top_k_tokens", "expanded"): OK,
    ("top_k_device_locs", "padded"): OK,
    ("top_k_device_locs", "permuted"): OK,
    ("top_k_device_locs", "expanded"): f"top_k_device_locs {OVERLAP}",
    ("req_pool_indices", "padded"): OK,
    ("seq_lens", "padded"): OK,
    ("seq_lens", "expanded"): OK,
    ("num_real_reqs", "padded"): OK,
    ("host_cache", "padded"): OK,
    ("host_cache", "permuted"): f"host_cache {UNIT_COLUMNS}",
    ("host_cache", "expanded"): OK,
    ("device_buffer", "padded"): OK,
    ("device_buffer", "permuted"): f"device_buffer {UNIT_COLUMNS}",
    ("device_buffer", "expanded"): f"device_buffer {OVERLAP}",
    ("device_buffer_tokens", "padded"): StateRefuses(ROW_STRIDE, ROW_STRIDE),
    ("device_buffer_tokens", "permuted"): StateRefuses(ROW_STRIDE, f"device_buffer_tokens {UNIT_COLUMNS}"),
    ("device_buffer_tokens", "expanded"): StateRefuses(ROW_STRIDE, ROW_STRIDE),
    ("device_buffer_locs", "padded"): StateRefuses(ROW_STRIDE, ROW_STRIDE),
    ("device_buffer_locs", "permuted"): StateRefuses(ROW_STRIDE, f"device_buffer_locs {UNIT_COLUMNS}"),
    (("device_buffer_tokens", "device_buffer_locs"), "padded"): OK,
    (("device_buffer_tokens", "device_buffer_locs"), "expanded"): f"device_buffer_tokens {OVERLAP}",
    ("lru_slots", "padded"): OK,
    ("lru_slots", "permuted"): f"lru_slots {UNIT_COLUMNS}",
    ("lru_slots", "expanded"): f"lru_slots {OVERLAP}",
    ("host_cache_locs", "padded"): OK,
    ("host_cache_locs", "permuted"): StateRefuses(
        r"host_cache_locs must have shape \[5, max_len\] with contiguous rows", f"host_cache_locs {UNIT_COLUMNS}"
    ),
    ("host_cache_locs", "expanded"): OK,
    ("miss_src", "padded"): "miss_src/miss_dst row strides must match",
    (("miss_src", "miss_dst"), "permuted"): "miss_src/miss_dst must have unit column stride",
    (("miss_src", "miss_dst"), "padded"): OK,
    (("miss_src", "miss_dst"), "expanded"): "rows that do not overlap",
    ("miss_count", "padded"): "miss_count must have unit stride",
    ("miss_count", "expanded"): "miss_count must have unit stride",
    ("workspace", "padded"): OK,
    ("workspace", "permuted"): f"workspace {UNIT_COLUMNS}",
    ("workspace", "expanded"): f"workspace {OVERLAP}",
    ("counters", "padded"): "counters must be a contiguous",
    ("counters", "expanded"): "counters must be a contiguous",
}
SPEC_ONLY_EXPECT = {
    ("scratch_locs", "padded"): OK,
    ("scratch_locs", "permuted"): f"scratch_locs {UNIT_COLUMNS}",
}


def swap_in_cases():
    for speculative in (False, True):
        expect = {**SWAP_IN_EXPECT, **(SPEC_ONLY_EXPECT if speculative else {})}
        for (names, layout), refusal in expect.items():
            names = (names,) if isinstance(names, str) else names
            path = "spec" if speculative else "single"
            yield pytest.param(speculative, names, layout, refusal, id=f"{path}-{'+'.join(names)}-{layout}")


def _assert_same_swap_in(got: dict, want: dict, batch: int) -> None:
    for name in ("top_k_device_locs", "device_buffer_tokens", "lru_slots", "device_buffer", "counters"):
        assert torch.equal(got[name], want[name]), f"{name} differs from the reference"
    real = int(want["num_real_reqs"][0])
    assert torch.equal(got["miss_count"][:real], want["miss_count"][:real]), "miss_count differs"
    assert_same_plan_rows(got["miss_src"], got["miss_dst"], want["miss_src"], want["miss_dst"],
                          want["miss_count"], rows=range(real))  # fmt: skip


@pytest.mark.parametrize(("speculative", "names", "layout", "refusal"), list(swap_in_cases()))
def test_swap_in_honours_or_refuses_every_layout(speculative, names, layout, refusal, device):
    base = swap_in_args(speculative, device)
    arena = Arena()
    args = {name: arena.place(name, t, layout if name in names else "dense") for name, t in base.items()}
    values = {name: t.clone() for name, t in args.items()}  # what the kernel is given, for the reference
    if isinstance(refusal, StateRefuses):
        before = snapshot(args)
        with pytest.raises(ValueError, match=refusal.state):
            state_of(args)
        # the same layout reaching the kernel in a state built from good tables (re-laid in place afterwards)
        state = state_of({name: base[name].clone() for name in STATE_TABLES if name in base})
        for name in names:
            getattr(state, name).set_(args[name])
        for impl in (kernels, reference):
            with pytest.raises(ValueError, match=refusal.kernel):
                _call_swap_in(impl, speculative, args, state=state)
        assert_unchanged(before, args)
    elif refusal is not None:
        before = snapshot(args)
        with pytest.raises(ValueError, match=refusal):
            _call_swap_in(kernels, speculative, args)
        if "workspace" not in names:  # the reference runs the same checks (it takes no workspace)
            with pytest.raises(ValueError, match=refusal):
                _call_swap_in(reference, speculative, args)
        assert_unchanged(before, args)
    else:
        _call_swap_in(kernels, speculative, args)
        _call_swap_in(reference, speculative, values)
        _assert_same_swap_in(args, values, batch=3)
        assert int(values["counters"][0]) > 0  # rows were copied: the layouts were exercised
    arena.check()


def test_the_swap_in_case_exercises_hits_misses_scratch_and_overflow(device):
    args = swap_in_args(True, device)
    _call_swap_in(reference, True, args)
    misses, _, hits, overflow = args["counters"][:4].tolist()
    assert misses > 0 and hits > 0 and overflow > 0


@pytest.mark.parametrize("impl", [kernels, reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("speculative", [False, True], ids=["single", "spec"])
def test_swap_in_refuses_a_state_or_plan_that_is_not_a_record(impl, speculative, device):
    """The flat tables or plan tensors where the records belong: a TypeError naming the argument, nothing written."""
    args = swap_in_args(speculative, device)
    before = snapshot(args)
    tables = {name: args[name] for name in STATE_TABLES if name in args}
    with pytest.raises(TypeError, match="state must be a kvplan.HotBufferState .*got dict"):
        _call_swap_in(impl, speculative, args, state=tables)
    rest = {k: v for k, v in per_call(args).items() if impl is kernels or k != "workspace"}
    plan = tuple(args[name] for name in PLAN_TENSORS)
    with pytest.raises(TypeError, match="plan must be a kvplan.MissPlan or None, got tuple"):
        impl.swap_in(state_of(args), plan=plan, speculative=speculative, **rest)
    with pytest.raises(TypeError, match="miss_src"):  # the old keywords are gone
        impl.swap_in(state_of(args), **{name: args[name] for name in PLAN_TENSORS}, speculative=speculative, **rest)
    assert_unchanged(before, args)


# ---------------------------------------------------------------------------------------------------------------------
# Arguments sharing memory: what a kernel writes must not overlap another argument.


def _aliased_swap_in(case: str, args: dict) -> dict:
    args = dict(args)
    if case == "out_is_tokens":
        args["top_k_device_locs"] = args["top_k_tokens"]
    elif case == "plan_in_workspace":  # the plan's int64 slab doubles as the workspace
        batch, n = args["miss_src"].shape
        device = args["miss_src"].device
        slab = torch.zeros(batch, max(n, args["workspace"].shape[1]), dtype=I64, device=device)
        args["miss_src"], args["workspace"] = slab[:, :n], slab
        args["miss_dst"] = torch.zeros(batch, slab.shape[1], dtype=I32, device=device)[:, :n]  # the plan's row stride
    elif case == "device_buffer_is_host_cache":
        args["host_cache"] = args["device_buffer"]
    elif case == "lru_in_locs":  # an int16 view over the device_buffer_locs table
        args["lru_slots"] = args["device_buffer_locs"].view(torch.int16)[:, : args["lru_slots"].shape[1]]
    elif case == "counters_in_plan":
        args["counters"] = args["miss_src"].view(-1)[:6]
    return args


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("out_is_tokens", "top_k_device_locs must not share memory with top_k_tokens"),
        ("plan_in_workspace", "must not share memory with"),
        ("device_buffer_is_host_cache", "device_buffer must not share memory with host_cache"),
        ("lru_in_locs", "lru_slots must not share memory with device_buffer_locs"),
        ("counters_in_plan", "must not share memory with"),
    ],
)
def test_swap_in_refuses_outputs_sharing_memory_with_another_argument(case, message, device):
    args = _aliased_swap_in(case, swap_in_args(True, device))
    before = snapshot(args)
    with pytest.raises(ValueError, match=message):
        _call_swap_in(kernels, True, args)
    assert_unchanged(before, args)


def test_swap_in_accepts_disjoint_views_of_one_buffer(device):
    """Plan, counts and workspace carved from one int64 arena without overlap: accepted, equal to the reference."""
    args = swap_in_args(True, device)
    batch, n = args["miss_src"].shape
    cols = args["workspace"].shape[1]
    arena = torch.zeros(batch * n + batch * cols + 6 + batch * n, dtype=I64, device=device)
    views = dict(
        miss_src=arena[: batch * n].view(batch, n),
        workspace=arena[batch * n : batch * n + batch * cols].view(batch, cols),
        counters=arena[batch * n + batch * cols : batch * n + batch * cols + 6],
    )
    words = arena[batch * n + batch * cols + 6 :].view(I32)  # int32 words after everything else
    views["miss_dst"] = words[: batch * n].view(batch, n)
    views["miss_count"] = words[batch * n : batch * n + batch]
    for name, view in views.items():
        view.copy_(args[name])
    values = {name: t.clone() for name, t in args.items()}
    args.update(views)
    _call_swap_in(kernels, True, args)
    _call_swap_in(reference, True, values)
    _assert_same_swap_in(args, values, batch=3)


# ---------------------------------------------------------------------------------------------------------------------
# copy_planned

COPY_EXPECT = {
    ("miss_src", "padded"): "miss_src/miss_dst row strides must match",
    (("miss_src", "miss_dst"), "padded"): OK,
    (("miss_src", "miss_dst"), "permuted"): "miss_src/miss_dst must have unit column stride",
    (("miss_src", "miss_dst"), "expanded"): OK,  # read only: every row replays the first row's plan
    ("miss_count", "padded"): "miss_count must be a contiguous",
    ("miss_count", "expanded"): "miss_count must be a contiguous",
    ("num_real_reqs", "padded"): OK,
    ("host_cache", "padded"): OK,
    ("host_cache", "permuted"): f"host_cache {UNIT_COLUMNS}",
    ("host_cache", "expanded"): OK,
    ("device_buffer", "padded"): OK,
    ("device_buffer", "permuted"): f"device_buffer {UNIT_COLUMNS}",
    ("device_buffer", "expanded"): f"device_buffer {OVERLAP}",
    ("counters", "padded"): "counters must be a contiguous",
}


def _call_copy(impl, args: dict) -> None:
    """``impl.copy_planned`` on a flat argument dict: the plan tensors as one plan, the rest by keyword."""
    impl.copy_planned(plan_of(args), **per_call(args))


def copy_cases():
    for (names, layout), refusal in COPY_EXPECT.items():
        names = (names,) if isinstance(names, str) else names
        yield pytest.param(names, layout, refusal, id=f"{'+'.join(names)}-{layout}")


@pytest.mark.parametrize(("names", "layout", "refusal"), list(copy_cases()))
def test_copy_planned_honours_or_refuses_every_layout(names, layout, refusal, device):
    arena = Arena()
    args = {name: arena.place(name, t, layout if name in names else "dense") for name, t in copy_args(device).items()}
    values = {name: t.clone() for name, t in args.items()}
    if refusal is not None:
        before = snapshot(args)
        with pytest.raises(ValueError, match=refusal):
            _call_copy(kernels, args)
        with pytest.raises(ValueError, match=refusal):  # the reference runs the same checks
            _call_copy(reference, args)
        assert_unchanged(before, args)
    else:
        _call_copy(kernels, args)
        _call_copy(reference, values)
        assert torch.equal(args["device_buffer"], values["device_buffer"])
        assert torch.equal(args["counters"], values["counters"]) and int(values["counters"][4]) > 0
    arena.check()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("device_buffer_is_host_cache", "device_buffer must not share memory with host_cache"),
        ("counters_in_plan", "counters must not share memory with miss_src"),
        ("device_buffer_over_plan", "device_buffer must not share memory with miss_dst"),
    ],
)
def test_copy_planned_refuses_outputs_sharing_memory(case, message, device):
    args = copy_args(device)
    if case == "device_buffer_is_host_cache":
        args["device_buffer"] = args["host_cache"]
    elif case == "counters_in_plan":
        args["counters"] = args["miss_src"].view(-1)[:6]
    else:  # device rows laid over the plan's int32 words
        plan = args["miss_dst"]
        args["device_buffer"] = plan.view(torch.uint8).view(-1)[:30].view(3, 10)
        args["host_cache"] = args["host_cache"][:, :10]
    before = snapshot(args)
    with pytest.raises(ValueError, match=message):
        _call_copy(kernels, args)
    assert_unchanged(before, args)


@pytest.mark.parametrize("speculative", [False, True])
def test_zero_byte_rows_count_nothing_in_kernel_and_reference(speculative, device):
    """Rows of 0 bytes move nothing: neither the kernels nor the references count a copy (reference rule 9)."""
    args = swap_in_args(speculative, device)
    args["host_cache"] = args["host_cache"][:, :0]
    args["device_buffer"] = args["device_buffer"][:, :0]
    values = {name: t.clone() for name, t in args.items()}
    _call_swap_in(kernels, speculative, args)
    _call_swap_in(reference, speculative, values)
    _assert_same_swap_in(args, values, batch=3)
    assert int(values["miss_count"][:2].sum()) > 0 and values["counters"][:2].tolist() == [0, 0]

    copy = copy_args(device)
    copy["host_cache"], copy["device_buffer"] = copy["host_cache"][:, :0], copy["device_buffer"][:, :0]
    copy_values = {name: t.clone() for name, t in copy.items()}
    _call_copy(kernels, copy)
    _call_copy(reference, copy_values)
    assert copy["counters"].tolist() == copy_values["counters"].tolist() == [0] * 6


@pytest.mark.parametrize("impl", [kernels, reference], ids=["kernel", "reference"])
def test_copy_planned_refuses_a_plan_that_is_not_a_record(impl, device):
    args = copy_args(device)
    before = snapshot(args)
    with pytest.raises(TypeError, match="plan must be a kvplan.MissPlan, got tuple"):
        impl.copy_planned(tuple(args[name] for name in PLAN_TENSORS), **per_call(args))
    assert_unchanged(before, args)


# ---------------------------------------------------------------------------------------------------------------------
# materialize


MATERIALIZE_EXPECT = {
    ("kv", "padded"): OK,
    ("kv", "permuted"): "kv must have a unit stride in its last dim",
    ("kv", "expanded"): OK,
    ("k_norm_weight", "padded"): OK,
    ("k_norm_weight", "permuted"): OK,
    ("k_norm_weight", "expanded"): OK,
    ("eps", "padded"): OK,  # every second element: read through its stride
    ("eps", "expanded"): OK,  # one epsilon expanded to every layer
    ("cos_sin_cache", "padded"): OK,
    ("cos_sin_cache", "permuted"): OK,
    ("cos_sin_cache", "expanded"): OK,
    ("positions", "padded"): OK,
    ("positions", "expanded"): OK,
    ("k_out", "padded"): OK,
    ("k_out", "permuted"): "k_out must have a unit stride in its last dim",
    ("k_out", "expanded"): f"k_out {OVERLAP}",
    ("v_out", "padded"): OK,
    ("v_out", "expanded"): f"v_out {OVERLAP}",
}


def materialize_cases():
    for (name, layout), refusal in MATERIALIZE_EXPECT.items():
        yield pytest.param(name, layout, refusal, id=f"{name}-{layout}")


@pytest.mark.parametrize(("name", "layout", "refusal"), list(materialize_cases()))
def test_materialize_honours_or_refuses_every_layout(name, layout, refusal, device):
    arena = Arena()
    args = {arg: arena.place(arg, t, layout if arg == name else "dense") for arg, t in materialize_args(device).items()}
    values = {arg: t.clone() for arg, t in args.items()}
    if refusal is not None:
        before = snapshot(args)
        with pytest.raises(ValueError, match=refusal):
            _materialize(kernels, args)
        assert_unchanged(before, args)
    else:
        k, v = _materialize(kernels, args)
        assert k is args["k_out"] and v is args["v_out"]
        k_ref, v_ref = _materialize(reference, values)
        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(v, v_ref)
    arena.check()


def test_materialize_reads_an_expanded_eps_per_layer_not_past_it(device):
    """The issue's example: one epsilon expanded to every layer (stride 0) gives that epsilon for every layer."""
    args = materialize_args(device)
    args["eps"] = torch.tensor([0.75], device=device).expand(LYR)
    k, _ = _materialize(kernels, args)
    args_dense = materialize_args(device)
    args_dense["eps"] = torch.full((LYR,), 0.75, device=device)
    k_ref, _ = _materialize(reference, args_dense)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("k_is_v", "k_out must not share memory with v_out"),
        ("k_in_kv", "k_out must not share memory with kv"),
        ("v_over_k_half", "(k_out|v_out) must not share memory with (v_out|k_out)"),
        ("v_in_weights", "must not share memory with"),
    ],
)
def test_materialize_refuses_outputs_sharing_memory(case, message, device):
    args = materialize_args(device)
    if case == "k_is_v":
        args["v_out"] = args["k_out"]
    elif case == "k_in_kv":  # K written over the kv projection it reads
        args["k_out"] = args["kv"][:, :, : H * D].reshape(T, LYR, H, D).transpose(0, 1)
    elif case == "v_over_k_half":
        big = torch.zeros(LYR, T, H, D + D // 2, device=device)
        args["k_out"], args["v_out"] = big[..., :D], big[..., D // 2 :]
    else:
        weights = torch.zeros(LYR * T * H * D + LYR * D, device=device)
        args["v_out"] = weights[: LYR * T * H * D].view(LYR, T, H, D)
        args["k_norm_weight"] = weights[LYR * T * H * D - D :][: LYR * D].view(LYR, D).add_(1.0)
    before = snapshot(args)
    with pytest.raises(ValueError, match=message):
        _materialize(kernels, args)
    with pytest.raises(ValueError, match=message):
        _materialize(reference, args)
    assert_unchanged(before, args)


def test_materialize_accepts_k_and_v_interleaved_in_one_slab(device):
    """K and V as the two halves of one [Lyr, T, H, 2, D] slab: disjoint although their address ranges meet."""
    args = materialize_args(device)
    slab = torch.full((LYR, T, H, 2, D), -5.0, device=device)
    args["k_out"], args["v_out"] = slab[:, :, :, 0], slab[:, :, :, 1]
    k, v = _materialize(kernels, args)
    k_ref, v_ref = _materialize(reference, materialize_args(device))
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(v, v_ref)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["kernel", "reference"])
def test_materialize_with_no_tokens_returns_given_outputs_unchecked_and_untouched(impl, device):
    """T == 0 returns before any check beyond docs/kernels.md §6's list: a given output of any shape, dtype or
    device, or one tensor given twice, comes back as it is and unwritten (nothing is read or written)."""
    args = materialize_args(device)
    args["kv"], args["positions"] = args["kv"][:0], args["positions"][:0]
    odd = (
        torch.full((7, 7), 3.0, device=device),
        torch.full((LYR, 0, H, D), 3.0, dtype=torch.float64, device=device),
    )
    for given in odd:
        k, v = _materialize(impl, dict(args, k_out=given, v_out=given))
        assert k is given and v is given and bool((given == 3).all())
        reads = [args[name] for name in ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions")]
        assert check_materialize(*reads, H, D, ROT, given, given) is None
    k_out, v_out = torch.empty(LYR, 0, H, D, device=device), torch.empty(LYR, 0, H, D, device=device)
    k, v = _materialize(impl, dict(args, k_out=k_out, v_out=v_out))
    assert k is k_out and v is v_out
    k, v = _materialize(impl, dict(args, k_out=None, v_out=None))
    assert k.shape == v.shape == (LYR, 0, H, D)
