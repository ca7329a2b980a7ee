"""The on-chip resolve (kvplan/kernels/onchip) and the launch planner that picks it.

On the CPU: the planner's decisions (which resolve, plan and copy, and why), the forcing switch, and the build —
NVRTC compiles ``resolve.cu`` for sm_90 and sm_100 without a GPU, with no spills. The Triton twin of the on-chip
resolve is the Triton resolve every other kernel test compares with the reference on the CPU. On a GPU (marker
``gpu``): the on-chip resolve forced, compared with the reference exactly across shapes and edge cases (padding rows,
every token a miss, every token a hit, duplicates, invalid tokens, unbacked rows, broken LRU entries, overflow,
garbage workspaces, guarded buffers, a decode loop with a workspace shared across shapes).
"""

from __future__ import annotations

import importlib.util

import attrs
import pytest
import torch
from helpers.swap_in_scenarios import Guard, assert_same, build, decode_loop, run

from kvplan import kernels, reference
from kvplan.calls import swap_in_call
from kvplan.kernels import hisparse, planner
from kvplan.kernels.onchip.compiler import OnChipConfig, compile_resolve, shared_bytes
from kvplan.kernels.plan_copy.launch import launch_copy
from kvplan.plan import MissPlan
from kvplan.runtime.launch_replay import UNRECORDED
from kvplan.state import HotBufferState
from kvplan.validate.arguments import check_swap_in
from kvplan.workspace import FORMAT, format_word, swap_in_workspace_columns, swap_in_workspace_regions

I32, I64 = torch.int32, torch.int64
HAS_NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def _call(batch, *, speculative=True, device="cpu", steps=2, top_k=8, hot=16, tail=4):
    state = HotBufferState.allocate(batch + 1, hot, tail, 64, device=device)
    shape = (batch, steps, top_k) if speculative else (batch, top_k)
    tokens = torch.zeros(shape, dtype=I32, device=device)
    lens = torch.full((batch * (steps if speculative else 1),), 40, dtype=I64, device=device)
    call = swap_in_call(
        speculative, state, tokens, torch.empty_like(tokens), torch.arange(batch, device=device), lens,
        torch.zeros(64 * (batch + 1), 16, device=device), torch.zeros(state.device_rows, 16, device=device), None,
        None, None, None,
    )  # fmt: skip
    return call, check_swap_in(call, launch=False)


@pytest.mark.parametrize("batch", [1, 4, 5, 96])
@pytest.mark.parametrize("speculative", [True, False])
def test_planner_on_cpu_picks_a_triton_resolve_and_says_why(batch, speculative):
    call, dims = _call(batch, speculative=speculative)
    plan = planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 2 * 8)
    assert plan.resolve == ("per_row" if batch >= planner.PER_ROW_MIN_BATCH else "split")
    assert plan.sorted == (batch > planner.FLAT_COPY_MAX_BATCH) and plan.copy == ("ordered" if plan.sorted else "flat")
    assert plan.apart == (plan.sorted and not speculative)
    assert "not a CUDA device" in plan.why and plan.resolve in str(plan)
    assert not plan.row_ready and "per row" not in str(plan)  # only the on-chip resolve publishes rows
    assert not plan.copy_writes_format and not plan.format_launch  # the share launch writes row 0's format word
    assert plan.share_launch == (plan.sorted or plan.resolve == "per_row")


def test_planner_launch_fields_override_the_batch_rules():
    call, dims = _call(2)
    plan = planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(sorted_plan=True, per_row=True), 16)
    assert (plan.resolve, plan.sorted, plan.shared) == ("per_row", True, True)
    unshared = planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(sorted_plan=True, shared_rows=False), 16)
    assert not unshared.shared


def test_forcing_onchip_where_it_cannot_run_names_why(monkeypatch):
    call, dims = _call(1)
    with pytest.raises(planner.OnChipUnavailable, match="forced .* not a CUDA device"):
        planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(resolve="onchip"), 16)
    monkeypatch.setenv(planner.RESOLVE_ENV, "onchip")
    with pytest.raises(planner.OnChipUnavailable, match="KVPLAN_RESOLVE"):
        planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 16)
    monkeypatch.setenv(planner.RESOLVE_ENV, "triton")
    assert planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 16).why == "triton forced"


