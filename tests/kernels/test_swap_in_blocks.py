"""The block-selection swap-in of K and V rows (docs/kernels.md §2a): ``kvplan.kernels.swap_in_blocks`` (and through
the ops and the pool) equals ``kvplan.reference.swap_in_blocks`` exactly: outputs, hot-buffer state, plan, counters, K
and V device rows; its plan replays into another layer's K and V caches; its refusals write nothing.

CPU tests run the Triton resolve under the interpreter; the tests marked ``gpu`` (production shapes, the on-chip
resolve and the Triton resolve forced, guarded buffers) run on a GPU
(``pytest -m gpu tests/kernels/test_swap_in_blocks.py``).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.block_scenarios import assert_same_blocks, build_blocks, run_blocks
from helpers.swap_in_scenarios import Guard, small_launch

from kvplan import MissPlan, PlanBufferPool, PoolConfig, kernels, reference
from kvplan.counters import new_counters
from kvplan.kernels import hisparse, planner

I32, I64 = torch.int32, torch.int64

CASES = {
    "mixed": dict(),
    "all-miss": dict(none_rate=0.0, past_rate=0.0, dup_rate=0.0, newest_rate=0.0, empty_rate=1.0),
    "all-hit": dict(none_rate=0.0, past_rate=0.0, newest_rate=0.0, hit_all=True),
    "duplicates": dict(dup_rate=0.6),
    "no-blocks": dict(none_rate=0.7),
    "past-length": dict(past_rate=0.5),
    "newest": dict(newest_rate=0.6),
}


def _scenario(case: str, *, seed: int, batch: int, device, block: int = 4, num_blocks: int = 6, hot: int = 32,
              lens=None, max_len: int = 320, **extra):  # fmt: skip
    params = dict(CASES[case])
    hit_all = params.pop("hit_all", False)
    gen = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(hot + 1, 300, (batch,), generator=gen).tolist()
        if batch > 2:
            lens[1] = hot // 2  # a short row
            lens[2] = 3  # a row shorter than one block
    scn = build_blocks(seed=seed, batch=batch, num_blocks=num_blocks, block=block, hot=hot, tail=2, lens=lens,
                       max_len=max_len, device=device, **params, **extra)  # fmt: skip
    if hit_all:  # every selected token already held by a hot slot (or the newest token)
        _select_held(scn)
    return scn


def _select_held(scn) -> None:
    """Long rows select only blocks whose every token is held by a hot slot: the slots are re-filled with them."""
    state, block = scn.base.state, scn.block
    for b in range(scn.batch):
        rid, length = int(scn.base.req_pool_indices[b]), int(scn.base.seq_lens[b])
        if length <= state.hot:
            continue
        fits = min(scn.top_k_blocks.shape[1], state.hot // block, (length - 1) // block)
        chosen = torch.randperm((length - 1) // block)[:fits]
        held = (chosen[:, None] * block + torch.arange(block)).reshape(-1)
        state.device_buffer_tokens[rid, : held.numel()] = held.to(state.device_buffer_tokens)
        state.device_buffer_tokens[rid, held.numel() : state.hot] = -1
        row = torch.full((scn.top_k_blocks.shape[1],), -1, dtype=I32)
        row[:fits] = chosen.to(I32)
        scn.top_k_blocks[b] = row.to(scn.top_k_blocks.device)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch", [3, 6])
def test_blocks_equal_reference(device, case, batch):
    scn = _scenario(case, seed=batch * 11 + len(case), batch=batch, device=device, num_real=batch - 1)
    ref = run_blocks(reference, scn)
    assert_same_blocks(run_blocks(kernels, scn, workspace=batch > 4), ref)
    if case == "all-miss":
        long_rows = [b for b in range(batch - 1) if int(scn.base.seq_lens[b]) > 32]
        assert all(int(ref.k.miss_count[b]) > 0 for b in long_rows) and int(ref.k.counters[2]) == 0
    if case == "all-hit":
        assert int(ref.k.counters[0]) == 0 and int(ref.k.counters[2]) > 0


@pytest.mark.parametrize("path", ["flat", "sorted", "per_row"])
def test_blocks_on_each_triton_path_with_rows_over_many_programs(device, path, monkeypatch):
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
    scn = _scenario("mixed", seed=3, batch=5, device=device, num_blocks=24, block=4, hot=128,
                    lens=[400, 90, 129, 300, 1000], max_len=1100)  # fmt: skip
    guard = Guard()
    kernel = run_blocks(kernels, scn, guard=guard, workspace=True)
    guard.check()
    assert_same_blocks(kernel, run_blocks(reference, scn))


@pytest.mark.parametrize("block", [1, 3, 8])
def test_block_sizes_that_do_not_divide_the_length(device, block):
    scn = _scenario("newest", seed=block, batch=4, device=device, block=block, num_blocks=4, lens=[77, 31, 45, 200])
    assert_same_blocks(run_blocks(kernels, scn), run_blocks(reference, scn))


def test_blocks_overlapping_the_newest_token_resolve_it_to_slot_hot_and_mask_what_follows(device):
    # row 0: L = 50, blocks of 8: block 6 holds tokens 48 (a miss or hit) and 49 (the newest: slot HOT), 50-55 invalid
    scn = _scenario("mixed", seed=5, batch=1, device=device, block=8, num_blocks=2, hot=16, lens=[50])
    scn.top_k_blocks[0] = torch.tensor([6, -1], dtype=I32)
    ref = run_blocks(reference, scn)
    state = scn.base.state
    rid = int(scn.base.req_pool_indices[0])
    out = ref.k.out[0].tolist()
    assert out[1] == int(state.device_buffer_locs[rid, state.hot])  # token 49, the newest
    assert out[2:] == [-1] * 14  # tokens 50-55 past the length, then block -1
    assert_same_blocks(run_blocks(kernels, scn), ref)


def test_short_rows_have_no_cut_off_and_padding_rows_write_minus_one(device):
    # a short row (L <= HOT) serves every valid token of every block from its slot, whatever its position
    scn = _scenario("mixed", seed=8, batch=3, device=device, block=4, num_blocks=4, hot=32, lens=[10, 20, 40],
                    num_real=2)  # fmt: skip
    scn.top_k_blocks[:] = torch.tensor([[2, 1, 0, 5], [4, 3, 2, 1], [0, 1, 2, 3]], dtype=I32)
    ref = run_blocks(reference, scn)
    locs = scn.base.state.device_buffer_locs[int(scn.base.req_pool_indices[0])].cpu()
    assert ref.k.out[0].tolist() == [*locs[8:10].tolist(), -1, -1, *locs[4:8].tolist(), *locs[0:4].tolist(), -1, -1,
                                     -1, -1]  # fmt: skip
    assert ref.k.out[2].tolist() == [-1] * 16  # padding row (num_real_reqs = 2)
    assert int(ref.k.miss_count[2]) == -9  # untouched, as the single-step path leaves it
    assert_same_blocks(run_blocks(kernels, scn), ref)


def test_hostile_block_ids_never_touch_memory_outside_the_buffers(device):
    scn = _scenario("mixed", seed=13, batch=4, device=device, block=4, num_blocks=6, lens=[300, 100, 50, 80])
    scn.top_k_blocks[0] = torch.tensor([-6, -(2**31), 2**31 - 1, 2**29, 74, 75], dtype=I32)  # 75: past L = 300
    scn.top_k_blocks[1] = torch.tensor([2**31 // 4 - 1, 2**31 // 4, 24, 24, 24, -1], dtype=I32)
    guard = Guard()
    kernel = run_blocks(kernels, scn, guard=guard, workspace=True)
    guard.check()
    ref = run_blocks(reference, scn)
    assert_same_blocks(kernel, ref)
    assert ref.k.out[0, :16].tolist() == [-1] * 16 and ref.k.out[0, 20:].tolist() == [-1] * 4


def test_expand_blocks():
    blocks = torch.tensor([[0, -1, 2], [-7, 2**31 // 4 - 1, 2**31 // 4]], dtype=I32)
    assert reference.expand_blocks(blocks, 4).tolist() == [
        [0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11],
        [-1, -1, -1, -1, 2**31 - 4, 2**31 - 3, 2**31 - 2, 2**31 - 1, -1, -1, -1, -1],
    ]


def test_block_size_one_long_rows_equal_the_token_swap_in(device):
    scn = _scenario("mixed", seed=17, batch=3, device=device, block=1, num_blocks=12, lens=[90, 200, 60])
    blocks = run_blocks(kernels, scn)
    base = scn.base
    state, dev = base.state.clone(), base.device_buffer.clone()
    out = torch.empty(3, 12, dtype=I32, device=device)
    plan = kernels.swap_in(state, scn.top_k_blocks, out, base.req_pool_indices, base.seq_lens, base.host_cache, dev)
    assert torch.equal(out.cpu(), blocks.k.out) and torch.equal(state.lru_slots.cpu(), blocks.k.lru_slots)
    assert torch.equal(plan.count.cpu(), blocks.k.miss_count)


def test_a_decode_loop_keeps_kernel_and_reference_equal(device):
    scn = _scenario("mixed", seed=19, batch=3, device=device, block=4, num_blocks=5, lens=[100, 200, 150])
    k_state, r_state = scn.base.state, scn.base.state.clone()
    k_bufs = (scn.base.device_buffer.clone(), scn.device_buffer_v.clone())
    r_bufs = (k_bufs[0].clone(), k_bufs[1].clone())
    workspace = torch.full((3, _columns(scn)), -5, dtype=I64, device=device)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        lens = scn.base.seq_lens.clone()
        scn.top_k_blocks[:] = torch.randint(-1, int(lens.min()) // 4 + 1, scn.top_k_blocks.shape, generator=gen)
        k = run_blocks(kernels, scn, state=k_state, device_buffers=k_bufs, workspace=workspace)
        r = run_blocks(reference, scn, state=r_state, device_buffers=r_bufs)
        assert_same_blocks(k, r)
        for rid, length in zip(scn.base.req_pool_indices.tolist(), lens.tolist()):  # the engine appends a token
            for state in (k_state, r_state):
                state.device_buffer_tokens[rid, state.hot] = length
        scn.base.seq_lens += 1


def _columns(scn) -> int:
    from kvplan.workspace import swap_in_workspace_columns

    return swap_in_workspace_columns(1, scn.tokens)


# ---------------------------------------------------------------------------------------------------------------------
# The plan, replayed into another layer's K and V caches


def test_the_plan_replays_k_and_v_into_another_layer(device):
    scn = _scenario("mixed", seed=23, batch=4, device=device, lens=[100, 200, 150, 20])
    kernel = run_blocks(kernels, scn, workspace=True)
    plan = MissPlan(kernel.k.miss_src.to(device), kernel.k.miss_dst.to(device), kernel.k.miss_count.to(device))
    other_k = torch.randint(0, 255, scn.base.host_cache.shape, dtype=torch.uint8).to(device)
    other_v = torch.randint(0, 255, scn.base.host_cache.shape, dtype=torch.uint8).to(device)
    dev_k, dev_v = torch.zeros_like(scn.base.device_buffer), torch.zeros_like(scn.device_buffer_v)
    counters = new_counters(device)
    kernels.copy_planned(plan, other_k, dev_k, host_cache_v=other_v, device_buffer_v=dev_v, counters=counters)
    ref_k, ref_v, ref_counters = torch.zeros_like(dev_k), torch.zeros_like(dev_v), new_counters(device)
    reference.copy_planned(plan, other_k, ref_k, host_cache_v=other_v, device_buffer_v=ref_v, counters=ref_counters)
    assert torch.equal(dev_k, ref_k) and torch.equal(dev_v, ref_v) and torch.equal(counters, ref_counters)
    rows = int(plan.count.clamp(min=0).sum())
    assert rows > 0 and int(counters[4]) == rows and int(counters[5]) == rows * 2 * other_k.shape[1]


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
def test_pool_swap_in_blocks_then_replay_into_another_layer(device, check):
    scn = _scenario("mixed", seed=29, batch=3, device=device, lens=[100, 200, 150])
    base = scn.base
    pool = PlanBufferPool(device, config=PoolConfig(check=check))
    pool.ensure_capacity(batch=3, top_k=scn.tokens)
    state, dev_k, dev_v = base.state.clone(), base.device_buffer.clone(), scn.device_buffer_v.clone()
    out = torch.empty(3, scn.tokens, dtype=I32, device=device)
    plan = pool.swap_in_blocks(state, scn.top_k_blocks, out, base.req_pool_indices, base.seq_lens, base.host_cache,
                               scn.host_cache_v, dev_k, dev_v, sparse_block_size=scn.block)  # fmt: skip
    ref = run_blocks(reference, scn)
    assert torch.equal(out.cpu(), ref.k.out) and torch.equal(dev_v.cpu(), ref.device_buffer_v)
    assert torch.equal(plan.count.cpu(), ref.k.miss_count)
    layer_k, layer_v = base.host_cache.flip(0).contiguous(), scn.host_cache_v.flip(0).contiguous()
    into_k, into_v = torch.zeros_like(dev_k), torch.zeros_like(dev_v)
    pool.replay(plan, host_cache=layer_k, device_buffer=into_k, host_cache_v=layer_v, device_buffer_v=into_v)
    want_k, want_v = torch.zeros_like(into_k), torch.zeros_like(into_v)
    reference.copy_planned(plan, layer_k, want_k, host_cache_v=layer_v, device_buffer_v=want_v)
    assert torch.equal(into_k, want_k) and torch.equal(into_v, want_v) and bool(into_v.any())
    stats = pool.stats().as_dict()
    rows = int(ref.k.miss_count.clamp(min=0).sum())
    assert stats["counters.misses_copied"] == rows and stats["counters.replayed_rows"] == rows


def test_ops_swap_in_blocks_is_registered_declaring_what_it_writes():
    import kvplan.ops  # noqa: F401  (registers the ops)

    schema = torch.ops.kvplan.swap_in_blocks.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert "device_buffer_v" in written and "host_cache_v" not in written and "top_k_tokens" not in written
    schema = torch.ops.kvplan.copy_planned_kv.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"device_buffer", "device_buffer_v", "counters"}


def test_ops_swap_in_blocks_equals_the_kernel(device):
    from kvplan import ops

    scn = _scenario("mixed", seed=31, batch=3, device=device, lens=[100, 200, 150])
    assert_same_blocks(run_blocks(ops, scn), run_blocks(reference, scn))


# ---------------------------------------------------------------------------------------------------------------------
# Refusals: named, and nothing written


def _call_args(scn, device):
    base = scn.base
    return dict(
        state=base.state, top_k_blocks=scn.top_k_blocks,
        top_k_device_locs=torch.full((scn.batch, scn.tokens), -3, dtype=I32, device=device),
        req_pool_indices=base.req_pool_indices, seq_lens=base.seq_lens, host_cache_k=base.host_cache,
        host_cache_v=scn.host_cache_v, device_buffer_k=base.device_buffer, device_buffer_v=scn.device_buffer_v,
    )  # fmt: skip


REFUSALS = {
    "v-dtype": (lambda a: {"host_cache_v": a["host_cache_v"].view(torch.int8)}, ValueError,
                "host_cache_v must have host_cache's dtype"),
    "v-device-dtype": (lambda a: {"device_buffer_v": a["device_buffer_v"].to(torch.float32)}, ValueError,
                       "device_buffer_v must have device_buffer's dtype"),
    "v-rows": (lambda a: {"host_cache_v": a["host_cache_v"][:-1]}, ValueError,
               "host_cache_v must have host_cache's shape"),
    "v-missing": (lambda a: {"device_buffer_v": None}, ValueError, "must be given together"),
    "v-stride": (lambda a: {"host_cache_v": torch.zeros(a["host_cache_v"].shape[0], 32, dtype=torch.uint8,
                                                        device=a["host_cache_v"].device)[:, :16]},
                 ValueError, "host_cache_v must have host_cache's row stride"),
    "block-zero": (lambda a: {"sparse_block_size": 0}, ValueError, "sparse_block_size must be in"),
    "block-bool": (lambda a: {"sparse_block_size": True}, TypeError, "sparse_block_size must be an int"),
    "block-none": (lambda a: {"sparse_block_size": None}, TypeError, "sparse_block_size must be an int"),
    "out-shape": (lambda a: {"top_k_device_locs": a["top_k_device_locs"][:, :-1]}, ValueError,
                  "top_k_device_locs must have shape [batch, num_blocks * sparse_block_size]"),
    "blocks-rank": (lambda a: {"top_k_blocks": a["top_k_blocks"][0]}, ValueError,
                    "top_k_blocks must have shape [batch, num_blocks]"),
    "blocks-dtype": (lambda a: {"top_k_blocks": a["top_k_blocks"].long()}, ValueError, "top_k_blocks must be"),
    "hot-too-small": (lambda a: {"sparse_block_size": 64, "top_k_device_locs": torch.empty(
        a["top_k_blocks"].shape[0], a["top_k_blocks"].shape[1] * 64, dtype=I32, device=a["top_k_blocks"].device)},
        ValueError, "lru_slots must have hot >= num_blocks * sparse_block_size"),
}  # fmt: skip


@pytest.mark.parametrize("impl", ["kernels", "reference"])
@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals_name_the_argument_and_write_nothing(device, impl, name):
    scn = _scenario("mixed", seed=37, batch=3, device=device, lens=[100, 200, 150])
    args = _call_args(scn, device)
    change, error, text = REFUSALS[name]
    args.update({"sparse_block_size": scn.block, **change(args)})
    before = {key: t.clone() for key, t in args.items() if isinstance(t, torch.Tensor)}
    tables = scn.base.state.device_buffer_tokens.clone(), scn.base.state.lru_slots.clone()
    with pytest.raises(error, match=re.escape(text)):
        (kernels if impl == "kernels" else reference).swap_in_blocks(**args)
    for key, t in before.items():
        assert torch.equal(args[key], t), f"{key} written by a refused call"
    state = scn.base.state
    assert torch.equal(state.device_buffer_tokens, tables[0]) and torch.equal(state.lru_slots, tables[1])


# ---------------------------------------------------------------------------------------------------------------------
# On a GPU: production shapes, the on-chip and Triton resolves forced, pinned host caches

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("resolve", ["onchip", "triton"])
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_production_shapes_equal_reference(monkeypatch, resolve, batch):
    """MiniMax M3's selection: 16 blocks of 128 tokens, HOT 4096, K and V rows of 256 bytes (bf16), pinned caches."""
    monkeypatch.setenv(planner.RESOLVE_ENV, resolve)
    dev = torch.device("cuda")
    scn = build_blocks(seed=41 + batch, batch=batch, num_blocks=16, block=128, hot=4096, tail=1,
                       lens=[5000 + 7000 * b for b in range(batch)], max_len=64_000, item_bytes=256,
                       dtype=torch.bfloat16, num_real=max(batch - 1, 1), device=dev, index_dtype=I32)  # fmt: skip
    scn.base.host_cache = scn.base.host_cache.cpu().pin_memory()
    scn.host_cache_v = scn.host_cache_v.cpu().pin_memory()
    assert_same_blocks(run_blocks(kernels, scn, workspace=True), run_blocks(reference, scn))


