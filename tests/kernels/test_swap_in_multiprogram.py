"""The multi-program resolve (kvplan.kernels.hisparse): paths the small default-launch cases never reach.

At the shapes the interpreter can afford, the default launch puts a whole row in one program per phase. These tests
force the smallest chunks (64 occurrences, 32 LRU positions per chunk), so rows span several chunks in every step
(several programs, or several steps of one program per row): table inserts racing across programs, miss ranks across
occurrence chunks, evictables listed across hot chunks; on each of the three paths a call takes. They also reuse one
workspace across calls of different shapes (it holds the previous call's table), collide many tokens in one hash
bucket, and run batch 1 and batch 64.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
from helpers.swap_in_scenarios import PATHS, Guard, assert_same, build, run, small_launch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplan import kernels, reference
from kvplan.counters import new_counters
from kvplan.workspace import swap_in_workspace_columns, swap_in_workspace_regions

swap_in_module = importlib.import_module("kvplan.kernels.hisparse")

I32, I64 = torch.int32, torch.int64
SMALL = swap_in_module.ResolveLaunch(occ_chunk=64, hot_chunk=32)


@pytest.fixture(params=list(PATHS))
def small_chunks(request, monkeypatch):
    """Every launch in the test uses the smallest chunks, on each of the three paths."""
    launch = small_launch(request.param)
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", launch)
    return launch


SPEC = dict(speculative=True, batch=2, steps=4, top_k=40, hot=80, tail=6, lens=[300, 250], max_len=340)
SINGLE = dict(speculative=False, batch=2, top_k=72, hot=100, tail=2, lens=[300, 250], max_len=340)

CASES = {
    "spec_s4_mixed": dict(SPEC, miss_rate=0.3, dup_rate=0.2, invalid_rate=0.05, newest_rate=0.05),
    "spec_s4_all_miss_scratch_overflow": dict(SPEC, miss_rate=1.0, dup_rate=0.0, scratch=20, hot=64),
    "spec_s3_every_hit": dict(SPEC, steps=3, miss_rate=0.0, invalid_rate=0.0, newest_rate=0.0),
    "spec_s2_unbacked_dead_tail": dict(SPEC, steps=2, unbacked_rate=0.3, dead_tail=True, newest_rate=0.2),
    "spec_s1_int32": dict(SPEC, steps=1, top_k=70, index_dtype=I32, miss_rate=0.5, scratch=4),
    "spec_padding_rows": dict(SPEC, batch=4, requests=6, rids=[4, 1, 5, 0], lens=[300, 90, 60, 200], num_real=2),
    "spec_short_and_long": dict(SPEC, batch=3, lens=[300, 30, 200], invalid_rate=0.2),
    "single_mixed": dict(SINGLE, miss_rate=0.3, dup_rate=0.2, newest_rate=0.1),
    "single_all_miss_int32": dict(SINGLE, miss_rate=1.0, index_dtype=I32),
    "single_every_hit": dict(SINGLE, miss_rate=0.0, invalid_rate=0.0, newest_rate=0.0),
    "single_dups_unbacked_padding": dict(
        SINGLE, batch=3, lens=[300, 250, 280], dup_rate=0.4, unbacked_rate=0.3, num_real=2
    ),
    "single_k_eq_hot": dict(SINGLE, top_k=96, hot=96, miss_rate=0.5),
}


# the quick subset (-m "not slow") keeps one speculative and one single-step case (padding rows, dups, unbacked)
FAST_CASES = {"spec_s4_mixed", "single_dups_unbacked_padding"}
assert FAST_CASES <= CASES.keys(), FAST_CASES - CASES.keys()


@pytest.mark.parametrize("name", [n if n in FAST_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_rows_spanning_many_programs_match_reference(name, small_chunks, device):
    scn = build(seed=zlib.crc32(name.encode()), device=device, **CASES[name])
    n, hot = scn.occurrences, scn.state.lru_slots.shape[1]
    assert n > 64 and hot > 32  # several occurrence chunks and several hot chunks per row
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    assert_same(kernel, run(reference, scn))


def test_the_cases_exercise_admission_scratch_and_overflow_across_chunks(small_chunks, device):
    scn = build(seed=3, device=device, **CASES["spec_s4_all_miss_scratch_overflow"])
    res = run(kernels, scn)
    assert res.counters[3] > 0  # overflow
    assert (res.miss_count == 64 + 20).all()  # every evictable slot of 2 hot chunks, then every scratch row


@pytest.mark.slow  # batch 64 under the interpreter
def test_batch_64(monkeypatch, device):
    """Batch 64 with the smallest chunks on the sorted path (split resolve, sort, host rows shared across 64 rows, the
    two copies). Only this path: the flat and one-program-per-row steps are the same code at any batch, and the tests
    above run them on rows spanning many chunks."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch("sorted"))
    lens = [int(x) for x in torch.randint(60, 200, (64,), generator=torch.Generator().manual_seed(1))]
    scn = build(
        seed=11,
        speculative=True,
        batch=64,
        steps=2,
        top_k=36,
        hot=40,
        tail=4,
        lens=lens,
        max_len=210,
        miss_rate=0.4,
        scratch=3,
        num_real=61,
        device=device,
    )
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))