def test_dense_rows_are_the_ones_whose_element_i_sits_at_offset_i():
    t = torch.zeros(4, 3, 8, dtype=I32)
    assert planner._dense_rows(t) and planner._dense_rows(t[:, 0]) and planner._dense_rows(t[1:3])
    assert planner._dense_rows(torch.zeros(4, 1, 9)[:, :, :8])  # one step: its row stride never multiplies
    assert not planner._dense_rows(t[:, :, :5])  # steps 8 apart, 5 wide
    assert not planner._dense_rows(t[..., ::2]) and not planner._dense_rows(t.transpose(1, 2))


def test_a_misspelt_resolve_is_refused(monkeypatch):
    call, dims = _call(1)
    monkeypatch.setenv(planner.RESOLVE_ENV, "cuda")
    with pytest.raises(ValueError, match="KVPLAN_RESOLVE must be one of auto, onchip, triton, got 'cuda'"):
        planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 16)
    with pytest.raises(ValueError, match="ResolveLaunch.resolve must be one of"):
        planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(resolve="fast"), 16)


def test_forced_onchip_through_the_kernels_on_cpu_raises_before_writing(monkeypatch):
    scn = build(seed=1, speculative=True, batch=2, steps=2, top_k=8, hot=16, tail=4, lens=[30, 40], max_len=64)
    before = scn.state.clone()
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", hisparse.ResolveLaunch(resolve="onchip"))
    with pytest.raises(planner.OnChipUnavailable):
        run(kernels, scn, state=scn.state)
    assert torch.equal(scn.state.lru_slots, before.lru_slots)
    assert torch.equal(scn.state.device_buffer_tokens, before.device_buffer_tokens)


def _config(steps, top_k, hot, tail, speculative, sort):
    return OnChipConfig(
        steps=steps, top_k=top_k, hot=hot, tail=tail, speculative=speculative, sorted=sort,
        apart=sort and not speculative, epochs=sort, rpi64=False, seq64=False, has_num_real=True,
        has_counters=True, layout=swap_in_workspace_regions(steps, top_k), dense_tokens=True, dense_out=True,
        ready=not sort, share=sort,
    )  # fmt: skip


def test_a_sorted_build_cannot_publish_rows_to_the_copy():
    # a sorted plan is written by the launches after the resolve: no block can say its row is ready
    with pytest.raises(ValueError, match="OnChipConfig.ready needs a plan in miss order"):
        attrs.evolve(_config(1, 2048, 4096, 64, False, True), ready=True)
    assert _config(1, 2048, 4096, 64, False, False).ready


def test_the_copy_waits_on_ready_words_only_where_rows_carry_them():
    # ready words live in the swap-in's workspace rows (marked): a copy given none, or a shared-rows record or a work
    # counter to follow, cannot wait per row
    plan, host, dev = MissPlan.allocate(2, 8, "cpu"), torch.zeros(16, 4), torch.zeros(16, 4)
    common = dict(num_real_reqs=None, counters=None, counter_base=0, recorder=UNRECORDED, ready_at=3)
    with pytest.raises(ValueError, match="ready_at needs marked"):
        launch_copy(plan, host, dev, **common)
    words = torch.zeros(2, 64, dtype=I32)
    with pytest.raises(ValueError, match="ready_at needs marked"):
        launch_copy(plan, host, dev, **common, marked=words, dispatch=torch.zeros(2, dtype=I32))


# the shapes engines run (docs/kernels.md §7): speculative S=4 K=2048 HOT=4096/8192, single-step K=2048
PRODUCTION = [(4, 2048, 4096, 64, True, True), (4, 2048, 8192, 64, True, False), (1, 2048, 4096, 64, False, True)]


