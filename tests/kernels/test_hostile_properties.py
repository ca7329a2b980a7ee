"""Property tests with hostile inputs (hypothesis, small shapes: the kernels run under Triton's interpreter).

- The argument checks of every kernel, fed valid calls with one or two arguments replaced by random tensors (any
  rank, size, dtype, layout, expanded or aliasing another argument) or non-tensors, raise only TypeError/ValueError;
  so does ``HotBufferState`` fed the same state tables; the materialize validator's guard agrees with its check on
  the same inputs.
- The swap-in kernels on random state whose broken values have defined outcomes (rids, tokens, LRU entries, host and
  device rows out of range) equal the reference exactly, with every argument inside a guard buffer that must come
  back untouched; on state whose results are unspecified (repeated rids or LRU entries, shared device rows) they
  still write nothing outside their arguments.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hostile import Arena
from helpers.kernel_calls import STATE_TABLES, copy_args, materialize_args, plan_of, state_of, swap_in_args
from helpers.plans import assert_same_plan_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan import kernels, reference
from kvplan.calls import SwapInCall
from kvplan.counters import REPLAY_COPY_BASE, new_counters
from kvplan.validate import arguments as checks
from kvplan.validate import check_materialize, materialize_fits
from kvplan.workspace import swap_in_workspace_columns

I16, I32, I64 = torch.int16, torch.int32, torch.int64
DTYPES = [I16, I32, I64, torch.uint8, torch.float32, torch.bfloat16, torch.bool]
QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # (`device` is a constant per session)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=QUIET)
KERNEL_RUNS = settings(max_examples=8, deadline=None, suppress_health_check=QUIET)


@st.composite
def hostile_value(draw, others: dict[str, torch.Tensor]):
    """A random tensor (any rank up to 3, sizes up to 4, any dtype, dense, expanded or stepped), a view of another
    argument, or a non-tensor."""
    kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "alias", "other"]))
    if kind == "other":
        return draw(st.sampled_from([None, 3, 2.5, [1, 2], "x"]))
    if kind == "alias":
        source = others[draw(st.sampled_from(sorted(k for k, v in others.items() if isinstance(v, torch.Tensor))))]
        flat = source.reshape(-1)
        if flat.numel() == 0:
            return source
        start = draw(st.integers(0, flat.numel() - 1))
        return flat[start:].view(-1)[: draw(st.integers(1, 8))]
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    device = next(v.device for v in others.values() if isinstance(v, torch.Tensor))
    t = torch.zeros(shape, dtype=dtype, device=device)
    layout = draw(st.sampled_from(["dense", "expanded", "stepped"]))
    if layout == "expanded" and t.dim() and t.shape[0]:
        t = t[:1].expand(t.shape)
    elif layout == "stepped" and t.dim():
        t = torch.zeros([2 * shape[0], *shape[1:]], dtype=dtype, device=device)[::2]
    return t


def _assert_only_argument_errors(call) -> None:
    try:
        call()
    except (TypeError, ValueError):
        pass


@FUZZ
@given(data=st.data(), speculative=st.booleans())
def test_swap_in_checks_raise_only_argument_errors(data, speculative, device):
    args = swap_in_args(speculative, device)
    for name in data.draw(st.lists(st.sampled_from(sorted(args)), min_size=1, max_size=2, unique=True)):
        args[name] = data.draw(hostile_value(args), label=name)
    # the state refuses bad tables with argument errors only
    _assert_only_argument_errors(lambda: state_of(args))
    # the kernel check of the whole call record, the tables as given (what a state re-laid in place would hand on)
    call = SwapInCall(speculative, **{name: args.get(name) for name in SwapInCall._fields[1:]})
    _assert_only_argument_errors(lambda: checks.check_swap_in(call))
    _assert_only_argument_errors(lambda: checks.check_swap_in(call, launch=False))


@FUZZ
@given(data=st.data())
def test_copy_checks_raise_only_argument_errors(data, device):
    args = copy_args(device)
    for name in data.draw(st.lists(st.sampled_from(sorted(args)), min_size=1, max_size=2, unique=True)):
        args[name] = data.draw(hostile_value(args), label=name)
    base = data.draw(st.sampled_from([0, 4, -1, 5, True]))
    rest = {k: v for k, v in args.items() if k not in ("miss_src", "miss_dst", "miss_count")}
    # building the plan record is part of the call (MissPlan checks its fields): it too raises argument errors only
    _assert_only_argument_errors(lambda: checks.check_copy(plan_of(args), **rest, counter_base=base))
    _assert_only_argument_errors(lambda: checks.check_copy(plan_of(args), **rest, counter_base=base, launch=False))
    # a plan argument that is not a MissPlan is refused too
    _assert_only_argument_errors(lambda: checks.check_copy(args["miss_src"], **rest, counter_base=REPLAY_COPY_BASE))


@FUZZ
@given(data=st.data())
def test_materialize_checks_raise_only_argument_errors_and_the_guard_agrees(data, device):
    args = materialize_args(device)
    if data.draw(st.booleans()):
        args["kv"], args["positions"] = args["kv"][:0], args["positions"][:0]
    for name in data.draw(st.lists(st.sampled_from(sorted(args)), min_size=1, max_size=2, unique=True)):
        args[name] = data.draw(hostile_value(args), label=name)
    call = (args["kv"], args["k_norm_weight"], args["eps"], args["cos_sin_cache"], args["positions"], 2, 8, 6)
    outputs = dict(k_out=args["k_out"], v_out=args["v_out"])
    try:
        check_materialize(*call, **outputs)
        passed = True
    except (TypeError, ValueError):
        passed = False
    assert materialize_fits(*call, **outputs) is passed
    _assert_only_argument_errors(lambda: checks.check_materialize_args(*call, outputs["k_out"], outputs["v_out"]))


# ---------------------------------------------------------------------------------------------------------------------
# Kernels on random broken state, every argument guarded


@st.composite
def broken_state_call(draw, speculative: bool, defined: bool):
    batch = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 3)) if speculative else 1
    top_k = draw(st.integers(1, 4))
    hot = draw(st.integers(top_k, 6))
    tail = draw(st.integers(1, 3))
    requests = draw(st.integers(batch if defined else 1, 4))
    max_len = draw(st.integers(1, 24))
    scratch = draw(st.integers(0, 3)) if speculative else 0
    item = draw(st.sampled_from([1, 3, 8]))
    width = hot + tail
    n_rows = requests * (width + scratch)
    n_dev = draw(st.integers(max(1, n_rows - 3), n_rows + 3))
    n_host = draw(st.integers(1, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def ints(low, high, shape, dtype=I32):
        return torch.randint(low, high, shape, generator=gen).to(dtype)

    if defined:
        # distinct rids, some outside [0, R); distinct device rows, some outside device_buffer; LRU rows that are
        # permutations with some entries replaced by distinct out-of-range values
        rids = torch.randperm(requests + 2, generator=gen)[:batch] - 1
        rows = torch.randperm(n_rows + 6, generator=gen) - 3
        device_buffer_locs = rows[: requests * width].reshape(requests, width).to(I32)
        scratch_locs = rows[requests * width : n_rows].reshape(requests, scratch).to(I32)
        lru = torch.stack([torch.randperm(hot, generator=gen) for _ in range(requests)])
        distinct = torch.arange(lru.numel()).view(lru.shape)
        outside = torch.where(torch.rand(lru.shape, generator=gen) < 0.5, hot + distinct, -1 - distinct)
        lru = torch.where(torch.rand(lru.shape, generator=gen) < 0.2, outside, lru).to(I16)
    else:
        rids = ints(-1, requests + 1, (batch,), I64)
        device_buffer_locs = ints(-2, n_dev + 2, (requests, width))
        scratch_locs = ints(-2, n_dev + 2, (requests, scratch))
        lru = ints(-2, hot + 2, (requests, hot), I16)
    shape = (batch, steps, top_k) if speculative else (batch, top_k)
    args = dict(
        top_k_tokens=ints(-3, max_len + 3, shape),
        top_k_device_locs=torch.full(shape, -7, dtype=I32),
        req_pool_indices=rids.to(draw(st.sampled_from([I32, I64]))),
        seq_lens=ints(-1, max_len + 3, (batch * steps,), draw(st.sampled_from([I32, I64]))),
        num_real_reqs=draw(st.sampled_from([None, torch.tensor([draw(st.integers(-1, batch + 1))], dtype=I32)])),
        host_cache=ints(0, 256, (n_host, item), torch.uint8),
        device_buffer=ints(0, 256, (n_dev, item), torch.uint8),
        device_buffer_tokens=ints(-2, max_len + 3, (requests, width)),
        device_buffer_locs=device_buffer_locs,
        lru_slots=lru,
        host_cache_locs=ints(-2, n_host + 2, (requests, max_len), I64),
        miss_src=torch.full((batch, steps * top_k), -9, dtype=I64),
        miss_dst=torch.full((batch, steps * top_k), -9, dtype=I32),
        miss_count=torch.full((batch,), -9, dtype=I32),
        workspace=torch.full((batch, swap_in_workspace_columns(steps, top_k)), -11, dtype=I64),
        counters=new_counters("cpu"),
    )
    if speculative:
        args["scratch_locs"] = scratch_locs
    return args


def _to(args: dict, device: torch.device) -> dict:
    return {name: None if t is None else t.to(device) for name, t in args.items()}


def _call(impl, speculative: bool, args: dict) -> None:
    """``impl``'s swap-in: the tables as one state, the plan tensors as one plan, the rest by keyword."""
    rest = {k: v for k, v in args.items() if k not in STATE_TABLES + ("miss_src", "miss_dst", "miss_count")}
    impl.swap_in(state_of(args), plan=plan_of(args), speculative=speculative, **rest)


