"""HotBufferState: the §1 tables, their layout, per-request helpers and construction checks."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers.plans import assert_same_plan_rows

from kvplan import MissPlan, PlanBufferPool, reference
from kvplan.counters import OVERFLOW, new_counters, read_counters
from kvplan.reference import swap_in
from kvplan.state import HotBufferState

TABLES = ("device_buffer_tokens", "device_buffer_locs", "lru_slots", "host_cache_locs", "scratch_locs")


def tables(state: HotBufferState) -> dict[str, torch.Tensor | None]:
    """The state's five tables by field name (what HotBufferState(...) takes)."""
    assert [f.name for f in attrs.fields(HotBufferState)] == list(TABLES)
    return {name: getattr(state, name) for name in TABLES}


def same_tables(a: HotBufferState, b: HotBufferState) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(tables(a).values(), tables(b).values())
    )


def test_allocate_layout_and_dtypes():
    s = HotBufferState.allocate(2, 3, 2, 10, scratch=2)
    assert (s.num_reqs, s.hot, s.tail, s.width, s.max_len, s.scratch) == (2, 3, 2, 5, 10, 2)
    assert s.device_buffer_tokens.dtype == torch.int32 and s.device_buffer_locs.dtype == torch.int32
    assert s.lru_slots.dtype == torch.int16 and s.host_cache_locs.dtype == torch.int64
    assert s.device_buffer_locs.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # slot j of request r: r*W + j
    assert s.scratch_locs.tolist() == [[10, 11], [12, 13]]  # after all slots: R*W + r*C + c
    assert s.device_rows == 14
    assert s.device_buffer_tokens.eq(-1).all() and s.host_cache_locs.eq(-1).all()
    assert s.lru_slots.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert HotBufferState.allocate(1, 2, 1, 4).scratch_locs is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_reqs=0), "num_reqs must be an int >= 1, got 0"),
        (dict(tail=0), "tail must be an int >= 1, got 0"),
        (dict(hot=2.0), "hot must be an int >= 1, got 2.0"),
        (dict(scratch=-1), "scratch must be an int >= 0, got -1"),
    ],
)
def test_allocate_rejects_bad_geometry(kwargs, match):
    args = dict(num_reqs=2, hot=2, tail=1, max_len=4) | kwargs
    with pytest.raises(ValueError, match=match):
        HotBufferState.allocate(**args)


def test_construction_checks_name_the_table():
    good = tables(HotBufferState.allocate(2, 3, 1, 8))
    with pytest.raises(ValueError, match=r"lru_slots must be torch.int16, got torch.int64"):
        HotBufferState(**good | {"lru_slots": good["lru_slots"].long()})
    with pytest.raises(ValueError, match=r"device_buffer_locs must have shape \(2, 4\)"):
        HotBufferState(**good | {"device_buffer_locs": good["device_buffer_locs"][:, :3]})
    with pytest.raises(ValueError, match=r"1 <= hot < 4 \(at least one tail slot\)"):
        HotBufferState(**good | {"lru_slots": torch.zeros(2, 4, dtype=torch.int16)})
    with pytest.raises(ValueError, match=r"host_cache_locs must have shape \[2, max_len\] with contiguous rows"):
        HotBufferState(**good | {"host_cache_locs": good["host_cache_locs"].t().contiguous().t()})
    with pytest.raises(TypeError, match="host_cache_locs must be a torch.Tensor, got list"):
        HotBufferState(**good | {"host_cache_locs": [[0]]})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        HotBufferState(**good).lru_slots = good["lru_slots"]


def test_fill_short_places_tokens_positionally():
    s = HotBufferState.allocate(2, 4, 2, 8)
    s.set_hot(1, [7, 6, 5, 4], [3, 2, 1, 0])
    s.write_tail(1, [9])
    s.fill_short(1, 3, torch.tensor([40, 41, 42]))
    assert s.device_buffer_tokens[1].tolist() == [0, 1, 2, -1, -1, -1]
    assert s.lru_slots[1].tolist() == [0, 1, 2, 3]
    assert s.host_cache_locs[1].tolist() == [40, 41, 42, -1, -1, -1, -1, -1]
    assert s.device_buffer_tokens[0].eq(-1).all()  # other requests untouched


