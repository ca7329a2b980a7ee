"""Hand-worked cases for the swap-in reference (docs/kernels.md §2-§4), the oracle of the Triton kernels.

Geometry unless a test says otherwise: R = 3 requests, HOT = 4, tail P = 2 (W = 6), Lmax = 32. Slot j of request r
is device row 6r + j (HotBufferState.allocate); with scratch C = 2, scratch row c of request r is 18 + 2r + c.
Token t of request r is host row 32r + t, and host row h holds [3h, 3h + 1, 3h + 2] (int32), so a copied row is
recognisable. Expected values below are worked out by hand from the spec.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplan.counters import REPLAY_COPY_BASE, SWAP_IN_COPY_BASE, new_counters, read_counters
from kvplan.plan import MissPlan
from kvplan.reference import copy_planned, swap_in
from kvplan.state import HotBufferState

R, HOT, TAIL, LMAX, ITEM = 3, 4, 2, 32, 3
I32, I64 = torch.int32, torch.int64


class Case:
    """A state, its host cache and device buffer, a plan with sentinel -9 entries, and counters."""

    def __init__(self, *, batch: int, columns: int, scratch: int = 0, dtype: torch.dtype = I32, item: int = ITEM):
        self.state = HotBufferState.allocate(R, HOT, TAIL, LMAX, scratch=scratch)
        for r in range(R):
            self.state.set_host_rows(r, torch.arange(LMAX) + LMAX * r)
        self.host_cache = torch.arange(R * LMAX * item).reshape(R * LMAX, item).to(dtype)
        self.device_buffer = torch.full((self.state.device_rows, item), -7).to(dtype)
        self.miss_src = torch.full((batch, columns), -9, dtype=I64)
        self.miss_dst = torch.full((batch, columns), -9, dtype=I32)
        self.miss_count = torch.full((batch,), -9, dtype=I32)
        self.counters = new_counters("cpu")

    def run(self, tokens, seq_lens, rids, *, num_real=None, index_dtype=I64, plan=True):
        """Run the single-step (2-D tokens) or speculative (3-D) reference; returns the outputs as a list."""
        tokens = torch.tensor(tokens, dtype=I32)
        out = torch.full(tokens.shape, -5, dtype=I32)
        swap_in(
            self.state,
            top_k_tokens=tokens,
            host_cache=self.host_cache,
            device_buffer=self.device_buffer,
            top_k_device_locs=out,
            req_pool_indices=torch.tensor(rids, dtype=index_dtype),
            seq_lens=torch.tensor(seq_lens, dtype=index_dtype),
            num_real_reqs=None if num_real is None else torch.tensor([num_real], dtype=I32),
            plan=MissPlan(self.miss_src, self.miss_dst, self.miss_count) if plan else None,
            counters=self.counters,
        )
        return out.tolist()

    def hot_tokens(self, rid):
        return self.state.device_buffer_tokens[rid, :HOT].tolist()

    def lru(self, rid):
        return self.state.lru_slots[rid].tolist()

    def plan(self, row):
        count = int(self.miss_count[row])
        return self.miss_src[row, :count].tolist(), self.miss_dst[row, :count].tolist()

    def copied(self, host_row, device_row):
        return torch.equal(self.device_buffer[device_row], self.host_cache[host_row])

    def untouched(self, device_row):
        return bool((self.device_buffer[device_row] == -7).all())

    def count(self, name):
        return read_counters(self.counters)[name]


def snapshot(case: Case):
    s = case.state
    return [
        t.clone()
        for t in (
            s.device_buffer_tokens,
            s.lru_slots,
            case.device_buffer,
            case.miss_src,
            case.miss_dst,
            case.miss_count,
        )
    ]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------------------------------
# Single-step (§2)


@pytest.mark.parametrize("index_dtype", [I32, I64])
def test_single_long_row_hits_misses_newest_and_lru_over_two_calls(index_dtype):
    c = Case(batch=1, columns=4)
    c.state.set_hot(1, [3, 5, -1, 7], lru=[2, 0, 1, 3])  # request 1: slots 6..11, slot HOT = 4 is row 10

    # L = 11: newest token 10 -> slot HOT; 5 hits slot 1; 9 misses into the LRU-first evictable, slot 2.
    c.state.write_tail(1, [10])  # (slot HOT serves the newest token while its token entry names it: rule 11)
    assert c.run([[5, 9, 10, 9]], [11], [1], index_dtype=index_dtype) == [[7, 8, 10, 8]]
    assert c.hot_tokens(1) == [3, 5, 9, 7]
    assert c.lru(1) == [0, 3, 2, 1]  # evictables [2, 0, 3]: [0, 3] ++ [2] ++ hits [1]
    assert c.plan(0) == ([32 + 9], [8])
    assert c.copied(32 + 9, 8)

    # L = 12: newest 11 -> row 10; 12 invalid; 3 hits slot 0; 4 takes the first evictable of [3, 2, 1].
    c.state.write_tail(1, [11])
    assert c.run([[3, 11, 12, 4]], [12], [1], index_dtype=index_dtype) == [[6, 10, -1, 9]]
    assert c.hot_tokens(1) == [3, 5, 9, 4]
    assert c.lru(1) == [2, 1, 3, 0]
    assert c.plan(0) == ([32 + 4], [9])
    assert c.copied(32 + 4, 9)
    assert read_counters(c.counters) == {
        "misses_copied": 2,
        "bytes_moved": 2 * ITEM * 4,
        "hits": 2,
        "overflow": 0,
        "replayed_rows": 0,
        "replayed_bytes": 0,
    }


def test_single_duplicates_share_one_slot_and_one_copy():
    c = Case(batch=1, columns=4)
    assert c.run([[7, 7, 2, 7]], [20], [0]) == [[0, 0, 1, 0]]
    assert c.hot_tokens(0) == [7, 2, -1, -1]
    assert c.lru(0) == [2, 3, 0, 1]
    assert c.plan(0) == ([7, 2], [0, 1])
    assert c.count("misses_copied") == 2 and c.count("hits") == 0


def test_single_invalid_and_unbacked_tokens_take_no_slot():
    c = Case(batch=1, columns=4)
    c.state.host_cache_locs[0, 5] = -1  # token 5 of request 0 is not backed
    # -1 and 12 (>= L = 10) are invalid; 5 is unbacked; 3 therefore takes the first evictable, slot 0.
    assert c.run([[-1, 12, 5, 3]], [10], [0]) == [[-1, -1, -1, 0]]
    assert c.hot_tokens(0) == [3, -1, -1, -1]
    assert c.lru(0) == [1, 2, 3, 0]
    assert c.plan(0) == ([3], [0])
    assert c.count("misses_copied") == 1


def test_single_hits_count_distinct_tokens():
    c = Case(batch=1, columns=4)
    c.state.set_hot(0, [4, 6, 8, -1])
    # 6 and 8 hit slots 1 and 2 (two occurrences of 6 count once); 9 evicts token 4 from slot 0, the LRU-first.
    assert c.run([[6, 6, 8, 9]], [30], [0]) == [[1, 1, 2, 0]]
    assert c.count("hits") == 2
    assert c.hot_tokens(0) == [9, 6, 8, -1]
    assert c.lru(0) == [3, 0, 1, 2]  # evictables [0, 3], M = 1: [3] ++ [0] ++ hits [1, 2]


def test_single_short_row_reads_slot_t_with_min_len_k_cutoff():
    c = Case(batch=2, columns=4)
    c.state.fill_short(2, 3, torch.arange(3) + 64)
    before = snapshot(c)
    # row 0 (L = 3): i = 3 is cut off by min(L, K) = 3 although token 1 is valid; row 1 (L = 3): 3 is invalid.
    assert c.run([[2, -1, 0, 1], [3, 2, 1, 0]], [3, 3], [2, 2]) == [[14, -1, 12, -1], [-1, 14, 13, -1]]
    assert c.miss_count.tolist() == [0, 0]
    after = snapshot(c)
    assert same(before[:5], after[:5])  # no state change, no copy, plan entries untouched
    assert c.count("misses_copied") == 0


def test_single_padding_rows_are_not_touched():
    c = Case(batch=2, columns=4)
    c.state.set_hot(2, [8, -1, -1, -1])
    before = snapshot(c)
    # row 0 is real (rid 2, token 8 hits slot 0); row 1 is padding although it names rid 0 and misses there.
    assert c.run([[8, 8, 8, 8], [1, 2, 3, 4]], [20, 20], [2, 0], num_real=1) == [[12, 12, 12, 12], [-1, -1, -1, -1]]
    assert c.miss_count.tolist() == [0, -9]
    assert c.hot_tokens(0) == [-1] * HOT and c.lru(0) == [0, 1, 2, 3]
    assert torch.equal(c.device_buffer, before[2])
    assert c.count("hits") == 1


def test_single_rid_permutation_uses_request_state_and_batch_row_outputs():
    c = Case(batch=2, columns=4)
    c.state.set_hot(2, [8, -1, -1, -1])
    # batch row 0 -> request 2 (8 hits slot 0, row 12); batch row 1 -> request 0 (8 misses into slot 0, row 0).
    assert c.run([[8, 9, -1, -1], [8, -1, -1, -1]], [20, 20], [2, 0]) == [[12, 13, -1, -1], [0, -1, -1, -1]]
    assert c.plan(0) == ([64 + 9], [13])
    assert c.plan(1) == ([8], [0])
    assert c.hot_tokens(2) == [8, 9, -1, -1] and c.lru(2) == [2, 3, 1, 0]
    assert c.hot_tokens(0) == [8, -1, -1, -1] and c.lru(0) == [1, 2, 3, 0]
    assert c.copied(64 + 9, 13) and c.copied(8, 0)


def test_single_num_real_reqs_none_means_all_rows_and_plan_is_optional():
    c = Case(batch=2, columns=4)
    assert c.run([[1, 2, 3, 4], [1, 2, 3, 4]], [9, 9], [0, 1], plan=False) == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert c.miss_count.tolist() == [-9, -9]
    assert c.count("misses_copied") == 8


def test_odd_item_size_is_copied_completely():
    c = Case(batch=1, columns=4, dtype=torch.uint8, item=13)
    c.host_cache = torch.randint(
        0, 256, c.host_cache.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    assert c.run([[5, -1, -1, -1]], [9], [1]) == [[6, -1, -1, -1]]
    assert torch.equal(c.device_buffer[6], c.host_cache[32 + 5])
    assert c.count("bytes_moved") == 13


# ---------------------------------------------------------------------------------------------------------------------
# Speculative (§3)


@pytest.mark.parametrize("index_dtype", [I32, I64])
def test_spec_token_shared_by_three_steps_is_copied_once(index_dtype):
    c = Case(batch=1, columns=6)
    assert c.run([[[5, 1], [5, 2], [5, 1]]], [10, 11, 12], [0], index_dtype=index_dtype) == [[[0, 1], [0, 2], [0, 1]]]
    assert c.plan(0) == ([5, 1, 2], [0, 1, 2])
    assert c.hot_tokens(0) == [5, 1, 2, -1]
    assert c.lru(0) == [3, 0, 1, 2]
    assert c.count("misses_copied") == 3


def test_spec_validity_is_per_step_and_newest_resolves_through_tail():
    c = Case(batch=1, columns=6)
    c.state.set_hot(0, [0, -1, -1, -1])
    c.state.write_tail(0, [7])  # newest token 7 at slot HOT (row 4)
    # step 0 (L=6): 6 invalid, 0 hits; step 1 (L=7): 6 valid -> miss into slot 1, 7 invalid; step 2 (L=8): 7 via tail.
    assert c.run([[[6, 0], [6, 7], [-1, 7]]], [6, 7, 8], [0]) == [[[-1, 0], [1, -1], [-1, 4]]]
    assert c.hot_tokens(0) == [0, 6, -1, -1]
    assert c.lru(0) == [2, 3, 1, 0]
    assert c.plan(0) == ([6], [1])
    assert c.count("hits") == 1


def test_spec_tail_lowest_slot_with_a_row_wins():
    c = Case(batch=1, columns=4)
    c.state.write_tail(0, [9, 9])
    assert c.run([[[9, 9], [3, 9]]], [10, 10], [0]) == [[[4, 4], [0, 4]]]
    c.state.device_buffer_locs[0, HOT] = -1  # slot HOT has no row: slot HOT + 1 serves 9
    assert c.run([[[9, 3], [9, 9]]], [10, 10], [0]) == [[[5, 0], [5, 5]]]
    c.state.write_tail(0, [9, 8])  # no usable tail slot holds 9: it becomes a wanted token and misses
    assert c.run([[[9, 3], [-1, -1]]], [10, 10], [0]) == [[[1, 0], [-1, -1]]]
    assert c.plan(0) == ([9], [1])


def test_spec_misses_fill_evictables_then_scratch_then_overflow():
    c = Case(batch=1, columns=8, scratch=2)  # request 1: slots 6..11, scratch rows 20, 21
    c.state.set_hot(1, [10, -1, 13, 14])
    c.state.host_cache_locs[1, 22] = -1
    # wanted 10 (hit, slot 0) then misses 20 21 22 23 24 25 26; 22 is unbacked (dropped, takes nothing);
    # 20 21 23 take evictables [1, 2, 3]; 24 25 take scratch rows 20 21; 26 overflows.
    out = c.run([[[10, 20, 21, 22], [23, 24, 25, 26]]], [30, 31], [1])
    assert out == [[[6, 7, 8, -1], [9, 20, 21, -1]]]
    assert c.hot_tokens(1) == [10, 20, 21, 23]  # scratch copies are not admitted
    assert c.lru(1) == [1, 2, 3, 0]
    assert c.plan(0) == ([52, 53, 55, 56, 57], [7, 8, 9, 20, 21])
    assert all(c.copied(h, d) for h, d in zip(*c.plan(0)))
    assert read_counters(c.counters) == {
        "misses_copied": 5,
        "bytes_moved": 5 * ITEM * 4,
        "hits": 1,
        "overflow": 1,
        "replayed_rows": 0,
        "replayed_bytes": 0,
    }


def test_spec_without_scratch_overflows_after_the_evictables():
    c = Case(batch=1, columns=8)
    c.state.set_hot(0, [10, 11, 12, -1])
    out = c.run([[[10, 11, 12, 20], [21, 22, 12, 20]]], [30, 30], [0])
    assert out == [[[0, 1, 2, 3], [-1, -1, 2, 3]]]
    assert c.lru(0) == [3, 0, 1, 2]
    assert c.count("overflow") == 2 and c.count("hits") == 3


def test_spec_padding_rows_output_zero_and_count_zero():
    c = Case(batch=2, columns=4)
    before = snapshot(c)
    out = c.run([[[1, 2], [3, 4]], [[1, 2], [3, 4]]], [9, 9, 9, 9], [0, 1], num_real=1)
    assert out == [[[0, 1], [2, 3]], [[0, 0], [0, 0]]]
    assert c.miss_count.tolist() == [4, 0]
    assert c.miss_src[1].tolist() == before[3][1].tolist()  # padding row: no plan entries
    assert c.hot_tokens(1) == [-1] * HOT and c.lru(1) == [0, 1, 2, 3]


def test_spec_short_row_uses_last_step_length_and_has_no_cutoff():
    c = Case(batch=1, columns=4)
    c.state.fill_short(2, 4, torch.arange(4) + 64)  # request 2: slots 12..17
    before = snapshot(c)
    # last step L = 4 <= HOT: short. 3 is invalid at step 0 (L = 3) and valid at step 1.
    assert c.run([[[3, 2], [3, 0]]], [3, 4], [2]) == [[[-1, 14], [15, 12]]]
    assert c.miss_count.tolist() == [0]
    assert same(before[:3], snapshot(c)[:3])
    # an earlier step longer than the last: 5 reads tail slot 5 (row 17); 7 >= W outputs -1 (defined behaviour 5).
    assert c.run([[[5, 7], [1, 1]]], [10, 4], [2]) == [[[17, -1], [13, 13]]]


def test_single_and_spec_share_one_lru_state():
    c = Case(batch=1, columns=8)
    assert c.run([[1, 2, 3, 4]], [20], [0]) == [[0, 1, 2, 3]]
    assert c.lru(0) == [0, 1, 2, 3]
    c.state.write_tail(0, [20])
    # spec: 3 and 4 hit (slots 2, 3); 5 takes LRU-first evictable slot 0, 20 resolves via the tail (row 4).
    assert c.run([[[3, 5], [4, 20]]], [21, 21], [0]) == [[[2, 0], [3, 4]]]
    assert c.lru(0) == [1, 0, 2, 3]
    assert c.hot_tokens(0) == [5, 2, 3, 4]


# ---------------------------------------------------------------------------------------------------------------------
# Defined behaviour beyond the preconditions


def test_rid_out_of_range_is_a_padding_row_of_its_path():
    c = Case(batch=1, columns=4)
    assert c.run([[1, 2, 3, 4]], [9], [R]) == [[-1, -1, -1, -1]]
    assert c.miss_count.tolist() == [-9]
    assert c.run([[[1, 2], [3, 4]]], [9, 9], [-1]) == [[[0, 0], [0, 0]]]
    assert c.miss_count.tolist() == [0]
    assert c.count("misses_copied") == 0


def test_token_beyond_host_table_is_unbacked():
    c = Case(batch=1, columns=4)
    assert c.run([[35, 1, -1, -1]], [40], [0]) == [[-1, 0, -1, -1]]
    assert c.plan(0) == ([1], [0])


def test_lru_entry_out_of_range_is_an_empty_slot_without_a_row():
    c = Case(batch=1, columns=4)
    c.state.lru_slots[0] = torch.tensor([5, 1, 2, 3], dtype=torch.int16)
    assert c.run([[7, 8, -1, -1]], [20], [0]) == [[-1, 1, -1, -1]]
    assert c.plan(0) == ([7, 8], [-1, 1])
    assert c.hot_tokens(0) == [-1, 8, -1, -1]
    assert c.lru(0) == [2, 3, 5, 1]
    assert c.count("misses_copied") == 1


def test_copy_with_row_outside_the_buffers_is_skipped():
    c = Case(batch=1, columns=4)
    c.state.host_cache_locs[0, 7] = 10_000
    c.state.device_buffer_locs[0, 1] = 10_000
    assert c.run([[7, 8, -1, -1]], [20], [0]) == [[0, 10_000, -1, -1]]
    assert c.plan(0) == ([10_000, 8], [0, 10_000])
    assert c.hot_tokens(0) == [7, 8, -1, -1]
    assert c.untouched(0)
    assert c.count("misses_copied") == 0


def test_single_misses_beyond_evictables_overflow():
    c = Case(batch=1, columns=4)
    c.state.set_hot(0, [6, 6, 6, -1])  # broken: token 6 in three slots; only slot 3 is evictable
    c.state.lru_slots[0] = torch.tensor([1, 3, 0, 2], dtype=torch.int16)
    # slots 1, 0, 2 are hits, the LRU-first (slot 1) serves 6; 1 takes slot 3, the only evictable; 2 overflows.
    assert c.run([[6, 1, 2, -1]], [20], [0]) == [[1, 3, -1, -1]]
    assert c.lru(0) == [3, 1, 0, 2]
    assert c.plan(0) == ([1], [3])
    assert c.count("overflow") == 1 and c.count("hits") == 1


# ---------------------------------------------------------------------------------------------------------------------
# Replay (§4) and argument checks


def test_copy_planned_copies_real_rows_up_to_their_count():
    host = torch.arange(40 * 2, dtype=torch.float32).reshape(40, 2)
    dev = torch.zeros(8, 2, dtype=torch.float32)
    counters = new_counters("cpu")
    src = torch.tensor([[5, 6, 7], [8, 99, 9], [1, 2, 3]], dtype=I64)
    dst = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 2]], dtype=I32)
    count = torch.tensor([2, 7, 3], dtype=I32)  # row 1 is clamped to 3 columns; row 2 is padding
    copy_planned(
        MissPlan(src, dst, count),
        num_real_reqs=torch.tensor([2], dtype=I32),
        host_cache=host,
        device_buffer=dev,
        counters=counters,
    )
    expected = torch.zeros(8, 2)
    for h, d in [(5, 0), (6, 1), (8, 3), (9, 5)]:  # host row 99 is outside the cache: skipped
        expected[d] = host[h]
    assert torch.equal(dev, expected)
    assert read_counters(counters)["replayed_rows"] == 4 and read_counters(counters)["replayed_bytes"] == 4 * 8
    assert read_counters(counters)["misses_copied"] == 0

    copy_planned(
        MissPlan(src, dst, count),
        num_real_reqs=None,
        host_cache=host,
        device_buffer=dev,
        counters=counters,
        counter_base=SWAP_IN_COPY_BASE,
    )
    assert torch.equal(dev[6], host[1]) and torch.equal(dev[7], host[2]) and torch.equal(dev[2], host[3])
    assert read_counters(counters)["misses_copied"] == 7 and REPLAY_COPY_BASE != SWAP_IN_COPY_BASE


def test_plan_arguments_checked_before_anything_is_written():
    c = Case(batch=1, columns=3)  # spec needs S*K = 4 columns
    before = snapshot(c)
    with pytest.raises(
        ValueError, match=r"^speculative miss_src/miss_dst must have shape \[batch, >= steps \* top_k\]"
    ):
        c.run([[[1, 2], [3, 4]]], [9, 9], [0])
    assert same(before, snapshot(c)) and c.count("misses_copied") == 0
    c.miss_count = None
    with pytest.raises(TypeError, match="MissPlan.count must be a torch.Tensor, got NoneType"):
        c.run([[1, 2, 3]], [9], [0])


def test_hot_smaller_than_top_k_is_rejected():
    c = Case(batch=1, columns=8)
    with pytest.raises(ValueError, match="hot >= top_k = 5"):
        c.run([[1, 2, 3, 4, 5]], [9], [0])


# ---------------------------------------------------------------------------------------------------------------------
# Property: on a consistent state every resolved row holds its token's host row, and the state stays consistent.


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    steps=st.integers(1, 3),
    top_k=st.integers(1, 4),
    scratch=st.integers(0, 2),
)
def test_spec_results_point_at_the_right_rows(data, steps, top_k, scratch):
    c = Case(batch=2, columns=steps * top_k, scratch=scratch)
    s = c.state
    for rid in range(R):  # random distinct hot tokens, random LRU, rows filled with their tokens' host rows
        s.host_cache_locs[rid, data.draw(st.lists(st.integers(0, LMAX - 1), max_size=3))] = -1
        hot = data.draw(st.lists(st.integers(-1, 24), min_size=HOT, max_size=HOT))
        hot = [t if t not in hot[:j] else -1 for j, t in enumerate(hot)]
        s.set_hot(rid, hot, data.draw(st.permutations(range(HOT))))
        s.write_tail(rid, [data.draw(st.integers(0, 24))])
        for j in range(HOT + 1):
            t = int(s.device_buffer_tokens[rid, j])
            if t >= 0 and s.host_cache_locs[rid, t] >= 0:
                c.device_buffer[s.device_buffer_locs[rid, j]] = c.host_cache[s.host_cache_locs[rid, t]]
    rids = data.draw(st.permutations(range(R)))[:2]
    lens = data.draw(st.lists(st.integers(0, 26), min_size=2 * steps, max_size=2 * steps))
    tokens = data.draw(
        st.lists(st.integers(-1, 27), min_size=2 * steps * top_k, max_size=2 * steps * top_k).map(
            lambda v: torch.tensor(v).reshape(2, steps, top_k).tolist()
        )
    )
    out = torch.tensor(c.run(tokens, lens, rids))

    def host_row(rid, t):
        return int(s.host_cache_locs[rid, t])

    copied = 0
    for b, rid in enumerate(rids):
        assert sorted(c.lru(rid)) == list(range(HOT))
        held = [t for t in c.hot_tokens(rid) if t >= 0]
        assert len(held) == len(set(held))
        for j, t in enumerate(c.hot_tokens(rid)):  # the state stays consistent
            if t >= 0 and host_row(rid, t) >= 0:
                assert c.copied(host_row(rid, t), int(s.device_buffer_locs[rid, j]))
        long_row = lens[b * steps + steps - 1] > HOT
        for step in range(steps):
            for k in range(top_k):
                t, row = tokens[b][step][k], int(out[b, step, k])
                valid = 0 <= t < lens[b * steps + step]
                if not long_row:  # short row: slot t, no state involved
                    assert row == (int(s.device_buffer_locs[rid, t]) if valid and t < HOT + TAIL else -1)
                elif row >= 0:
                    assert valid
                    assert host_row(rid, t) < 0 or c.copied(host_row(rid, t), row)
                elif valid:
                    assert host_row(rid, t) < 0 or c.count("overflow") > 0
        copied += int(c.miss_count[b])
    assert c.count("misses_copied") == copied


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the reference is device-agnostic and fast enough at production shapes.


def _state_to(state: HotBufferState, device) -> HotBufferState:
    """The state's tables copied to ``device`` (a state built there, so its checks run again)."""
    return HotBufferState(
        **{
            f.name: None if (t := getattr(state, f.name)) is None else t.to(device)
            for f in attrs.fields(HotBufferState)
        }
    )