def _run_guarded(speculative: bool, args: dict) -> dict:
    arena = Arena()
    guarded = {name: arena.place(name, t, "guarded") if t is not None else None for name, t in args.items()}
    _call(kernels, speculative, guarded)
    arena.check()
    return guarded


@pytest.mark.parametrize("speculative", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["single", "spec"])
@KERNEL_RUNS
@given(data=st.data())
def test_kernels_on_broken_state_with_defined_outcomes_equal_the_reference(speculative, data, device):
    args = _to(data.draw(broken_state_call(speculative, defined=True)), device)
    values = {name: None if t is None else t.clone() for name, t in args.items()}
    got = _run_guarded(speculative, args)
    values.pop("workspace")
    _call(reference, speculative, values)
    for name in ("top_k_device_locs", "device_buffer_tokens", "lru_slots", "device_buffer", "counters"):
        assert torch.equal(got[name], values[name]), name
    real = got["miss_count"].shape[0]
    if values["num_real_reqs"] is not None:
        real = min(max(int(values["num_real_reqs"][0]), 0), real)
    rows = range(got["miss_count"].shape[0]) if speculative else range(real)  # single-step padding rows: untouched
    for b in rows:
        n = int(values["miss_count"][b])
        assert int(got["miss_count"][b]) == n, f"miss_count[{b}]"
    assert_same_plan_rows(got["miss_src"], got["miss_dst"], values["miss_src"], values["miss_dst"],
                          values["miss_count"], rows=rows)  # fmt: skip