def test_fill_short_rejects_long_or_mismatched_input_without_change():
    s = HotBufferState.allocate(1, 4, 1, 8)
    before = s.clone()
    with pytest.raises(ValueError, match=r"seq_len must be in \[0, hot = 4\] for a short request, got 5"):
        s.fill_short(0, 5, range(5))
    with pytest.raises(ValueError, match="host_rows must have seq_len = 3 entries, got 2"):
        s.fill_short(0, 3, [1, 2])
    with pytest.raises(ValueError, match=r"rid must be an int in \[0, 1\), got 1"):
        s.fill_short(1, 1, [0])
    assert same_tables(before, s)


def test_set_host_rows_backs_a_prefix():
    s = HotBufferState.allocate(1, 2, 1, 5)
    s.set_host_rows(0, [9, 8, 7])
    assert s.host_cache_locs[0].tolist() == [9, 8, 7, -1, -1]
    with pytest.raises(ValueError, match=r"host_rows must be 1-D with at most 5 entries, got shape \(6,\)"):
        s.set_host_rows(0, range(6))
    with pytest.raises(ValueError, match="host_rows must hold integers, got torch.float32"):
        s.set_host_rows(0, torch.ones(2))


def test_write_tail_newest_at_slot_hot_then_drafts():
    s = HotBufferState.allocate(2, 3, 3, 16)
    s.write_tail(1, torch.tensor([12, 13, 14], dtype=torch.int32))
    assert s.device_buffer_tokens[1].tolist() == [-1, -1, -1, 12, 13, 14]
    s.write_tail(1, [20])
    assert s.device_buffer_tokens[1].tolist() == [-1, -1, -1, 20, -1, -1]
    with pytest.raises(ValueError, match=r"tokens must be 1-D with at most 3 entries, got shape \(4,\)"):
        s.write_tail(1, [1, 2, 3, 4])
    assert s.device_buffer_tokens[1].tolist() == [-1, -1, -1, 20, -1, -1]


def test_set_hot_and_finish():
    s = HotBufferState.allocate(1, 4, 1, 16)
    s.set_host_rows(0, range(16))
    s.write_tail(0, [15])
    s.set_hot(0, [10, 11], lru=[1, 0, 3, 2])
    assert s.device_buffer_tokens[0].tolist() == [10, 11, -1, -1, 15]
    assert s.lru_slots[0].tolist() == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="lru must have hot = 4 entries, got 3"):
        s.set_hot(0, [1], lru=[0, 1, 2])
    s.finish(0)
    assert s.device_buffer_tokens[0].tolist() == [-1] * 5
    assert s.lru_slots[0].tolist() == [0, 1, 2, 3]
    assert s.host_cache_locs[0].eq(-1).all()
    assert s.device_buffer_locs[0].tolist() == [0, 1, 2, 3, 4]  # rows are kept


def test_clone_is_independent():
    s = HotBufferState.allocate(1, 2, 1, 4, scratch=1)
    c = s.clone()
    c.write_tail(0, [3])
    c.scratch_locs[0, 0] = 99
    assert s.device_buffer_tokens[0, 2] == -1 and s.scratch_locs[0, 0] == 3