@pytest.mark.skipif(not HAS_NVRTC, reason="cuda-bindings and nvidia-cuda-nvrtc not installed")
@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
@pytest.mark.parametrize("shape", PRODUCTION, ids=["spec-4096-sorted", "spec-8192-flat", "single-sorted-apart"])
def test_resolve_compiles_without_a_gpu_and_spills_nothing(arch, shape):
    config = _config(*shape)
    build_ = compile_resolve(config, arch)
    assert build_.cubin[:4] == b"\x7fELF" and build_.arch == arch
    assert 0 < build_.registers <= 64, build_.log  # 1024 threads a block: at most 64 registers each
    assert build_.spill_bytes == 0, build_.log
    assert shared_bytes(config) <= 227 * 1024  # what one Hopper/Blackwell block may opt into


def test_shared_memory_grows_with_the_row_and_large_rows_do_not_fit():
    small, large = _config(1, 2048, 4096, 64, False, False), _config(4, 2048, 4096, 64, True, True)
    assert shared_bytes(small) < shared_bytes(large) <= 227 * 1024
    assert not _config(8, 4096, 4096, 64, True, True).fits()  # S*K past the int16 occurrence entries


# ---------------------------------------------------------------------------------------------------------------------
# On a GPU: the on-chip resolve forced, exactly the reference

gpu = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture
def onchip(monkeypatch):
    monkeypatch.setenv(planner.RESOLVE_ENV, "onchip")


CASES = {
    "mixed": dict(),
    "all-miss": dict(miss_rate=1.0, dup_rate=0.0, invalid_rate=0.0, newest_rate=0.0),
    "all-hit": dict(miss_rate=0.0, dup_rate=0.3, invalid_rate=0.0, newest_rate=0.0, empty_rate=0.0),
    "duplicates": dict(dup_rate=0.6),
    "invalid": dict(invalid_rate=0.5, newest_rate=0.2),
    "unbacked": dict(unbacked_rate=0.3, miss_rate=0.7),
    "empty-slots": dict(empty_rate=0.9, miss_rate=0.8),
    "tail-in-hot": dict(tail_in_hot=True, dead_tail=True),
}


@gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch", [1, 3, 6, 40])
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_equals_reference(onchip, case, batch, speculative):
    hot, top_k, steps = 64, 32, 3
    gen = torch.Generator().manual_seed(batch)
    lens = (torch.randint(hot + 1, 900, (batch,), generator=gen)).tolist()
    if batch > 2:
        lens[1] = hot // 2  # a short row
    scn = build(
        seed=7 * batch + len(case), speculative=speculative, batch=batch, steps=steps, top_k=top_k, hot=hot, tail=6,
        lens=lens, max_len=1024, requests=batch + 2, scratch=5 if case != "all-miss" else 2,
        num_real=batch - 1 if batch in (3, 40) else None, index_dtype=I32 if batch % 2 else I64, device=DEV,
        item_bytes=24, **CASES[case],
    )  # fmt: skip
    ref = run(reference, scn)
    assert_same(run(kernels, scn, workspace=batch > 4), ref)


@gpu
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_touches_nothing_outside_its_buffers(onchip, speculative):
    scn = build(seed=5, speculative=speculative, batch=6, steps=2, top_k=16, hot=32, tail=4, lens=[40, 90, 20, 33, 70,
                200], max_len=256, scratch=3, device=DEV, unbacked_rate=0.1)  # fmt: skip
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    assert_same(kernel, run(reference, scn))


@gpu
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_strided_token_and_output_rows(onchip, speculative):
    # top-k tokens read through a view with a last-dim stride of 2, outputs written into padded rows: the kernel's
    # strided addressing (dense rows take 32-bit offsets), both the same as the reference
    scn = build(seed=6, speculative=speculative, batch=6, steps=3, top_k=16, hot=32, tail=4, lens=[40, 90, 20, 33,
                70, 200], max_len=256, scratch=3, device=DEV, dup_rate=0.3)  # fmt: skip
    wide = torch.full((*scn.top_k_tokens.shape[:-1], 2 * scn.top_k_tokens.shape[-1]), -5, dtype=I32, device=DEV)
    wide[..., ::2] = scn.top_k_tokens
    strided = attrs.evolve(scn, top_k_tokens=wide[..., ::2])
    assert not planner._dense_rows(strided.top_k_tokens)
    guard = Guard()
    kernel = run(kernels, strided, guard=guard, workspace=True)
    guard.check()
    assert_same(kernel, run(reference, scn))