@pytest.mark.parametrize("speculative", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["single", "spec"])
@KERNEL_RUNS
@given(data=st.data())
def test_kernels_on_any_broken_state_stay_inside_their_arguments(speculative, data, device):
    _run_guarded(speculative, _to(data.draw(broken_state_call(speculative, defined=False)), device))


# ---------------------------------------------------------------------------------------------------------------------
# The overlap test itself, against brute force over every element's address


def _addresses(t: torch.Tensor) -> list[int]:
    offsets = torch.zeros((), dtype=I64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets[..., None] + torch.arange(n) * stride
    return (offsets.reshape(-1) + t.storage_offset()).tolist()


strided_views = st.tuples(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.lists(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 12, 20]), min_size=3, max_size=3),
    st.integers(0, 40),
)


@settings(max_examples=300, deadline=None)
@given(a=strided_views, b=strided_views)
def test_overlap_test_is_never_wrong_and_exact_for_equal_dtypes(a, b):
    base = torch.zeros(4096)
    views = [base.as_strided(shape, strides[: len(shape)], offset) for shape, strides, offset in (a, b)]
    first, second = views
    own = _addresses(first)
    if len(set(own)) < len(own):  # a layout it cannot prove disjoint may count as overlapping, never the reverse
        assert checks.overlaps_itself(tuple(first.shape), first.stride())
    if first.is_contiguous() or first.dim() == 1 and first.stride(0) > 0:
        assert not checks.overlaps_itself(tuple(first.shape), first.stride())
    shared = bool(set(own) & set(_addresses(second)))
    operands = [checks._operand(name, t) for name, t in (("a", first), ("b", second))]
    assert checks._share_memory(*operands) == shared