def test_state_drives_the_reference_swap_in():
    s = HotBufferState.allocate(2, 4, 2, 32, scratch=1)
    s.set_host_rows(1, torch.arange(32) + 100)
    s.set_hot(1, [3, 4, 5, 6], lru=[3, 2, 1, 0])
    s.write_tail(1, [19, 20])
    host = torch.arange(200, dtype=torch.float64)[:, None].repeat(1, 2)
    dev = torch.zeros(s.device_rows, 2, dtype=torch.float64)
    out = torch.empty(1, 2, 2, dtype=torch.int32)
    # request 1 (rows 6..11, scratch 13): 20 via tail slot 5 (row 11); 5 hits slot 2; 7 evicts slot 3 (LRU-first).
    swap_in(
        s,
        top_k_tokens=torch.tensor([[[20, 5], [7, 5]]], dtype=torch.int32),
        host_cache=host,
        device_buffer=dev,
        top_k_device_locs=out,
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([21, 21]),
    )
    assert out.tolist() == [[[11, 8], [9, 8]]]
    assert s.lru_slots[1].tolist() == [1, 0, 3, 2]
    assert dev[9].tolist() == [107.0, 107.0]
    assert s.scratch_locs is not None  # the same state, scratch rows and all, serves the single-step path
    out1 = torch.empty(1, 2, dtype=torch.int32)
    s.write_tail(1, [20])  # the single step's newest token at slot HOT (docs/kernels.md §2 rule 11)
    swap_in(
        s,
        top_k_tokens=torch.tensor([[20, 3]], dtype=torch.int32),
        host_cache=host,
        device_buffer=dev,
        top_k_device_locs=out1,
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([21]),
    )
    assert out1.tolist() == [[10, 6]]  # single-step: newest 20 -> slot HOT (row 10); 3 hits slot 0