@gpu
def test_onchip_broken_lru_entries_and_foreign_request_ids(onchip):
    scn = build(seed=9, speculative=True, batch=5, steps=2, top_k=16, hot=32, tail=4, lens=[40, 90, 60, 33, 70],
                max_len=256, requests=7, scratch=2, device=DEV, miss_rate=0.9)  # fmt: skip
    lru = scn.state.lru_slots
    lru[scn.req_pool_indices[0], 3] = 77  # outside [0, HOT): an empty slot backed by row -1
    lru[scn.req_pool_indices[1], 0] = -4
    scn.req_pool_indices[4] = 99  # outside the pool: a padding row
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))


@gpu
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_at_production_shapes(onchip, speculative):
    batch = 8
    scn = build(seed=11, speculative=speculative, batch=batch, steps=4, top_k=2048, hot=4096, tail=64,
                lens=[5000 + 3000 * b for b in range(batch)], max_len=40_000, requests=batch + 1, scratch=64,
                miss_rate=0.35, item_bytes=576, dtype=torch.bfloat16, num_real=batch - 1, device=DEV)  # fmt: skip
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))


@gpu
def test_onchip_decode_loop_with_a_workspace_shared_across_shapes(onchip):
    common = dict(batch=6, top_k=16, hot=32, tail=6, max_len=4000, requests=8, rids=[7, 0, 3, 5, 1, 2], scratch=4,
                  steps=3)  # fmt: skip
    storage = torch.full((1 << 20,), -3, dtype=I64, device=DEV)
    decode_loop(DEV, common, lens=[100 + 300 * i for i in range(6)], calls=9, workspace_storage=storage)
    decode_loop(DEV, {**common, "batch": 2, "rids": [7, 0]}, lens=[100, 400], calls=6)  # the flat path


@gpu
def test_onchip_and_triton_resolves_agree_and_the_planner_says_which_ran(monkeypatch):
    scn = build(seed=21, speculative=True, batch=8, steps=2, top_k=32, hot=64, tail=4, lens=[100 + 90 * b for b in
                range(8)], max_len=1024, scratch=4, device=DEV)  # fmt: skip
    call = swap_in_call(True, scn.state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens), scn.req_pool_indices,
                        scn.seq_lens, scn.host_cache, scn.device_buffer, None, None, None, None)  # fmt: skip
    dims = check_swap_in(call)
    assert planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 64).resolve == "onchip"
    monkeypatch.setenv(planner.RESOLVE_ENV, "triton")
    assert planner.plan_swap_in(call, dims, hisparse.ResolveLaunch(), 64).resolve == "split"
    triton_result = run(kernels, scn, workspace=True)
    monkeypatch.setenv(planner.RESOLVE_ENV, "onchip")
    assert_same(run(kernels, scn, workspace=True), triton_result)


