"""Triton swap-in kernels against the PyTorch reference, exactly (docs/kernels.md §2-§3).

Under the interpreter on CPU here, on the GPU when there is one: outputs, ``device_buffer_tokens``, ``lru_slots``,
plan entries ``[0, miss_count)``, ``miss_count``, device rows and counters must all be equal. Shapes stay tiny
(K <= 32, HOT <= 64, S*K <= 64, B <= 4): the interpreter costs ~0.3 ms per op per program.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import zlib

import attrs
import pytest
import torch
from helpers.swap_in_scenarios import Guard, assert_same, build, decode_loop, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan import kernels, reference
from kvplan.calls import SwapInCall, swap_in_call
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.validate.arguments import check_swap_in
from kvplan.workspace import swap_in_workspace_columns

I32, I64 = torch.int32, torch.int64

SINGLE = dict(speculative=False, batch=3, top_k=8, hot=16, tail=2, lens=[40, 9, 25], max_len=48)
SPEC = dict(speculative=True, batch=3, steps=2, top_k=8, hot=16, tail=4, lens=[40, 9, 25], max_len=48)

CASES = {
    "single_mixed": dict(SINGLE),
    "single_no_miss": dict(SINGLE, miss_rate=0.0, invalid_rate=0.0, newest_rate=0.0),
    "single_all_miss": dict(SINGLE, miss_rate=1.0, lens=[60, 70, 30], max_len=80),
    "single_20pct_k32": dict(SINGLE, batch=2, top_k=32, hot=64, lens=[300, 200], max_len=320, miss_rate=0.2),
    "single_dups_invalid_unbacked": dict(SINGLE, dup_rate=0.4, invalid_rate=0.2, unbacked_rate=0.3, newest_rate=0.2),
    "single_padding_rows": dict(SINGLE, batch=4, lens=[40, 30, 20, 50], max_len=56, num_real=2),
    "single_int32_indices": dict(SINGLE, index_dtype=I32),
    "single_rid_permutation": dict(SINGLE, batch=4, requests=7, rids=[5, 0, 6, 2], lens=[20, 30, 40, 17]),
    "single_k_eq_hot": dict(SINGLE, top_k=16, hot=16, lens=[50, 40, 20], max_len=64, miss_rate=0.5),
    "spec_s1": dict(SPEC, steps=1, top_k=16, hot=32, lens=[60, 20, 45], max_len=72),
    "spec_s2": dict(SPEC),
    "spec_s3_dups": dict(SPEC, steps=3, dup_rate=0.4, newest_rate=0.15),
    "spec_s4": dict(SPEC, steps=4, hot=24, lens=[40, 60, 30], max_len=72, invalid_rate=0.15),
    "spec_no_miss": dict(SPEC, miss_rate=0.0, invalid_rate=0.0),
    "spec_all_miss_scratch_overflow": dict(
        SPEC, steps=4, top_k=16, hot=16, lens=[200, 150, 120], max_len=220, miss_rate=1.0, scratch=8, dup_rate=0.0
    ),
    "spec_scratch_partial": dict(SPEC, steps=4, lens=[80, 60, 90], max_len=100, miss_rate=0.7, scratch=4),
    "spec_overflow_without_scratch": dict(SPEC, steps=4, lens=[80, 60, 90], max_len=100, miss_rate=1.0),
    "spec_unbacked_dead_tail": dict(SPEC, steps=3, unbacked_rate=0.3, dead_tail=True, newest_rate=0.3),
    "spec_tail_tokens_also_hot": dict(SPEC, steps=3, tail_in_hot=True, newest_rate=0.4, dead_tail=True),
    "single_newest_also_hot": dict(SINGLE, tail_in_hot=True, newest_rate=0.4),
    "spec_padding_rid_permutation": dict(
        SPEC, batch=4, requests=6, rids=[4, 1, 5, 0], lens=[30, 40, 12, 50], max_len=60, num_real=3, scratch=2
    ),
    "spec_short_rows": dict(SPEC, lens=[5, 14, 2], invalid_rate=0.3),
    "spec_int32_indices": dict(SPEC, index_dtype=I32, scratch=3, miss_rate=0.8),
    "item_512": dict(SINGLE, batch=2, lens=[40, 30], item_bytes=512, max_len=40, host_rows=64),
    "item_576_bf16": dict(SPEC, batch=1, lens=[40], item_bytes=576, dtype=torch.bfloat16, host_rows=48),
    "item_656_int16": dict(SPEC, batch=1, lens=[40], item_bytes=656, dtype=torch.int16, host_rows=48),
    "item_1152_fp32": dict(SINGLE, batch=1, lens=[40], item_bytes=1152, dtype=torch.float32, host_rows=48),
    "item_13_odd": dict(SPEC, item_bytes=13, miss_rate=0.6),
    "item_6_int16": dict(SINGLE, item_bytes=6, dtype=torch.int16, miss_rate=0.6),
}


# the quick subset (-m "not slow") keeps one case per kind: single, spec, padding rows, scratch overflow, odd rows
FAST_CASES = {"single_mixed", "single_padding_rows", "spec_s2", "spec_all_miss_scratch_overflow",
              "spec_padding_rid_permutation", "spec_int32_indices", "item_576_bf16", "item_13_odd"}  # fmt: skip
assert FAST_CASES <= CASES.keys(), FAST_CASES - CASES.keys()


@pytest.mark.parametrize("name", [n if n in FAST_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_matches_reference(name, device):
    scn = build(seed=zlib.crc32(name.encode()), device=device, **CASES[name])
    assert_same(run(kernels, scn), run(reference, scn))


@pytest.mark.parametrize("speculative", [False, True])
def test_workspace_and_no_plan_variants(speculative, device):
    base = SPEC if speculative else SINGLE
    scn = build(seed=3, device=device, **dict(base, scratch=2 if speculative else 0, miss_rate=0.6))
    ref = run(reference, scn)
    assert_same(run(kernels, scn, workspace=True), ref)
    no_plan = run(kernels, scn, plan=False)
    assert torch.equal(no_plan.out, ref.out)
    assert torch.equal(no_plan.device_buffer, ref.device_buffer)
    assert torch.equal(no_plan.lru_slots, ref.lru_slots)
    assert torch.equal(no_plan.counters, ref.counters)


def test_scratch_overflow_case_really_overflows(device):
    """The overflow case above must exercise admitted, scratch and overflow misses all at once."""
    scn = build(
        seed=hash("spec_all_miss_scratch_overflow") % 1000, device=device, **CASES["spec_all_miss_scratch_overflow"]
    )
    res = run(kernels, scn)
    assert res.counters[3] > 0  # overflow
    assert (res.miss_count == 16 + 8).all()  # HOT evictables + C scratch rows per long row


@pytest.mark.slow  # many interpreted calls
def test_decode_loop_mixing_single_and_speculative_calls(device):
    """One state, many calls: single-step and speculative steps on the same requests with contexts growing."""
    common = dict(batch=2, top_k=8, hot=16, tail=4, max_len=96, requests=3, rids=[2, 0], scratch=2, steps=3)
    decode_loop(device, common, lens=[30, 12], calls=8)


def _broken(device, speculative):
    """Defined broken preconditions (reference rules 1-7): rid out of range, tokens past host_cache_locs, LRU
    entries outside [0, HOT), host/device/scratch rows outside their tensors, num_real_reqs beyond the batch."""
    base = SPEC if speculative else SINGLE
    scn = build(
        seed=7,
        device=device,
        **dict(base, batch=5, requests=5, rids=[1, 0, 3, 2, 4], lens=[40, 30, 44, 35, 30], max_len=36, miss_rate=0.7),
        **({"scratch": 3} if speculative else {}),
    )
    scn.req_pool_indices[2] = 9  # rule 1: rid >= R
    scn.req_pool_indices[3] = -1  # rule 1: rid < 0
    tokens = scn.top_k_tokens.view(5, -1)
    tokens[0, :2] = torch.tensor([36, 37])  # rule 2: valid tokens of rid 1 (L = 40) past Lmax = 36
    if speculative:  # rule 5: a short row (last step's length <= HOT) with a valid token >= W at an earlier step
        scn.seq_lens[4 * 2 : 4 * 2 + 2] = torch.tensor([40, 10])
        tokens[4, :3] = torch.tensor([25, 39, 5])
    state = scn.state
    n_host, n_dev = scn.host_cache.shape[0], scn.device_buffer.shape[0]
    state.lru_slots[1, 3] = 16 + 5  # rule 3: LRU entries outside [0, HOT) ...
    state.lru_slots[0, 0] = -2  # ... the first evictable of rid 0, so its first miss takes it
    state.host_cache_locs[1, :] = n_host - 12 + torch.arange(36)  # rule 4: host rows past host_cache
    state.device_buffer_locs[0, :16] = torch.where(torch.arange(16) % 2 == 0, n_dev + torch.arange(16), -3).to(I32)
    if speculative:
        state.scratch_locs[0] = torch.tensor([n_dev + 1, -1, 2], dtype=I32)
    scn.num_real_reqs = torch.tensor([99], dtype=I32, device=device)  # rule 7: clamped to the batch
    return scn


@pytest.mark.parametrize("speculative", [False, True])
def test_broken_preconditions_defined_by_the_reference(speculative, device):
    scn = _broken(device, speculative)
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    ref = run(reference, scn)
    assert_same(kernel, ref)
    # the scenario really exercises the rules: a plan entry with device row -1 (rule 3), host rows past the cache
    # (rule 4) and padding-like rows for the rids out of range (rule 1)
    plan_dst = torch.cat([ref.miss_dst[b, : ref.miss_count[b]] for b in range(2)])
    plan_src = torch.cat([ref.miss_src[b, : ref.miss_count[b]] for b in range(2)])
    assert (plan_dst == -1).any() and (plan_src >= scn.host_cache.shape[0]).any()
    assert (ref.out[2:4] == (0 if speculative else -1)).all()


def test_single_step_misses_beyond_evictables_overflow(device):
    """Rule 6: a token in two hot slots leaves fewer evictables than misses; the rest output -1 as overflow."""
    scn = build(seed=5, device=device, **dict(SINGLE, batch=1, top_k=8, hot=8, lens=[40], miss_rate=1.0, dup_rate=0))
    state = scn.state
    rid = int(scn.req_pool_indices[0])
    state.device_buffer_tokens[rid, :2] = 3  # token 3 in two hot slots, both hits
    scn.top_k_tokens[0, 0] = 3
    ref = run(reference, scn)
    assert ref.counters[3] > 0
    assert_same(run(kernels, scn), ref)


@pytest.mark.parametrize("speculative", [False, True])
def test_unspecified_preconditions_stay_in_bounds(speculative, device):
    """Two real rows on one rid, a token in two hot slots, LRU rows that are not permutations: results are
    unspecified, but nothing outside the tensors is written and every output is -1, 0 or a row the state names."""
    scn = _broken(device, speculative)
    scn.req_pool_indices[2] = 1  # shares rid 1 with row 0
    scn.state.device_buffer_tokens[0, 1] = scn.state.device_buffer_tokens[0, 2]  # token in two hot slots
    scn.state.lru_slots[0, 4] = scn.state.lru_slots[0, 5]  # not a permutation
    scn.state.lru_slots[1, 0:3] = scn.state.lru_slots[1, 3]
    guard = Guard()
    kernel = run(kernels, scn, guard=guard)
    guard.check()
    rows = set(scn.state.device_buffer_locs.flatten().tolist()) | {-1, 0}
    if scn.state.scratch_locs is not None:
        rows |= set(scn.state.scratch_locs.flatten().tolist())
    assert set(kernel.out.flatten().tolist()) <= rows


@pytest.mark.slow  # property-based: several interpreted kernel calls per example
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10_000),
    speculative=st.booleans(),
    steps=st.integers(1, 4),
    top_k=st.sampled_from([1, 3, 8]),
    miss_rate=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    scratch=st.integers(0, 3),
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=3),
)
def test_property_matches_reference(seed, speculative, steps, top_k, miss_rate, scratch, lens):
    from conftest import DEVICE

    scn = build(
        seed=seed,
        speculative=speculative,
        steps=steps,
        batch=len(lens),
        top_k=top_k,
        hot=8,
        tail=4,
        lens=lens,
        max_len=76,
        miss_rate=miss_rate,
        scratch=scratch if speculative else 0,
        unbacked_rate=0.1,
        device=DEVICE,
    )
    assert_same(run(kernels, scn), run(reference, scn))


# ---------------------------------------------------------------------------------------------------------------------
# Argument errors: named, before anything is written


_TABLES = ("device_buffer_tokens", "device_buffer_locs", "lru_slots", "host_cache_locs", "scratch_locs")


def _call_kwargs(scn, **changes):
    """Keyword arguments of a kernel call on ``scn``: tables named in ``changes`` replace the state's (the state is
    rebuilt, so its own checks run), ``miss_src``/``miss_dst``/``miss_count`` become a ``MissPlan`` (``None`` for
    those not given), everything else replaces the per-call argument."""
    tables = {name: getattr(scn.state, name) for name in _TABLES}
    for name in _TABLES:
        if name in changes:
            tables[name] = changes.pop(name)
    plan_fields = {key: changes.pop(key) for key in ("miss_src", "miss_dst", "miss_count") if key in changes}
    kwargs = dict(
        state=HotBufferState(**tables),
        top_k_tokens=scn.top_k_tokens,
        host_cache=scn.host_cache,
        device_buffer=scn.device_buffer,
        top_k_device_locs=torch.zeros_like(scn.top_k_tokens),
        req_pool_indices=scn.req_pool_indices,
        seq_lens=scn.seq_lens,
        num_real_reqs=None,
    )
    if plan_fields:
        kwargs["plan"] = MissPlan(
            plan_fields.get("miss_src"), plan_fields.get("miss_dst"), plan_fields.get("miss_count")
        )
    kwargs.update(changes)
    return kwargs


def _call_record(scn, **changes) -> SwapInCall:
    """The kernels' call record of ``scn`` with fields replaced as given, bypassing the state's own checks: what the
    kernel check (``check_swap_in``) still catches when a table reaches it without a validated state."""
    kwargs = _call_kwargs(scn)
    call = swap_in_call(
        scn.speculative,
        kwargs["state"],
        kwargs["top_k_tokens"],
        kwargs["top_k_device_locs"],
        kwargs["req_pool_indices"],
        kwargs["seq_lens"],
        kwargs["host_cache"],
        kwargs["device_buffer"],
        None,
        None,
    )
    return call._replace(**changes)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda s: {"lru_slots": s.state.lru_slots[:, :4]}, ValueError, "lru_slots must have hot >= top_k = 8"),
        (lambda s: {"seq_lens": s.seq_lens[:1]}, ValueError, r"seq_lens must have shape \[>= 3\]"),
        (lambda s: {"seq_lens": s.seq_lens.float()}, ValueError, "seq_lens must be torch.int32 or torch.int64"),
        (lambda s: {"num_real_reqs": torch.tensor([1])}, ValueError, "num_real_reqs must be torch.int32, got"),
        (lambda s: {"num_real_reqs": torch.tensor([1, 2], dtype=I32)}, ValueError, r"num_real_reqs must have shape"),
        (lambda s: {"device_buffer": s.device_buffer.to(I32)}, ValueError, "device_buffer must have host_cache's"),
        (lambda s: {"top_k_device_locs": torch.zeros(3, 7, dtype=I32)}, ValueError, "top_k_device_locs must have"),
        (
            lambda s: {"workspace": torch.zeros(3, 5, dtype=I64)},
            ValueError,
            rf"workspace must have shape \[>= 3, >= {swap_in_workspace_columns(1, 8)}\]",
        ),
        (lambda s: {"miss_src": torch.zeros(3, 8, dtype=I64)}, TypeError, "MissPlan.dst must be a torch.Tensor"),
        (
            lambda s: {"plan": (torch.zeros(3, 8, dtype=I64), torch.zeros(3, 8, dtype=I32), torch.zeros(3, dtype=I32))},
            TypeError,
            "plan must be a kvplan.MissPlan or None, got tuple",
        ),
    ],
)
def test_argument_errors_name_the_argument(change, error, match, device):
    scn = build(seed=1, device=device, **SINGLE)
    before = scn.state.clone()
    with pytest.raises(error, match=match):
        kernels.swap_in(**_call_kwargs(scn, **change(scn)))
    assert torch.equal(scn.state.lru_slots, before.lru_slots)
    assert torch.equal(scn.state.device_buffer_tokens, before.device_buffer_tokens)


@pytest.mark.parametrize(
    ("change", "error", "state_match", "kernel_match"),
    [
        (
            lambda s: {"lru_slots": s.state.lru_slots.to(I32)},
            ValueError,
            "lru_slots must be torch.int16, got torch.int32",
            "lru_slots must be torch.int16, got torch.int32",
        ),
        (
            lambda s: {"host_cache_locs": [1, 2]},
            TypeError,
            "host_cache_locs must be a torch.Tensor, got list",
            "host_cache_locs must be a torch.Tensor, got list",
        ),
        (
            lambda s: {
                "device_buffer_tokens": s.state.device_buffer_tokens[:, :16],
                "device_buffer_locs": s.state.device_buffer_locs[:, :16],
            },
            ValueError,
            r"lru_slots must have shape \[4, hot\] with 1 <= hot < 16 \(at least one tail slot\)",
            "device_buffer_tokens must have more than hot = 16 columns",
        ),
    ],
)
def test_hostile_tables_refused_by_the_state_and_by_the_kernel_check(change, error, state_match, kernel_match, device):
    """Tables the state refuses when built; the same tables reaching the kernel check without a state (a call record
    built around the state's checks) are refused there too, naming the table."""
    scn = build(seed=1, device=device, **SINGLE)
    before = scn.state.clone()
    with pytest.raises(error, match=state_match):
        kernels.swap_in(**_call_kwargs(scn, **change(scn)))
    with pytest.raises(error, match=kernel_match):
        check_swap_in(_call_record(scn, **change(scn)))
    assert torch.equal(scn.state.lru_slots, before.lru_slots)
    assert torch.equal(scn.state.device_buffer_tokens, before.device_buffer_tokens)


def test_state_that_is_not_a_hot_buffer_state_is_refused_naming_state(device):
    scn = build(seed=1, device=device, **SINGLE)
    kwargs = _call_kwargs(scn)
    tables = {name: getattr(scn.state, name) for name in _TABLES}
    for bad, kind in ((tables, "dict"), (None, "NoneType"), (tuple(tables.values()), "tuple")):
        kwargs["state"] = bad
        for fn, speculative in itertools.product((kernels.swap_in, reference.swap_in), (None, True)):
            with pytest.raises(TypeError, match=rf"^state must be a kvplan\.HotBufferState .*got {kind}\."):
                fn(**kwargs, speculative=speculative)
    before = scn.state.clone()
    with pytest.raises(TypeError, match="state must be a kvplan.HotBufferState"):
        kernels.swap_in(tables, **{k: v for k, v in _call_kwargs(scn).items() if k != "state"})  # positional
    assert torch.equal(scn.state.lru_slots, before.lru_slots)
    assert torch.equal(scn.state.device_buffer_tokens, before.device_buffer_tokens)


def test_single_step_on_a_state_with_scratch_rows_matches_the_reference(device):
    """One state serves both paths: a single-step call on a state with scratch rows works (the old keyword API raised
    TypeError for ``scratch_locs``), equals the reference, and leaves the scratch rows and their table alone."""
    scn = build(seed=4, device=device, **dict(SINGLE, scratch=3, miss_rate=0.6))
    assert scn.state.scratch_locs is not None and scn.state.scratch == 3
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    ref = run(reference, scn)
    assert_same(kernel, ref)
    assert_same(run(kernels, scn), ref)
    assert kernel.counters[0] > 0  # misses were copied
    scratch_rows = scn.state.scratch_locs.flatten().long().cpu()
    assert not torch.isin(kernel.out.flatten().long(), scratch_rows).any()
    original = scn.device_buffer.cpu()
    assert torch.equal(kernel.device_buffer[scratch_rows].view(torch.uint8), original[scratch_rows].view(torch.uint8))
    # the same call on the state without scratch rows gives the same results
    without = run(kernels, attrs.evolve(scn, state=attrs.evolve(scn.state, scratch_locs=None)))
    assert_same(without, ref)


def test_speculative_argument_errors(device):
    scn = build(seed=1, device=device, **SPEC)
    with pytest.raises(ValueError, match=r"speculative top_k_tokens must have shape \[batch, steps, top_k\]"):
        kernels.swap_in(**_call_kwargs(scn, top_k_tokens=scn.top_k_tokens[:, 0]), speculative=True)
    bad_scratch = torch.zeros(2, 3, dtype=I32)
    with pytest.raises(ValueError, match=r"scratch_locs must have shape \[4, C\], got \(2, 3\)"):
        kernels.swap_in(**_call_kwargs(scn, scratch_locs=bad_scratch))
    with pytest.raises(ValueError, match=r"scratch_locs must have shape \[4, scratch\]"):
        check_swap_in(_call_record(scn, scratch_locs=bad_scratch))
    with pytest.raises(ValueError, match=r"speculative miss_src/miss_dst must have shape"):
        kernels.swap_in(
            **_call_kwargs(
                scn,
                miss_src=torch.zeros(3, 8, dtype=I64),
                miss_dst=torch.zeros(3, 8, dtype=I32),
                miss_count=torch.zeros(3, dtype=I32),
            )
        )
    counters = new_counters(device)
    with pytest.raises(ValueError, match="counters must be"):
        kernels.swap_in(**_call_kwargs(scn, counters=counters[:3]))


def test_locs_table_with_fewer_rows_than_the_token_table_is_refused(device):
    """Both tables are read at row ``rid``: a short ``device_buffer_locs`` with the same row stride would be read out
    of bounds for the last requests, so it is refused before launch (by the state, and by the kernel check)."""
    scn = build(seed=1, device=device, **SPEC)
    locs = scn.state.device_buffer_locs
    short = locs[: locs.shape[0] - 1]
    assert short.stride(0) == scn.state.device_buffer_tokens.stride(0)
    width = scn.state.width
    with pytest.raises(ValueError, match=rf"device_buffer_locs must have shape \(4, {width}\) like device_buffer"):
        kernels.swap_in(**_call_kwargs(scn, device_buffer_locs=short))
    with pytest.raises(ValueError, match=rf"device_buffer_locs must have shape \[4, {width}\], got \(3, {width}\)"):
        check_swap_in(_call_record(scn, device_buffer_locs=short))


@pytest.mark.slow  # subprocesses importing torch and triton
def test_exported_kernels_are_functions_whatever_the_import_order():
    """Importing every kernel module first leaves each export a function, with no import-system tricks: no module
    is named after a function the package exports, and the package is a plain module."""
    code = (
        "import importlib, types, kvplan.kernels as k\n"
        "for m in ('runtime.launch_replay', 'kernels.hisparse', 'kernels.copy', 'kernels.fused_kv'):\n"
        "    importlib.import_module('kvplan.' + m)\n"
        "importlib.import_module('kvplan.validate.arguments')\n"
        "names = ('swap_in', 'copy_planned', 'materialize')\n"
        "print(type(k) is types.ModuleType and all(callable(getattr(k, n)) and getattr(k, n).__name__ == n "
        "for n in names))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True"