def test_batch_1(small_chunks, device):
    scn = build(seed=12, device=device, **dict(SPEC, batch=1, lens=[320]))
    assert_same(run(kernels, scn), run(reference, scn))


def _colliding_tokens(count: int, table_size: int, below: int) -> list[int]:
    """Tokens < ``below`` whose hash (the kernels' Fibonacci hash) falls in two adjacent buckets of a table of
    ``table_size`` entries: one probe chain much longer than a probe window."""
    log = table_size.bit_length() - 1
    t = torch.arange(below, dtype=torch.int64)
    bucket = ((t * 0x61C88647) & 0xFFFFFFFF) >> (32 - log)
    same = t[(bucket == bucket[7]) | (bucket == (bucket[7] + 1) % table_size)]
    assert same.numel() >= count
    return same[torch.randperm(same.numel(), generator=torch.Generator().manual_seed(0))[:count]].tolist()


@pytest.mark.parametrize("speculative", [True, False])
def test_tokens_colliding_in_one_hash_bucket(speculative, small_chunks, device):
    """Long probe chains: every wanted token of the row hashes to one bucket, hot tokens included."""
    base = SPEC if speculative else SINGLE
    scn = build(seed=21, device=device, **dict(base, batch=1, lens=[30000], max_len=32000, miss_rate=0.5))
    steps = base.get("steps", 1) if speculative else 1
    table = swap_in_workspace_regions(steps, base["top_k"]).table_size
    rid = int(scn.req_pool_indices[0])
    collide = torch.tensor(_colliding_tokens(min(60, scn.occurrences // 2), table, 29990), dtype=I32)
    held = collide.numel() // 2
    scn.state.device_buffer_tokens[rid, :held] = collide[:held].to(device)  # half of them held in hot slots
    tokens = scn.top_k_tokens.view(1, -1)
    tokens[0, : 2 * collide.numel()] = collide.repeat(2).to(device)  # each wanted twice
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))


def test_one_workspace_reused_across_calls_of_different_shapes(small_chunks, device):
    """The workspace keeps the previous call's table (and starts as garbage): every call still equals the reference.
    Calls alternate speculative and single-step with different steps and top_k on one request state."""
    batch, hot, tail, max_len = 2, 64, 6, 600
    widest = max(swap_in_workspace_columns(s, k) for s, k in ((4, 40), (1, 64), (2, 48)))
    workspace = torch.full((batch, widest), -12345, dtype=I64, device=device)
    first = build(
        seed=30,
        speculative=True,
        batch=batch,
        steps=4,
        top_k=40,
        hot=hot,
        tail=tail,
        lens=[200, 150],
        max_len=max_len,
        scratch=4,
        requests=2,
        rids=[0, 1],
        device=device,
    )
    k_state, r_state = first.state, first.state.clone()
    k_dev, r_dev = first.device_buffer, first.device_buffer.clone()
    lens = [200, 150]
    for call, (speculative, steps, top_k) in enumerate(
        [(True, 4, 40), (False, 1, 64), (True, 2, 48), (True, 4, 40), (False, 1, 64)]
    ):
        scn = build(
            seed=31 + call,
            speculative=speculative,
            batch=batch,
            steps=steps,
            top_k=top_k,
            hot=hot,
            tail=tail,
            lens=lens,
            max_len=max_len,
            scratch=4,
            requests=2,
            rids=[0, 1],
            miss_rate=0.4,
            state=k_state,
            host_cache=first.host_cache,
            device_buffer=k_dev,
            device=device,
        )
        out = torch.full(scn.top_k_tokens.shape, -7, dtype=I32, device=device)
        counters = new_counters(device)
        kernels.swap_in(
            k_state,  # the single-step calls ignore its scratch rows
            top_k_tokens=scn.top_k_tokens,
            host_cache=scn.host_cache,
            device_buffer=k_dev,
            top_k_device_locs=out,
            req_pool_indices=scn.req_pool_indices,
            seq_lens=scn.seq_lens,
            num_real_reqs=None,
            workspace=workspace[:, : swap_in_workspace_columns(steps, top_k) + call],
            counters=counters,
        )
        ref = run(reference, scn, state=r_state, device_buffer=r_dev)
        assert torch.equal(out.cpu(), ref.out)
        assert torch.equal(k_state.device_buffer_tokens.cpu(), r_state.device_buffer_tokens.cpu())
        assert torch.equal(k_state.lru_slots.cpu(), r_state.lru_slots.cpu())
        assert torch.equal(k_dev.cpu().view(torch.uint8), r_dev.cpu().view(torch.uint8))
        assert torch.equal(counters.cpu(), ref.counters)
        lens = [length + steps for length in lens]


@pytest.mark.slow  # property-based: several interpreted kernel calls per example
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 10_000),
    speculative=st.booleans(),
    steps=st.integers(1, 4),
    top_k=st.sampled_from([17, 33, 64]),
    hot=st.sampled_from([64, 70, 96]),
    miss_rate=st.sampled_from([0.0, 0.3, 1.0]),
    scratch=st.integers(0, 5),
    lens=st.lists(st.integers(0, 400), min_size=1, max_size=3),
    path=st.sampled_from(list(PATHS)),
)
def test_property_many_programs_match_reference(seed, speculative, steps, top_k, hot, miss_rate, scratch, lens, path):
    from conftest import DEVICE

    with pytest.MonkeyPatch.context() as patch:  # (per example: the path must not leak into later tests)
        patch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
        _property_example(seed, speculative, steps, top_k, hot, miss_rate, scratch, lens, DEVICE)