@gpu
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_blocks_claim_host_rows_without_a_share_launch(onchip, speculative):
    # identical requests (every request's misses on the same host rows), above the flat batches: each block claims its
    # entries' host rows as it writes its sorted plan row, the copy then reads each distinct host row once and writes
    # row 0's format word; without the swap-in's own copy (a benchmark's resolve alone) a launch of one program does
    batch, steps = 6, 3 if speculative else 1
    scn = build(seed=3, speculative=speculative, batch=batch, steps=steps, top_k=24, hot=40, tail=4, lens=[200] * batch,
                max_len=300, scratch=6, miss_rate=0.6, invalid_rate=0.0, newest_rate=0.0, device=DEV)  # fmt: skip
    first = int(scn.req_pool_indices[0])
    for rid in scn.req_pool_indices.tolist():
        scn.state.host_cache_locs[rid] = scn.state.host_cache_locs[first]
        scn.state.device_buffer_tokens[rid] = scn.state.device_buffer_tokens[first]
        scn.state.lru_slots[rid] = scn.state.lru_slots[first]
    scn.top_k_tokens[:] = scn.top_k_tokens[0].clone()
    call = swap_in_call(speculative, scn.state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens),
                        scn.req_pool_indices, scn.seq_lens, scn.host_cache, scn.device_buffer, scn.num_real_reqs,
                        None, None, None)  # fmt: skip
    dims = check_swap_in(call)
    chosen = planner.plan_swap_in(call, dims, hisparse.RESOLVE_LAUNCH, scn.occurrences)
    assert chosen.onchip.share and chosen.copy_writes_format and not chosen.share_launch and not chosen.format_launch
    assert "shared on chip" in str(chosen)
    alone = planner.plan_swap_in(call, dims, hisparse.RESOLVE_LAUNCH, scn.occurrences, copies=False)
    assert alone.onchip.share and alone.format_launch and not alone.copy_writes_format and not alone.share_launch
    workspace = torch.full((batch, swap_in_workspace_columns(steps, 24)), -3, dtype=I64, device=DEV)
    ref = run(reference, scn)
    assert int(ref.miss_count.sum()) > 2 * int(ref.miss_count[0])  # several requests miss the same host rows
    assert_same(run(kernels, scn, workspace=workspace), ref)
    assert int(workspace.view(I32)[:, 0].sum()) > 0  # entries share host rows (the rows' SHARED words)
    words = workspace.view(I32)
    assert int(words[0, FORMAT]) == format_word(swap_in_workspace_regions(steps, 24), words.stride(0))
    assert_same(run(kernels, scn, workspace=workspace), ref)  # a second call on the same tables, under new epochs
    words[0, FORMAT] = -1  # the resolve alone (no copy): its launch of one program writes row 0's format word
    scratch_call = swap_in_call(speculative, scn.state.clone(), scn.top_k_tokens, torch.empty_like(scn.top_k_tokens),
                                scn.req_pool_indices, scn.seq_lens, scn.host_cache, scn.device_buffer.clone(),
                                scn.num_real_reqs, None, workspace, None)  # fmt: skip
    hisparse.run_swap_in(scratch_call, copy=False)
    assert int(words[0, FORMAT]) == format_word(swap_in_workspace_regions(steps, 24), words.stride(0))


@gpu
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_onchip_copy_per_row_and_after_the_resolve_both_equal_the_reference(onchip, monkeypatch, batch, speculative):
    # a plan in miss order: the copy takes each row as its block publishes it (its ready word), or (row_ready=False)
    # after the whole resolve; production sizes, padding and short rows, calls in a row on one workspace (a copy
    # that read a row before it was published would copy an earlier call's rows)
    lens = [5000 + 7000 * b for b in range(batch)]
    if batch > 1:
        lens[1] = 3000  # a short row (HOT 4096): no misses
    workspace = torch.full((batch, swap_in_workspace_columns(4 if speculative else 1, 2048)), -3, dtype=I64, device=DEV)
    for seed in range(5):
        scn = build(seed=40 + seed, speculative=speculative, batch=batch, steps=4 if speculative else 1, top_k=2048,
                    hot=4096, tail=64, lens=lens, max_len=40_000, requests=batch + 1, scratch=64,
                    miss_rate=0.5 + 0.1 * seed, item_bytes=576, dtype=torch.bfloat16,
                    num_real=batch - 1 if batch == 4 else None, device=DEV)  # fmt: skip
        ref = run(reference, scn)
        for row_ready in (True, False):
            launch = hisparse.ResolveLaunch(row_ready=row_ready)
            monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", launch)
            if seed == 0:
                call = swap_in_call(speculative, scn.state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens),
                                    scn.req_pool_indices, scn.seq_lens, scn.host_cache, scn.device_buffer,
                                    scn.num_real_reqs, None, None, None)  # fmt: skip
                chosen = planner.plan_swap_in(call, check_swap_in(call), launch, scn.occurrences)
                assert (chosen.resolve, chosen.copy, chosen.row_ready) == ("onchip", "flat", row_ready)
                assert ("copy=flat per row" in str(chosen)) == row_ready
            assert_same(run(kernels, scn, workspace=workspace), ref)
