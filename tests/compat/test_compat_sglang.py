"""kvplan.compat.sglang: SGLang's HiSparse ops and DFlash helper, called the way SGLang calls them.

Tables are laid out as SGLang's HiSparseCoordinator keeps them (per layer ``[layer_num, R, HOT + page]`` slot tables,
``[layer_num, R, HOT]`` int16 LRU, ``req_to_host_pool`` int64, ``kv_buffer[layer]`` of shape ``[rows, 1, dim]``, int64
``req_pool_indices``), the adapters are called with positional arguments in SGLang's order (and once with the
coordinator's keywords), and everything they write is compared with ``kvplan.reference`` exactly.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from helpers.plans import assert_same_plan_rows

import kvplan.reference as ref
from kvplan import HotBufferState, MissPlan
from kvplan.compat import sglang as sg

I16, I32, I64 = torch.int16, torch.int32, torch.int64
HOT, PAGE, TOP_K, MAX_LEN, DIM, LAYERS, R = 8, 2, 4, 40, 8, 2, 3  # bf16 x 8 = 16-byte rows
ITEM = DIM * 2


class Coordinator:
    """The swap-in state of SGLang's HiSparseCoordinator, at small shapes, filled with a controlled history."""

    def __init__(self, device: torch.device, seq_lens: list[int], *, seed: int = 0, scratch: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = HOT + PAGE
        self.device = device
        self.req_device_buffer_tokens = torch.full((LAYERS, R, width), -1, dtype=I32)
        self.req_device_buffer_token_locs = torch.arange(R * width, dtype=I32).view(1, R, width).repeat(LAYERS, 1, 1)
        self.lru_slots = torch.arange(HOT, dtype=I16).view(1, 1, -1).repeat(LAYERS, R, 1).contiguous()
        self.req_to_host_pool = torch.full((R, MAX_LEN + PAGE), -1, dtype=I64)
        for rid, length in enumerate(seq_lens):
            self.req_to_host_pool[rid, :length] = rid * MAX_LEN + torch.arange(length)
            for layer in range(LAYERS):
                if length <= HOT:
                    self.req_device_buffer_tokens[layer, rid, :length] = torch.arange(length, dtype=I32)
                else:
                    held = torch.randperm(length - 1, generator=gen)[: HOT - 2].to(I32)  # two empty hot slots
                    self.req_device_buffer_tokens[layer, rid, : HOT - 2] = held
                    self.lru_slots[layer, rid] = torch.randperm(HOT, generator=gen).to(I16)
                    self.req_device_buffer_tokens[layer, rid, HOT] = length - 1  # newest token in slot HOT
        self.scratch_locs = None
        device_rows = R * width
        if scratch:
            self.scratch_locs = (device_rows + torch.arange(R * scratch, dtype=I32)).view(R, scratch)
            device_rows += R * scratch
        host = torch.randn((LAYERS, R * MAX_LEN, 1, DIM), generator=gen).to(torch.bfloat16)
        dev = torch.randn((LAYERS, device_rows, 1, DIM), generator=gen).to(torch.bfloat16)
        for name in ("req_device_buffer_tokens", "req_device_buffer_token_locs", "lru_slots", "req_to_host_pool"):
            setattr(self, name, getattr(self, name).to(device))
        if self.scratch_locs is not None:
            self.scratch_locs = self.scratch_locs.to(device)
        self.host_kv_buffer = host.to(device)  # mem_pool_host.kv_buffer ([layer_num, rows, 1, dim])
        self.device_kv_buffer = dev.to(device)  # mem_pool_device.kv_buffer
        self.top_k_device_locs_buffer = torch.full((R, TOP_K), -1, dtype=I32, device=device)
        self.num_real_reqs = torch.zeros(1, dtype=I32, device=device)

    def clone(self) -> Coordinator:
        twin = object.__new__(Coordinator)
        for name, value in vars(self).items():
            setattr(twin, name, value.clone() if isinstance(value, torch.Tensor) else value)
        return twin

    def state(self, layer: int) -> HotBufferState:
        """This coordinator's tables of ``layer`` as kvplan's state record (views: the reference mutates them)."""
        return HotBufferState(
            device_buffer_tokens=self.req_device_buffer_tokens[layer],
            device_buffer_locs=self.req_device_buffer_token_locs[layer],
            lru_slots=self.lru_slots[layer],
            host_cache_locs=self.req_to_host_pool,
            scratch_locs=self.scratch_locs,
        )

    def reference_swap_in(self, layer: int, top_k: torch.Tensor, rids: torch.Tensor, lens: torch.Tensor, plan=None):
        out = torch.full(top_k.shape, -1, dtype=I32, device=self.device)
        ref.swap_in(
            self.state(layer),
            top_k,
            out,
            rids,
            lens,
            self.host_kv_buffer[layer].view(-1, DIM),
            self.device_kv_buffer[layer].view(-1, DIM),
            num_real_reqs=self.num_real_reqs,
            plan=None if plan is None else MissPlan(*plan),
            check_newest=False,  # the adapter's rule (SGLang's): the newest token at slot HOT whatever it holds
        )
        return out


def _top_k(device, lens: list[int], seed: int = 1, steps: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (TOP_K,) if steps is None else (steps, TOP_K)
    rows = [torch.randint(0, max(length, 1), shape, generator=gen) for length in lens]
    return torch.stack(rows).to(I32).to(device)


def _assert_state_equal(a: Coordinator, b: Coordinator) -> None:
    for name in ("req_device_buffer_tokens", "lru_slots", "device_kv_buffer", "host_kv_buffer"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _plan(batch: int, columns: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.full((batch, columns), -7, dtype=I64, device=device),
        torch.full((batch, columns), -7, dtype=I32, device=device),
        torch.full((batch,), -7, dtype=I32, device=device),
    )


def _plans_equal(a, b) -> None:
    assert torch.equal(a[2], b[2])
    assert_same_plan_rows(a[0], a[1], b[0], b[1], a[2])


# ---------------------------------------------------------------------------------------------------------------------
# Signatures


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


POS, KW, EMPTY = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty


def test_signatures_are_sglangs():
    names = (
        "top_k_tokens device_buffer_tokens host_cache_locs device_buffer_locs host_cache device_buffer "
        "top_k_device_locs req_pool_indices seq_lens lru_slots item_size_bytes num_top_k hot_buffer_size"
    ).split()
    single = [(n, POS, EMPTY) for n in names] + [
        ("page_size", POS, 1),
        ("block_size", POS, 256),
        ("num_real_reqs", POS, None),
        ("miss_src", POS, None),
        ("miss_dst", POS, None),
        ("miss_count", POS, None),
        ("skip_io", POS, False),
    ]
    assert _params(sg.load_cache_to_device_buffer_mla) == single
    copy = [(n, POS, EMPTY) for n in "miss_src miss_dst miss_count num_real_reqs host_cache device_buffer".split()]
    copy += [("item_size_bytes", POS, EMPTY), ("num_blocks", POS, 4), ("block_size", POS, 1024)]
    copy += [("is_dsv4_layout", POS, False), ("skip_io", POS, False)]
    assert _params(sg.copy_cache_planned_mla) == copy
    spec = [(n, KW, EMPTY) for n in names[:9]] + [("state", KW, EMPTY), ("num_real_reqs", KW, EMPTY)]
    spec += [("miss_src", KW, None), ("miss_dst", KW, None), ("miss_count", KW, None)]
    assert _params(sg.load_cache_to_device_buffer_spec_mla) == spec
    helper = [(n, POS, EMPTY) for n in "self layers rotary_emb num_kv_heads head_dim device".split()]
    assert _params(sg.FusedKVMaterializeHelper.__init__) == helper + [
        ("max_position_hint", POS, None),
        ("check_positions", KW, False),  # kvplan's opt-in (docs/sglang.md §6), keyword-only after SGLang's
    ]
    assert _params(sg.FusedKVMaterializeHelper.materialize) == [
        (n, POS, EMPTY) for n in ("self", "ctx_hidden", "positions", "write_layer_kv")
    ] + [("max_position_hint", KW, None)]


# ---------------------------------------------------------------------------------------------------------------------
# Single-step swap-in


def _swap_in_positional(c: Coordinator, layer: int, top_k, rids, lens, *plan, **extra) -> torch.Tensor:
    out = c.top_k_device_locs_buffer[: top_k.shape[0]]
    sg.load_cache_to_device_buffer_mla(
        top_k,
        c.req_device_buffer_tokens[layer],
        c.req_to_host_pool,
        c.req_device_buffer_token_locs[layer],
        c.host_kv_buffer[layer],
        c.device_kv_buffer[layer],
        out,
        rids,
        lens,
        c.lru_slots[layer],
        ITEM,
        TOP_K,
        HOT,
        1,
        960,  # the coordinator's swap_in_block_size
        c.num_real_reqs,
        *plan,
        **extra,
    )
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_single_step_positional_matches_reference(device, batch):
    lens = [30, 5, 21][:batch]
    c = Coordinator(device, [30, 5, 21])
    c.num_real_reqs.fill_(batch)
    twin = c.clone()
    rids = torch.tensor([0, 1, 2][:batch], dtype=I64, device=device)
    seq = torch.tensor(lens, dtype=I64, device=device)
    for step in range(3):  # a short decode loop on both layers: state carries over
        top_k = _top_k(device, lens, seed=step)
        for layer in range(LAYERS):
            got = _swap_in_positional(c, layer, top_k, rids, seq).clone()
            rplan = _plan(batch, TOP_K, device)
            want = twin.reference_swap_in(layer, top_k, rids, seq, plan=rplan)
            assert torch.equal(got, want)
            _assert_state_equal(c, twin)
            plan = sg.last_miss_plan(device)  # no plan buffers given: the per-device pool's
            _plans_equal((plan.src, plan.dst, plan.count), rplan)


def test_single_step_keeps_sglangs_newest_token_rule(device):
    """SGLang serves the newest token from slot HOT's row whatever req_device_buffer_tokens says there; the adapter
    keeps that (docs/sglang.md), where the native API's default resolves it to -1 (docs/kernels.md §2 rule 11)."""
    c = Coordinator(device, [30, 5, 21])
    c.num_real_reqs.fill_(3)
    c.req_device_buffer_tokens[:, 0, HOT] = 28  # request 0's slot HOT still names the token before its newest, 29
    twin, native = c.clone(), c.clone()
    rids = torch.tensor([0, 1, 2], dtype=I64, device=device)
    seq = torch.tensor([30, 5, 21], dtype=I64, device=device)
    top_k = _top_k(device, [30, 5, 21], seed=4)
    top_k[0, 0] = 29
    got = _swap_in_positional(c, 0, top_k, rids, seq).clone()
    assert torch.equal(got, twin.reference_swap_in(0, top_k, rids, seq))
    assert int(got[0, 0]) == int(c.req_device_buffer_token_locs[0, 0, HOT])
    out = torch.full(top_k.shape, -1, dtype=I32, device=device)
    ref.swap_in(native.state(0), top_k, out, rids, seq, native.host_kv_buffer[0].view(-1, DIM),
                native.device_kv_buffer[0].view(-1, DIM), num_real_reqs=native.num_real_reqs)  # fmt: skip
    assert int(out[0, 0]) == -1  # the native rule


def test_single_step_coordinator_keywords_with_plan_buffers(device):
    """The prefetching coordinator's call: keywords, its own plan buffers, padded batch (num_real_reqs < batch)."""
    c = Coordinator(device, [30, 25, 12])
    c.num_real_reqs.fill_(2)
    twin = c.clone()
    rids = torch.tensor([2, 0, 1], dtype=I64, device=device)
    seq = torch.tensor([12, 30, 25], dtype=I32, device=device)
    top_k = _top_k(device, [12, 30, 25], seed=4)
    plan, rplan = _plan(3, TOP_K, device), _plan(3, TOP_K, device)
    out = c.top_k_device_locs_buffer[:3]
    sg.load_cache_to_device_buffer_mla(
        top_k_tokens=top_k,
        device_buffer_tokens=c.req_device_buffer_tokens[1],
        host_cache_locs=c.req_to_host_pool,
        device_buffer_locs=c.req_device_buffer_token_locs[1],
        host_cache=c.host_kv_buffer[1],
        device_buffer=c.device_kv_buffer[1],
        top_k_device_locs=out,
        req_pool_indices=rids,
        seq_lens=seq,
        lru_slots=c.lru_slots[1],
        item_size_bytes=ITEM,
        num_top_k=TOP_K,
        hot_buffer_size=HOT,
        page_size=1,
        block_size=960,
        num_real_reqs=c.num_real_reqs,
        miss_src=plan[0],
        miss_dst=plan[1],
        miss_count=plan[2],
    )
    want = twin.reference_swap_in(1, top_k, rids, seq, plan=rplan)
    assert torch.equal(out, want)
    assert bool((out[2] == -1).all())  # padding row
    assert int(plan[2][2]) == -7  # a padding row's miss_count is never written (as SGLang's kernel)
    _assert_state_equal(c, twin)
    _plans_equal((plan[0][:2], plan[1][:2], plan[2][:2]), (rplan[0][:2], rplan[1][:2], rplan[2][:2]))


def test_num_real_reqs_none_and_wider_top_k_buffer(device):
    """``num_real_reqs=None``: the whole batch is real; a top-k buffer wider than num_top_k: its first columns."""
    c = Coordinator(device, [30, 30, 30], seed=3)
    twin = c.clone()
    rids = torch.tensor([1], dtype=I64, device=device)
    seq = torch.tensor([30], dtype=I64, device=device)
    wide = torch.cat([_top_k(device, [30]), torch.full((1, 3), 29, dtype=I32, device=device)], dim=1)
    out = torch.full((1, TOP_K + 3), -5, dtype=I32, device=device)
    sg.load_cache_to_device_buffer_mla(
        wide, c.req_device_buffer_tokens[0], c.req_to_host_pool, c.req_device_buffer_token_locs[0],
        c.host_kv_buffer[0], c.device_kv_buffer[0], out, rids, seq, c.lru_slots[0], ITEM, TOP_K, HOT,
    )  # fmt: skip
    twin.num_real_reqs = None
    want = twin.reference_swap_in(0, wide[:, :TOP_K].contiguous(), rids, seq)
    assert torch.equal(out[:, :TOP_K], want)
    assert bool((out[:, TOP_K:] == -5).all())
    _assert_state_equal(c, twin)


def test_skip_io_plans_without_moving_bytes(device):
    c = Coordinator(device, [30, 28, 26], seed=5)
    c.num_real_reqs.fill_(3)
    twin = c.clone()
    rids = torch.tensor([0, 1, 2], dtype=I64, device=device)
    seq = torch.tensor([30, 28, 26], dtype=I64, device=device)
    top_k = _top_k(device, [30, 28, 26], seed=6)
    plan, rplan = _plan(3, TOP_K, device), _plan(3, TOP_K, device)
    got = _swap_in_positional(c, 0, top_k, rids, seq, *plan, skip_io=True)
    want = twin.reference_swap_in(0, top_k, rids, seq, plan=rplan)
    assert torch.equal(got, want)
    assert torch.equal(c.req_device_buffer_tokens, twin.req_device_buffer_tokens)
    assert torch.equal(c.lru_slots, twin.lru_slots)
    _plans_equal(plan, rplan)
    assert int(plan[2].sum()) > 0
    untouched = Coordinator(device, [30, 28, 26], seed=5)
    assert torch.equal(c.device_kv_buffer, untouched.device_kv_buffer)  # no byte moved
    # replaying the plan then repairs the rows: the device buffer becomes the reference's
    sg.copy_cache_planned_mla(*plan, c.num_real_reqs, c.host_kv_buffer[0], c.device_kv_buffer[0], ITEM)
    assert torch.equal(c.device_kv_buffer, twin.device_kv_buffer)
    before = c.device_kv_buffer.clone()
    sg.copy_cache_planned_mla(*plan, c.num_real_reqs, c.host_kv_buffer[1], c.device_kv_buffer[1], ITEM, skip_io=True)
    assert torch.equal(c.device_kv_buffer, before)


def test_steady_path_reuses_the_pool(device):
    c = Coordinator(device, [30, 5, 21])
    c.num_real_reqs.fill_(3)
    rids = torch.tensor([0, 1, 2], dtype=I64, device=device)
    seq = torch.tensor([30, 5, 21], dtype=I64, device=device)
    _swap_in_positional(c, 0, _top_k(device, [30, 5, 21]), rids, seq)
    pool = sg.pool_for(device)
    generation, plan = pool.generation, sg.last_miss_plan(device)
    for step in range(2):
        _swap_in_positional(c, 1, _top_k(device, [30, 5, 21], seed=10 + step), rids, seq)
        again = sg.last_miss_plan(device)
        assert pool.generation == generation
        assert again.src.data_ptr() == plan.src.data_ptr() and again.count.data_ptr() == plan.count.data_ptr()
    assert pool.stats().counters.misses_copied > 0


# ---------------------------------------------------------------------------------------------------------------------
# Plan replay for shared-index layers


def _anchor_then_replay(device, *, stream: torch.cuda.Stream | None):
    c = Coordinator(device, [30, 26, 7], seed=8)
    c.num_real_reqs.fill_(3)
    twin = c.clone()
    rids = torch.tensor([0, 1, 2], dtype=I64, device=device)
    seq = torch.tensor([30, 26, 7], dtype=I64, device=device)
    top_k = _top_k(device, [30, 26, 7], seed=9)
    miss_src, miss_dst, miss_count = _plan(R, TOP_K, device)  # the coordinator's [max_reqs, top_k] plan buffers
    _swap_in_positional(c, 0, top_k, rids, seq, miss_src[:3], miss_dst[:3], miss_count[:3])
    args = (miss_src[:3], miss_dst[:3], miss_count[:3], c.num_real_reqs, c.host_kv_buffer[1], c.device_kv_buffer[1])
    if stream is None:
        sg.copy_cache_planned_mla(*args, ITEM, 4)
    else:  # the coordinator's side-stream replay
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sg.copy_cache_planned_mla(*args, ITEM, 4)
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.current_stream().wait_event(done)
    rplan = _plan(3, TOP_K, device)
    twin.reference_swap_in(0, top_k, rids, seq, plan=rplan)
    ref.copy_planned(
        MissPlan(*rplan), twin.host_kv_buffer[1].view(-1, DIM), twin.device_kv_buffer[1].view(-1, DIM),
        num_real_reqs=twin.num_real_reqs,
    )  # fmt: skip
    if stream is not None:
        torch.cuda.synchronize()
    _assert_state_equal(c, twin)
    assert int(rplan[2].sum()) > 0
    assert pool_counter(device, "replayed_rows") > 0


def pool_counter(device, name: str) -> int:
    return getattr(sg.pool_for(device).stats().counters, name)


def test_replay_on_current_stream(device):
    _anchor_then_replay(device, stream=None)


@pytest.mark.gpu
def test_replay_on_side_stream(device):
    _anchor_then_replay(device, stream=torch.cuda.Stream())


# ---------------------------------------------------------------------------------------------------------------------
# Speculative swap-in


def _spec_setup(device, steps: int):
    c = Coordinator(device, [30, 24, 6], seed=11, scratch=6)
    lens = [30, 24, 6]
    for rid, length in enumerate(lens):  # drafts after the newest token in the tail
        if length > HOT:
            c.req_device_buffer_tokens[:, rid, HOT + 1] = length
    c.req_to_host_pool[0, :31] = torch.arange(31, device=device)  # the first request's draft token is backed
    c.num_real_reqs.fill_(2)  # row 2 is graph padding
    rids = torch.tensor([0, 1, 2], dtype=I64, device=device)
    seq = torch.tensor([length + s for length in lens for s in range(steps)], dtype=I32, device=device)
    top_k = _top_k(device, lens, seed=12, steps=steps)
    return c, rids, seq, top_k


@pytest.mark.parametrize("with_plan", [False, True])
def test_spec_matches_reference(device, with_plan):
    c, rids, seq, top_k = _spec_setup(device, 3)
    twin = c.clone()
    out = torch.full((3, 3, TOP_K), -9, dtype=I32, device=device)
    plan = _plan(3, 3 * TOP_K, device) if with_plan else (None, None, None)
    sg.load_cache_to_device_buffer_spec_mla(
        top_k_tokens=top_k,
        device_buffer_tokens=c.req_device_buffer_tokens[0],
        host_cache_locs=c.req_to_host_pool,
        device_buffer_locs=c.req_device_buffer_token_locs[0],
        host_cache=c.host_kv_buffer[0],
        device_buffer=c.device_kv_buffer[0],
        top_k_device_locs=out,
        req_pool_indices=rids,
        seq_lens=seq,
        state=sg.SpecState(c.lru_slots[0], c.scratch_locs),
        num_real_reqs=c.num_real_reqs,
        miss_src=plan[0],
        miss_dst=plan[1],
        miss_count=plan[2],
    )
    want, rplan = torch.full_like(out, -9), _plan(3, 3 * TOP_K, device)
    ref.swap_in(
        twin.state(0), top_k, want, rids, seq, twin.host_kv_buffer[0].view(-1, DIM),
        twin.device_kv_buffer[0].view(-1, DIM), num_real_reqs=twin.num_real_reqs, plan=MissPlan(*rplan),
    )  # fmt: skip
    assert torch.equal(out, want)
    assert bool((out[2] == 0).all())  # padding rows output 0, as SGLang's speculative kernel
    _assert_state_equal(c, twin)
    got_plan = plan if with_plan else (lambda p: (p.src, p.dst, p.count))(sg.last_miss_plan(device))
    _plans_equal(got_plan, rplan)
    assert int(rplan[2].sum()) > 0


class SGLangSpecState(NamedTuple):  # SGLang's HiSparseSpecState fields
    cache_index: torch.Tensor
    cache_policy: torch.Tensor
    scratch_locs: torch.Tensor
    scratch_state: torch.Tensor


def _spec_call(c, rids, seq, top_k, state, host=None):
    sg.load_cache_to_device_buffer_spec_mla(
        top_k_tokens=top_k,
        device_buffer_tokens=c.req_device_buffer_tokens[0],
        host_cache_locs=c.req_to_host_pool,
        device_buffer_locs=c.req_device_buffer_token_locs[0],
        host_cache=c.host_kv_buffer[0] if host is None else host,
        device_buffer=c.device_kv_buffer[0] if host is None else host,
        top_k_device_locs=torch.empty(top_k.shape, dtype=I32, device=top_k.device),
        req_pool_indices=rids,
        seq_lens=seq,
        state=state,
        num_real_reqs=c.num_real_reqs,
    )


@pytest.mark.parametrize("steps", [1, 5])
def test_spec_refuses_steps_outside_2_to_4(device, steps):
    c, rids, seq, top_k = _spec_setup(device, steps)
    twin = c.clone()
    with pytest.raises(ValueError, match=f"^HiSparse speculative swap requires 2-4 steps, got {steps}\\.$"):
        _spec_call(c, rids, seq, top_k, sg.SpecState(c.lru_slots[0], c.scratch_locs))
    _assert_state_equal(c, twin)


def test_spec_refuses_rows_not_multiple_of_16_bytes(device):
    c, rids, seq, top_k = _spec_setup(device, 2)
    odd = torch.zeros((R * MAX_LEN, 1, 12), dtype=torch.bfloat16, device=device)  # 24-byte rows
    with pytest.raises(ValueError, match="multiple of 16 bytes, got 24"):
        _spec_call(c, rids, seq, top_k, sg.SpecState(c.lru_slots[0], c.scratch_locs), host=odd)


def test_spec_refuses_sglang_clock_state(device):
    c, rids, seq, top_k = _spec_setup(device, 2)
    z = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match="HiSparseSpecState .*deterministic union-LRU"):
        _spec_call(c, rids, seq, top_k, SGLangSpecState(z, z, c.scratch_locs, z))
    with pytest.raises(TypeError, match="SpecState"):
        _spec_call(c, rids, seq, top_k, object())


def test_spec_partial_plan_message(device):
    c, rids, seq, top_k = _spec_setup(device, 2)
    with pytest.raises(ValueError, match="^miss_src, miss_dst, and miss_count must be provided together"):
        sg.load_cache_to_device_buffer_spec_mla(
            top_k_tokens=top_k, device_buffer_tokens=c.req_device_buffer_tokens[0], host_cache_locs=c.req_to_host_pool,
            device_buffer_locs=c.req_device_buffer_token_locs[0], host_cache=c.host_kv_buffer[0],
            device_buffer=c.device_kv_buffer[0], top_k_device_locs=torch.empty_like(top_k), req_pool_indices=rids,
            seq_lens=seq, state=sg.SpecState(c.lru_slots[0]), num_real_reqs=c.num_real_reqs,
            miss_src=torch.zeros((3, 2 * TOP_K), dtype=I64, device=device),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Single-step and copy refusals


def _refused(device, exc, match, **override):
    c = Coordinator(device, [30, 5, 21])
    c.num_real_reqs.fill_(1)
    kwargs = dict(
        top_k_tokens=_top_k(device, [30]),
        device_buffer_tokens=c.req_device_buffer_tokens[0],
        host_cache_locs=c.req_to_host_pool,
        device_buffer_locs=c.req_device_buffer_token_locs[0],
        host_cache=c.host_kv_buffer[0],
        device_buffer=c.device_kv_buffer[0],
        top_k_device_locs=c.top_k_device_locs_buffer[:1],
        req_pool_indices=torch.zeros(1, dtype=I64, device=device),
        seq_lens=torch.tensor([30], device=device),
        lru_slots=c.lru_slots[0],
        item_size_bytes=ITEM,
        num_top_k=TOP_K,
        hot_buffer_size=HOT,
        num_real_reqs=c.num_real_reqs,
    )
    kwargs.update(override)
    twin = c.clone()
    with pytest.raises(exc, match=match):
        sg.load_cache_to_device_buffer_mla(**kwargs)
    _assert_state_equal(c, twin)


def test_single_step_refusals(device):
    _refused(device, ValueError, r"^page_size=2 is not supported: kvplan's swap-in works on token rows", page_size=2)
    _refused(device, AssertionError, r"^hot_buffer_size \(8\) must be >= num_top_k \(9\)$", num_top_k=9)
    _refused(device, ValueError, "lru_slots must have shape .*hot_buffer_size=6", hot_buffer_size=6)
    _refused(device, ValueError, "host_cache rows hold 16 bytes but item_size_bytes=32", item_size_bytes=32)
    _refused(
        device,
        ValueError,
        r"top_k_tokens must have shape \[batch, >= num_top_k=4\]",
        top_k_tokens=torch.zeros((1, 3), dtype=I32, device=device),
    )
    plan = _plan(1, TOP_K, device)
    _refused(device, ValueError, "^miss_src, miss_dst, and miss_count must be provided together", miss_src=plan[0])
    strided = torch.zeros((R * MAX_LEN, 2, DIM // 2), dtype=torch.bfloat16, device=device).transpose(1, 2)
    _refused(device, ValueError, "cannot be viewed as \\[rows, item\\] without a copy", host_cache=strided)


def test_copy_refusals(device):
    plan = _plan(1, TOP_K, device)
    host = torch.zeros((4, 1, DIM), dtype=torch.bfloat16, device=device)
    nr = torch.ones(1, dtype=I32, device=device)
    with pytest.raises(NotImplementedError, match="is_dsv4_layout=True"):
        sg.copy_cache_planned_mla(*plan, nr, host, host.clone(), ITEM, 4, 1024, True)
    with pytest.raises(ValueError, match="item_size_bytes=8"):
        sg.copy_cache_planned_mla(*plan, nr, host, host.clone(), 8)


# ---------------------------------------------------------------------------------------------------------------------
# DFlash fused KV helper

H, D, HIDDEN, NL = 2, 8, 16, 3


class Rope:
    def __init__(self, max_pos: int, *, rotary_dim: int = D, neox: bool = True, device="cpu") -> None:
        self.rotary_dim, self.is_neox_style, self.device = rotary_dim, neox, device
        self.cos_sin_cache = self._cache(max_pos)
        self.ensured: list[int] = []

    def _cache(self, max_pos: int) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.device)

    def _ensure_cos_sin_cache_length(self, max_position: int) -> None:
        self.ensured.append(max_position)
        if max_position >= self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self._cache(2 * (max_position + 1))


def _layers(device, rope, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = 3 * D, H * D
    layers = []
    for _ in range(NL):
        attn = SimpleNamespace(
            num_kv_heads=H, head_dim=D, q_size=q_size, kv_size=kv_size, rotary_emb=rope,
            qkv_proj=SimpleNamespace(
                weight=torch.randn((q_size + 2 * kv_size, HIDDEN), generator=gen).to(device, dtype)),
            k_norm=SimpleNamespace(weight=(1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype),
                                   variance_epsilon=1e-6),
        )  # fmt: skip
        layers.append(SimpleNamespace(self_attn=attn))
    return layers


def _reference_kv(layers, rope, ctx_hidden, positions):
    kv = torch.stack([ctx_hidden @ lyr.self_attn.qkv_proj.weight[3 * D : 3 * D + 2 * H * D].t() for lyr in layers], 1)
    norms = torch.stack([lyr.self_attn.k_norm.weight for lyr in layers])
    eps = torch.full((NL,), 1e-6, device=ctx_hidden.device)
    return ref.materialize(
        kv, norms, eps, rope.cos_sin_cache, positions, num_kv_heads=H, head_dim=D, rotary_dim=rope.rotary_dim
    )


@pytest.mark.parametrize("hint", [None, 64])
def test_fused_kv_helper_matches_reference(device, hint):
    rope = Rope(64, device=device)
    layers = _layers(device, rope)
    helper = sg.FusedKVMaterializeHelper(layers, rope, H, D, device, hint)
    ctx_hidden = torch.randn((5, HIDDEN), device=device)
    positions = torch.tensor([[3, 9, 0, 17, 42]], device=device)  # 2-D: reshaped, as SGLang
    written = {}
    result = helper.materialize(ctx_hidden, positions, lambda i, k, v: written.update({i: (k.clone(), v.clone())}))
    assert result is None
    k_ref, v_ref = _reference_kv(layers, rope, ctx_hidden, positions.reshape(-1))
    assert sorted(written) == list(range(NL))
    for i in range(NL):
        assert written[i][0].shape == (5, H, D)
        torch.testing.assert_close(written[i][0], k_ref[i], atol=1e-4, rtol=1e-4)
        assert torch.equal(written[i][1], v_ref[i])


def test_fused_kv_helper_empty_context_and_checks(device):
    rope = Rope(16, device=device)
    helper = sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device)
    calls = []
    helper.materialize(torch.empty((0, HIDDEN), device=device), torch.empty(0, device=device), calls.append)
    assert calls == []
    with pytest.raises(ValueError, match="^positions must match ctx_hidden token count .*positions=2, total_ctx=3\\.$"):
        helper.materialize(torch.zeros((3, HIDDEN), device=device), torch.zeros(2, dtype=I64, device=device), print)
    # the RoPE cache grows through _ensure_cos_sin_cache_length, as SGLang's helper lets it
    ctx_hidden = torch.randn((2, HIDDEN), device=device)
    positions = torch.tensor([5, 40], device=device)
    got = {}
    helper.materialize(ctx_hidden, positions, lambda i, k, v: got.update({i: k.clone()}))
    assert rope.ensured[-1] == 40 and rope.cos_sin_cache.shape[0] > 40
    k_ref, _ = _reference_kv(helper_layers(helper), rope, ctx_hidden, positions)
    torch.testing.assert_close(got[0], k_ref[0], atol=1e-4, rtol=1e-4)
    # a per-call hint: no host check, the cache is grown to the hint, the result is the same
    again = {}
    helper.materialize(ctx_hidden, positions, lambda i, k, v: again.update({i: k.clone()}), max_position_hint=100)
    assert rope.ensured[-1] == 99 and torch.equal(again[0], got[0])
    rope.ensured.clear()
    rope._ensure_cos_sin_cache_length = None  # a rotary embedding that cannot grow: SGLang's error
    with pytest.raises(RuntimeError, match="^RoPE cos/sin cache is too short .*max_position=500"):
        helper.materialize(ctx_hidden, torch.tensor([1, 500], device=device), print)


def helper_layers(helper):
    return [
        SimpleNamespace(self_attn=SimpleNamespace(
            qkv_proj=SimpleNamespace(weight=torch.cat((torch.zeros(3 * D, HIDDEN, device=w.device), w))),
            k_norm=SimpleNamespace(weight=n),
        ))
        for w, n in zip(helper._kv_weights, helper.k_norm_weights)
    ]  # fmt: skip


def test_fused_kv_helper_refusals(device):
    with pytest.raises(NotImplementedError, match="^Only neox-style RoPE is supported\\.$"):
        rope = Rope(16, neox=False, device=device)
        sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device)
    rope = Rope(16, device=device)
    layers = _layers(device, rope)
    layers[1].self_attn.num_kv_heads = 4
    with pytest.raises(ValueError, match="^num_kv_heads mismatch across layers .*expected 2, got 4 at layer 1\\.$"):
        sg.FusedKVMaterializeHelper(layers, rope, H, D, device)
    with pytest.raises(ValueError, match="^Invalid fused KV rotary/head dim pair"):
        sg.FusedKVMaterializeHelper(_layers(device, rope), SimpleNamespace(rotary_dim=2 * D), H, D, device)
    odd = Rope(16, rotary_dim=D - 1, device=device)  # an odd rotary_dim: the engines' text too
    with pytest.raises(
        ValueError, match=rf"^Invalid fused KV rotary/head dim pair: rotary_dim={D - 1}, head_dim={D}\.$"
    ):
        sg.FusedKVMaterializeHelper(_layers(device, odd), odd, H, D, device)