def _property_example(seed, speculative, steps, top_k, hot, miss_rate, scratch, lens, device):
    scn = build(
        seed=seed,
        speculative=speculative,
        steps=steps,
        batch=len(lens),
        top_k=top_k,
        hot=hot,
        tail=5,
        lens=lens,
        max_len=410,
        miss_rate=miss_rate,
        dup_rate=0.2,
        scratch=scratch if speculative else 0,
        unbacked_rate=0.1,
        device=device,
    )
    assert_same(run(kernels, scn), run(reference, scn))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_top_k_zero_needs_no_workspace_and_writes_only_the_counts(speculative, path, monkeypatch, device):
    """No occurrences: the workspace has no columns and is never touched; counts are 0, the LRU order unchanged (on
    every path: one program per row then has nothing to resolve either)."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
    assert swap_in_workspace_columns(4 if speculative else 1, 0) == 0
    scn = build(
        seed=11,
        device=device,
        speculative=speculative,
        steps=3,
        batch=3,
        top_k=0,
        hot=40,
        tail=4,
        lens=[300, 20, 250],
        max_len=340,
        num_real=2,
        scratch=3 if speculative else 0,
    )
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    want = run(reference, scn)
    assert_same(kernel, want)
    assert torch.equal(kernel.lru_slots, scn.state.lru_slots.cpu())
    assert kernel.miss_count[:2].tolist() == [0, 0]