@gpu
@pytest.mark.parametrize("resolve", ["onchip", "triton"])
@pytest.mark.parametrize("case", ["mixed", "all-miss", "all-hit", "duplicates", "no-blocks", "newest"])
@pytest.mark.parametrize("batch", [3, 6, 40])
def test_gpu_blocks_equal_reference(monkeypatch, resolve, case, batch):
    monkeypatch.setenv(planner.RESOLVE_ENV, resolve)
    scn = _scenario(case, seed=batch + len(case), batch=batch, device=torch.device("cuda"), num_real=batch - 1)
    assert_same_blocks(run_blocks(kernels, scn, workspace=batch > 4), run_blocks(reference, scn))


@gpu
@pytest.mark.parametrize("resolve", ["onchip", "triton"])
def test_gpu_hostile_block_ids_touch_nothing_outside_the_buffers(monkeypatch, resolve):
    monkeypatch.setenv(planner.RESOLVE_ENV, resolve)
    dev = torch.device("cuda")
    scn = _scenario("mixed", seed=43, batch=6, device=dev, block=4, num_blocks=6, lens=[300, 100, 50, 80, 33, 260])
    scn.top_k_blocks[0] = torch.tensor([-6, -(2**31), 2**31 - 1, 2**29, 74, 75], dtype=I32)
    scn.top_k_blocks[3] = torch.tensor([2**31 // 4 - 1, 2**31 // 4, 19, 19, 19, -1], dtype=I32)
    guard = Guard()
    kernel = run_blocks(kernels, scn, guard=guard, workspace=True)
    guard.check()
    assert_same_blocks(kernel, run_blocks(reference, scn))


@gpu
def test_gpu_pool_swap_in_blocks_and_replay_in_a_cuda_graph():
    dev = torch.device("cuda")
    scn = _scenario("mixed", seed=47, batch=4, device=dev, lens=[100, 200, 150, 20])
    base = scn.base
    pool = PlanBufferPool(dev)
    pool.reserve(batch=4, top_k=scn.tokens)
    pool.freeze()
    state, dev_k, dev_v = base.state.clone(), base.device_buffer.clone(), scn.device_buffer_v.clone()
    into_k, into_v = torch.zeros_like(dev_k), torch.zeros_like(dev_v)
    out = torch.empty(4, scn.tokens, dtype=I32, device=dev)

    def step():
        plan = pool.swap_in_blocks(state, scn.top_k_blocks, out, base.req_pool_indices, base.seq_lens, base.host_cache,
                                   scn.host_cache_v, dev_k, dev_v, sparse_block_size=scn.block)  # fmt: skip
        pool.replay(plan, host_cache=base.host_cache, device_buffer=into_k, host_cache_v=scn.host_cache_v,
                    device_buffer_v=into_v)  # fmt: skip

    ref_state = state.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # the eager warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    state.device_buffer_tokens.copy_(ref_state.device_buffer_tokens)
    state.lru_slots.copy_(ref_state.lru_slots)
    with torch.cuda.graph(graph):
        step()
    state.device_buffer_tokens.copy_(base.state.device_buffer_tokens)
    state.lru_slots.copy_(base.state.lru_slots)
    graph.replay()
    torch.cuda.synchronize()
    ref = run_blocks(reference, scn)
    assert torch.equal(out.cpu(), ref.k.out) and torch.equal(state.lru_slots.cpu(), ref.k.lru_slots)
    assert torch.equal(into_v[ref.k.miss_dst[ref.k.miss_dst >= 0].long()].cpu(),
                       ref.device_buffer_v[ref.k.miss_dst[ref.k.miss_dst >= 0].long()])  # fmt: skip


def test_requests_sharing_host_rows_copy_k_and_v_through_the_shared_row_copy(device, monkeypatch):
    # every request's tokens on the same host rows: above batch 4 the plan's entries share host rows, and the copy
    # reads each once from the host, the other entries (K and V) from the device row it went to
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch("sorted"))
    scn = _scenario("all-miss", seed=53, batch=6, device=device, lens=[120, 150, 90, 200, 130, 110])
    table = scn.base.state.host_cache_locs
    table[:] = table[int(scn.base.req_pool_indices[0])].clone()
    scn.top_k_blocks[:] = scn.top_k_blocks[0].clone()
    workspace = torch.full((6, _columns(scn)), -3, dtype=I64, device=device)
    kernel = run_blocks(kernels, scn, workspace=workspace)
    ref = run_blocks(reference, scn)
    assert_same_blocks(kernel, ref)
    shared = workspace.view(torch.int32)[:, 0]  # (kvplan.workspace.SHARED: entries of the row sharing a host row)
    assert int(ref.k.miss_count.clamp(min=0).sum()) > 6 and bool((shared > 0).any())
    # a replay given the swap-in's workspace (its record of shared rows) copies K and V alike
    plan = MissPlan(kernel.k.miss_src.to(device), kernel.k.miss_dst.to(device), kernel.k.miss_count.to(device))
    into_k, into_v = torch.zeros_like(scn.base.device_buffer), torch.zeros_like(scn.device_buffer_v)
    kernels.copy_planned(plan, scn.base.host_cache, into_k, host_cache_v=scn.host_cache_v, device_buffer_v=into_v,
                         workspace=workspace)  # fmt: skip
    want_k, want_v = torch.zeros_like(into_k), torch.zeros_like(into_v)
    reference.copy_planned(plan, scn.base.host_cache, want_k, host_cache_v=scn.host_cache_v, device_buffer_v=want_v)
    assert torch.equal(into_k, want_k) and torch.equal(into_v, want_v)