def test_swap_in_refuses_flat_tables_and_foreign_plans():
    s = HotBufferState.allocate(2, 4, 2, 32, scratch=1)
    args = dict(
        top_k_tokens=torch.tensor([[20, 3]], dtype=torch.int32),
        top_k_device_locs=torch.full((1, 2), -5, dtype=torch.int32),
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([21]),
        host_cache=torch.zeros(4, 2),
        device_buffer=torch.zeros(s.device_rows, 2),
    )
    before = s.clone()
    with pytest.raises(
        TypeError, match=r"state must be a kvplan.HotBufferState \(the engine's hot-buffer tables\), got dict"
    ):
        swap_in(tables(s), **args)
    plan = (
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(1, 2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )
    with pytest.raises(TypeError, match="plan must be a kvplan.MissPlan or None, got tuple"):
        swap_in(s, **args, plan=plan)
    assert same_tables(before, s) and args["top_k_device_locs"].eq(-5).all()


def _pool_and_reference_step(pool, state, ref_state, dev, ref_dev, ref_counters, host, tokens, rids, seq_lens):
    """One swap-in through ``pool`` on ``state`` and through the reference on ``ref_state`` (clones): every output
    must be equal. Returns the reference's outputs and plan."""
    device = state.device
    tokens, rids, seq_lens = tokens.to(device), rids.to(device), seq_lens.to(device)
    out = torch.full(tokens.shape, -7, dtype=torch.int32, device=device)
    ref_out = out.clone()
    batch, columns = tokens.shape[0], tokens[0].numel()
    ref_plan = MissPlan(
        torch.full((batch, columns), -9, dtype=torch.int64, device=device),
        torch.full((batch, columns), -9, dtype=torch.int32, device=device),
        torch.full((batch,), -9, dtype=torch.int32, device=device),
    )
    plan = pool.swap_in(state, tokens, out, rids, seq_lens, host, dev)
    assert plan.generation == pool.generation and plan.src.shape == (batch, columns)
    reference.swap_in(ref_state, tokens, ref_out, rids, seq_lens, host, ref_dev, plan=ref_plan, counters=ref_counters)
    assert torch.equal(out, ref_out), (out, ref_out)
    assert same_tables(state, ref_state)
    assert torch.equal(dev, ref_dev)
    assert torch.equal(plan.count, ref_plan.count)
    assert_same_plan_rows(plan.src, plan.dst, ref_plan.src, ref_plan.dst, ref_plan.count)
    assert read_counters(pool.counters) == read_counters(ref_counters)
    return ref_out.cpu(), MissPlan(ref_plan.src.cpu(), ref_plan.dst.cpu(), ref_plan.count.cpu())


def test_one_state_with_scratch_serves_both_swap_in_paths_of_one_pool(device):
    """The state with scratch rows goes whole to the single-step launch and to the speculative one of the same pool
    (no table popped); each step equals the reference run on clones, and the state carries over between them."""
    state = HotBufferState.allocate(2, hot=4, tail=3, max_len=32, device=device, scratch=2)
    for rid in range(2):
        state.set_host_rows(rid, torch.arange(32) + 40 * rid)
    state.set_hot(1, [3, 4, 5, 6], lru=[3, 2, 1, 0])
    state.set_hot(0, [1, 2, 8, 9], lru=[0, 1, 2, 3])
    host = (torch.arange(80, dtype=torch.float32)[:, None] * torch.tensor([1.0, -1.0, 0.5])).to(device)
    dev = torch.zeros(state.device_rows, 3, device=device)
    ref_state, ref_dev, ref_counters = state.clone(), dev.clone(), new_counters(device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=2, num_steps=2, top_k=4)
    rids = torch.tensor([1, 0])
    step = (state, ref_state, dev, ref_dev, ref_counters, host)

    # speculative: request 1 has 3 evictable slots for 6 distinct misses (10..15): 3 admitted, 2 scratch rows, 1 over
    for rid, tail in ((1, [20, 21]), (0, [20, 21])):
        state.write_tail(rid, tail)
        ref_state.write_tail(rid, tail)
    tokens = torch.tensor([[[10, 11, 12, 13], [14, 15, 3, 21]], [[1, 2, 20, 30]] * 2], dtype=torch.int32)
    out, _ = _pool_and_reference_step(pool, *step, tokens, rids, torch.tensor([21, 22, 21, 22]))
    scratch_rows = set(state.scratch_locs[1].tolist())  # (tolist: host copies of device tensors)
    assert scratch_rows <= set(out[0].flatten().tolist())  # the spec path used request 1's scratch rows
    assert read_counters(pool.counters)["overflow"] == int(ref_counters[OVERFLOW]) == 1

    # single-step on the same pool and the same state (scratch_locs still set): scratch rows are never used
    for rid, newest in ((1, [22]), (0, [22])):
        state.write_tail(rid, newest)
        ref_state.write_tail(rid, newest)
    tokens = torch.tensor([[22, 3, 16, 17], [1, 25, 5, 22]], dtype=torch.int32)
    out, plan = _pool_and_reference_step(pool, *step, tokens, rids, torch.tensor([23, 23]))
    assert not scratch_rows & set(out.flatten().tolist()) and int(plan.count.sum()) > 0

    # and speculative again, after the single-step call changed the state
    for rid in range(2):
        state.write_tail(rid, [23, 24])
        ref_state.write_tail(rid, [23, 24])
    tokens = torch.tensor([[[18, 19, 16, 24], [3, 26, 27, 28]], [[7, 25, 23, 24]] * 2], dtype=torch.int32)
    _pool_and_reference_step(pool, *step, tokens, rids, torch.tensor([24, 25, 24, 25]))


@pytest.mark.gpu
def test_per_step_helpers_do_not_synchronise():
    s = HotBufferState.allocate(4, 64, 8, 1024, device="cuda", scratch=4)
    tokens = torch.arange(5, dtype=torch.int32, device="cuda")
    rows = torch.arange(40, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.write_tail(1, tokens)
        s.set_host_rows(2, rows)
        s.fill_short(3, 40, rows)
        s.set_hot(0, tokens, torch.arange(64, dtype=torch.int16, device="cuda").flip(0))
        s.finish(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert s.device_buffer_tokens[1, 64:69].tolist() == list(range(5))
    assert s.host_cache_locs[2].eq(-1).all().item()


def test_value_lists_are_checked_not_truncated_or_wrapped():
    state = HotBufferState.allocate(2, hot=4, tail=2, max_len=8)
    with pytest.raises(TypeError, match="host_rows must hold ints"):
        state.set_host_rows(0, [1.5, 2.0])
    with pytest.raises(ValueError, match=r"lru must fit torch.int16"):
        state.set_hot(0, [0, 1, 2, 3], lru=[0, 1, 2, 40000])
    with pytest.raises(TypeError, match="tokens must be a tensor or a sequence of ints, got int"):
        state.write_tail(0, 7)
    with pytest.raises(TypeError, match="rid must be an int"):
        state.finish(1.0)
    assert (state.host_cache_locs == -1).all()  # nothing written by the refused calls
