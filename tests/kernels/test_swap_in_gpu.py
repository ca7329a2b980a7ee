"""Swap-in kernels on the GPU at production shapes: exact equality with the reference, pinned zero-copy host cache,
host rows past 2^31 bytes, a decode loop, and CUDA-graph capture without allocation.

A production resolve kernel takes ~50 s to compile on the H200 machine, so the tests share two compiled variants
(int64 indices without ``num_real_reqs``; int32 indices with it), and the benchmark uses the second.
"""

from __future__ import annotations

import pytest
import torch
from helpers.swap_in_scenarios import assert_same, build, decode_loop, pinned_random_rows, run

from kvplan import MissPlan, kernels, reference
from kvplan.counters import new_counters
from kvplan.workspace import swap_in_workspace_columns

pytestmark = pytest.mark.gpu

K, HOT, TAIL, STEPS, MAX_LEN = 2048, 4096, 64, 4, 1 << 20
ITEM = 576  # bytes: 288 bf16
DEV = torch.device("cuda")
HOST_ROWS = (1 << 31) // ITEM + 200_000  # the last rows start past 2^31 bytes
I32, I64 = torch.int32, torch.int64
PROD = dict(top_k=K, hot=HOT, tail=TAIL, max_len=MAX_LEN, item_bytes=ITEM, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def host_cache():
    """One pinned host cache of ~2.1 GiB shared by the tests (read zero-copy by the kernels)."""
    cache = pinned_random_rows(HOST_ROWS, ITEM, torch.bfloat16, seed=0, device=DEV)
    assert cache.is_pinned() and cache.shape[0] * ITEM > 2**31
    return cache


def _lens(batch, seed):
    """Long contexts up to MAX_LEN (the longest row first)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(HOT + 1, MAX_LEN - STEPS, (batch,), generator=gen).tolist()
    lens[0] = MAX_LEN - STEPS
    return lens


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_spec_production_shapes_equal_reference(batch, host_cache):
    lens = _lens(batch, batch)
    if batch > 2:
        lens[1] = HOT // 4  # a short row
    scn = build(
        seed=batch,
        speculative=True,
        batch=batch,
        steps=STEPS,
        lens=lens,
        requests=batch + 3,
        scratch=64,
        miss_rate=0.35,
        unbacked_rate=0.01,
        index_dtype=I32 if batch == 8 else I64,
        num_real=batch - 1 if batch == 8 else None,
        host_cache=host_cache,
        device=DEV,
        **PROD,
    )
    assert scn.host_cache.device.type == "cpu" and scn.host_cache.is_pinned()
    ref = run(reference, scn)
    assert ref.counters[0] > 0 and (ref.miss_src[0, : ref.miss_count[0]] * ITEM >= 2**31).any()
    assert_same(run(kernels, scn, workspace=batch == 64), ref)


@pytest.mark.parametrize("batch", [1, 64])
def test_single_step_production_shapes_equal_reference(batch, host_cache):
    scn = build(
        seed=10 + batch,
        speculative=False,
        batch=batch,
        lens=_lens(batch, 10 + batch),
        miss_rate=0.2,
        index_dtype=I64 if batch == 1 else I32,
        host_cache=host_cache,
        device=DEV,
        **PROD,
    )
    assert_same(run(kernels, scn), run(reference, scn))


def test_spec_all_misses_scratch_and_overflow_at_production_shapes(host_cache):
    scn = build(
        seed=3,
        speculative=True,
        batch=4,
        steps=STEPS,
        lens=_lens(4, 3),
        scratch=512,
        miss_rate=1.0,
        dup_rate=0.0,
        invalid_rate=0.0,
        newest_rate=0.0,
        host_cache=host_cache,
        device=DEV,
        **PROD,
    )
    ref = run(reference, scn)
    assert ref.counters[3] > 0  # overflow beyond HOT evictables + 512 scratch rows
    assert_same(run(kernels, scn), ref)


def test_host_rows_past_2_31_bytes_copied_completely(host_cache):
    rows = torch.tensor([[HOST_ROWS - 1, (1 << 31) // ITEM + 1, 5, HOST_ROWS - 77]], device=DEV)
    dev = torch.zeros(8, ITEM // 2, dtype=torch.bfloat16, device=DEV)
    counters = new_counters(DEV)
    plan = MissPlan(rows, torch.tensor([[7, 0, 3, 5]], dtype=I32, device=DEV), torch.tensor([4], dtype=I32, device=DEV))
    kernels.copy_planned(
        plan, host_cache, dev, num_real_reqs=torch.tensor([1], dtype=I32, device=DEV), counters=counters
    )
    for src, dst in zip(rows[0].tolist(), [7, 0, 3, 5]):
        assert torch.equal(dev[dst].view(torch.int16).cpu(), host_cache[src].view(torch.int16))
    assert counters[4:].tolist() == [4, 4 * ITEM]


def test_decode_loop_at_production_shapes(host_cache):
    common = dict(
        batch=8,
        top_k=K,
        hot=HOT,
        tail=TAIL,
        max_len=300_000,
        requests=10,
        rids=[9, 0, 3, 5, 1, 8, 2, 7],
        scratch=64,
        steps=STEPS,
        item_bytes=ITEM,
        dtype=torch.bfloat16,
    )
    decode_loop(DEV, common, lens=[5000 + 20_000 * i for i in range(8)], calls=6, host_cache=host_cache)


def test_cuda_graph_replays_with_new_inputs_and_allocates_nothing(host_cache):
    """Capture a speculative swap_in (plan + workspace given) and a plan replay; replay with fresh top-k each time."""
    batch, requests = 4, 6
    lens = [50_000, 200_000, 9_000, 700_000]
    first = build(
        seed=21,
        speculative=True,
        batch=batch,
        steps=STEPS,
        lens=lens,
        requests=requests,
        rids=[5, 0, 2, 3],
        scratch=64,
        index_dtype=I32,
        host_cache=host_cache,
        device=DEV,
        **PROD,
    )
    state, ref_state = first.state, first.state.clone()
    dev, ref_dev = first.device_buffer, first.device_buffer.clone()
    layer2, ref_layer2 = torch.zeros_like(dev), torch.zeros_like(dev)
    n = STEPS * K
    static = dict(
        top_k_tokens=first.top_k_tokens.clone(),
        top_k_device_locs=torch.zeros_like(first.top_k_tokens),
        seq_lens=first.seq_lens.clone(),
        req_pool_indices=first.req_pool_indices,
        num_real_reqs=torch.tensor([batch], dtype=I32, device=DEV),
    )
    plan = MissPlan(
        torch.zeros(batch, n, dtype=I64, device=DEV),
        torch.zeros(batch, n, dtype=I32, device=DEV),
        torch.zeros(batch, dtype=I32, device=DEV),
    )
    workspace = torch.zeros(batch, swap_in_workspace_columns(STEPS, K), dtype=I64, device=DEV)
    counters = new_counters(DEV)

    def step():
        kernels.swap_in(
            state, **static, host_cache=host_cache, device_buffer=dev, plan=plan, workspace=workspace, counters=counters
        )
        kernels.copy_planned(plan, host_cache, layer2, num_real_reqs=static["num_real_reqs"], counters=counters)

    # warm up (compiles), undo what it wrote, then capture
    saved, saved_dev = state.clone(), dev.clone()
    step()
    state.device_buffer_tokens.copy_(saved.device_buffer_tokens)
    state.lru_slots.copy_(saved.lru_slots)
    dev.copy_(saved_dev)
    layer2.zero_()
    torch.cuda.synchronize()
    # A capture registers the RNG's graph-safe state (2 x 512 B); torch frees it when the last registered graph
    # is destroyed, so keep this first graph alive while measuring.
    first_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first_graph):
        pass
    # Count what Triton's launcher itself requests (a kernel may declare per-launch global scratch): kvplan's own
    # code must add nothing on top of that.
    from triton.runtime import _allocation

    inner, requested = _allocation._allocator.get(), []

    def counting_allocator(size, alignment, stream):
        requested.append(size)
        return inner(size, alignment, stream)

    token = _allocation._allocator.set(counting_allocator)
    graph = torch.cuda.CUDAGraph()
    allocated = torch.cuda.memory_allocated()
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        _allocation._allocator.reset(token)
    triton_scratch = sum(-(-size // 512) * 512 for size in requested)  # the caching allocator's 512 B blocks
    grown = torch.cuda.memory_allocated() - allocated
    assert grown == triton_scratch, f"capture allocated {grown} B; Triton launcher scratch requests: {requested}"

    for call in range(3):
        lens = [length + STEPS for length in lens] if call else lens
        for rid, length in zip([5, 0, 2, 3], lens):
            draft = torch.arange(length - 1, length + STEPS - 1)
            state.write_tail(rid, draft)
            ref_state.write_tail(rid, draft)
        scn = build(
            seed=300 + call,
            speculative=True,
            batch=batch,
            steps=STEPS,
            lens=lens,
            requests=requests,
            rids=[5, 0, 2, 3],
            scratch=64,
            index_dtype=I32,
            state=state,
            host_cache=host_cache,
            device_buffer=dev,
            device=DEV,
            **PROD,
        )
        static["top_k_tokens"].copy_(scn.top_k_tokens)
        static["seq_lens"].copy_(scn.seq_lens)
        graph.replay()
        r = run(reference, scn, state=ref_state, device_buffer=ref_dev)
        reference.copy_planned(
            MissPlan(r.miss_src.to(DEV), r.miss_dst.to(DEV), r.miss_count.to(DEV)),
            host_cache,
            ref_layer2,
            num_real_reqs=None,
        )
        torch.cuda.synchronize()
        assert torch.equal(static["top_k_device_locs"].cpu(), r.out)
        assert torch.equal(state.device_buffer_tokens.cpu(), r.device_buffer_tokens)
        assert torch.equal(state.lru_slots.cpu(), r.lru_slots)
        assert torch.equal(plan.count.cpu(), r.miss_count)
        assert torch.equal(dev.view(torch.int16), ref_dev.view(torch.int16))
        assert torch.equal(layer2.view(torch.int16), ref_layer2.view(torch.int16))
        assert int(r.miss_count.sum()) > 0


@pytest.mark.parametrize("batch", [8, 64])
def test_identical_requests_read_each_host_row_once_at_production_shapes(batch, host_cache):
    """SGLang's benchmark rows: every request on the same tokens and host rows (their own device rows), on the split
    resolve (batch 8) and one program per row (batch 64). The call equals the reference; its record names one reader
    per distinct host row; a replay given the workspace equals the reference too."""
    from kvplan.workspace import ROW_WORDS, SHARED

    scn = build(seed=40 + batch, speculative=True, batch=batch, steps=STEPS, lens=[MAX_LEN - STEPS] * batch,
                requests=batch, scratch=64, miss_rate=0.1, dup_rate=0.05, host_cache=host_cache, device=DEV,
                **PROD)  # fmt: skip
    state, rids = scn.state, scn.req_pool_indices.tolist()
    for rid in rids[1:]:
        state.host_cache_locs[rid] = state.host_cache_locs[rids[0]]
        state.device_buffer_tokens[rid] = state.device_buffer_tokens[rids[0]]
        state.lru_slots[rid] = state.lru_slots[rids[0]]
    scn.top_k_tokens[:] = scn.top_k_tokens[0].clone()
    ref = run(reference, scn)
    assert_same(run(kernels, scn, workspace=True), ref)

    k_state, dev = scn.state.clone(), scn.device_buffer.clone()
    plan = MissPlan.allocate(batch, STEPS * K, DEV)
    ws = torch.zeros(batch, swap_in_workspace_columns(STEPS, K), dtype=I64, device=DEV)
    kernels.swap_in(k_state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens), scn.req_pool_indices,
                    scn.seq_lens, host_cache, dev, plan=plan, workspace=ws)  # fmt: skip
    words, count = ws.view(I32).cpu(), plan.count.cpu()
    readers = sum(int((words[b, ROW_WORDS : ROW_WORDS + int(count[b])] < 0).sum()) for b in range(batch))
    distinct = torch.cat([plan.src[b, : int(count[b])] for b in range(batch)]).unique().numel()
    assert readers == distinct and int(words[:, SHARED].sum()) == int(count.sum()) - distinct > 0
    layer, ref_layer = torch.zeros_like(dev), torch.zeros_like(dev)
    reference.copy_planned(plan, host_cache, ref_layer)
    kernels.copy_planned(plan, host_cache, layer, workspace=ws)
    assert torch.equal(layer.view(torch.int16), ref_layer.view(torch.int16))