@pytest.mark.gpu
def test_reference_on_cuda_matches_cpu_at_production_shape():
    gen = torch.Generator().manual_seed(0)
    num_reqs, hot, tail, max_len, top_k, steps, batch = 16, 4096, 64, 16384, 2048, 4, 16
    state = HotBufferState.allocate(num_reqs, hot, tail, max_len, scratch=128)
    state.host_cache_locs.copy_(torch.randperm(num_reqs * max_len, generator=gen).reshape(num_reqs, max_len))
    for rid in range(num_reqs):
        state.set_hot(rid, torch.randperm(max_len - 8, generator=gen)[:hot], torch.randperm(hot, generator=gen))
        state.write_tail(rid, [max_len - 6, max_len - 5, max_len - 4])
    host = torch.randint(0, 256, (num_reqs * max_len, 576), dtype=torch.uint8, generator=gen)
    args = dict(
        top_k_tokens=torch.randint(-1, max_len - 4, (batch, steps, top_k), dtype=I32, generator=gen),
        req_pool_indices=torch.randperm(num_reqs, generator=gen)[:batch].to(I32),
        seq_lens=torch.full((batch * steps,), max_len - 4, dtype=I64),
        num_real_reqs=torch.tensor([batch - 2], dtype=I32),
    )
    results = []
    for device in ("cpu", "cuda"):
        s = _state_to(state.clone(), device)
        out = torch.empty(batch, steps, top_k, dtype=I32, device=device)
        plan = MissPlan.allocate(batch, steps * top_k, device)
        for t in (plan.src, plan.dst, plan.count):
            t.zero_()
        dev_buf = torch.zeros(state.device_rows, 576, dtype=torch.uint8, device=device)
        counters = new_counters(device)
        swap_in(
            s,
            **{k: v.to(device) for k, v in args.items()},
            plan=plan,
            host_cache=host.pin_memory() if device == "cuda" else host,
            device_buffer=dev_buf,
            top_k_device_locs=out,
            counters=counters,
        )
        results.append(
            [
                t.cpu()
                for t in (out, s.device_buffer_tokens, s.lru_slots, dev_buf, counters, plan.src, plan.dst, plan.count)
            ]
        )
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert int(results[0][4][0]) > 0


@pytest.mark.parametrize("base", [5, -1, True, 1.0])
def test_copy_planned_refuses_a_counter_base_outside_the_vector(base):
    host = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"counter_base must be an int in \[0, 4\]"):
        copy_planned(
            MissPlan(
                torch.zeros(1, 1, dtype=torch.int64),
                torch.zeros(1, 1, dtype=torch.int32),
                torch.ones(1, dtype=torch.int32),
            ),
            num_real_reqs=None,
            host_cache=host,
            device_buffer=host.clone(),
            counters=torch.zeros(6, dtype=torch.int64),
            counter_base=base,
        )
