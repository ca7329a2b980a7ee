"""End-to-end sparse attention (kvplan.testing.sparse_attention): attention over the rows a swap-in serves from the hot
buffer equals attention over the host cache rows of the same tokens, bit for bit; dense attention where the top-k
covers the whole context; and the check itself catches a wrong row."""

from __future__ import annotations

import pytest
import torch

from kvplan.testing.sparse_attention import AttentionCheckConfig, SparseAttentionCheck, attend


@pytest.mark.parametrize(
    "spec_steps",
    [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)],
    ids=["single", "spec2", "spec4"],
)
def test_long_requests_attend_exactly_through_the_swap_in(spec_steps, device):
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=spec_steps, context=40, scratch=32), device)
    results = [check.step() for _ in range(4)]
    assert all(r.ok and r.exact and r.mismatched_outputs == 0 for r in results), results
    assert results[0].misses_copied > 0  # the first step brings every selected row in from the host
    assert all(r.rows_left_out == r.overflowed == 0 for r in results)  # every selected token is backed and placed


@pytest.mark.slow  # interpreted swap-ins and attention, several steps
def test_overflowed_misses_are_left_out_on_both_sides_and_counted(device):
    """4 draft steps x 8 fresh tokens overflow 16 hot slots and no scratch: the tokens left out are exactly the
    overflow the swap-in counted, and attention over the rest still matches the host bit for bit."""
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=4, context=60, scratch=0, max_len=80), device)
    results = [check.step() for _ in range(3)]
    assert all(r.ok for r in results), results
    assert sum(r.overflowed for r in results) > 0 and all(r.rows_left_out >= r.overflowed for r in results)


@pytest.mark.slow  # interpreted swap-ins and attention, several steps
def test_single_step_and_speculative_steps_mixed_on_one_state(device):
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=4, context=36, scratch=4), device)
    results = [check.step(spec_steps=s) for s in (4, 1, 2, 1, 3)]
    assert all(r.ok for r in results), results
    assert [r.speculative for r in results] == [True, False, True, False, True]


@pytest.mark.slow  # interpreted swap-ins and attention, many steps
def test_short_requests_growing_long_match_dense_attention_while_the_top_k_covers_them(device):
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=3, context=12, top_k=16, hot=16), device)
    results = [check.step() for _ in range(5)]
    assert all(r.ok for r in results), results
    assert results[0].dense_checked == 6  # 2 requests x 3 draft steps, each selecting its whole context
    assert 0 < results[0].dense_max_error < 1e-4  # the same math summed in another order
    assert results[-1].dense_checked < results[0].dense_checked  # contexts outgrew the top-k (rows now long)


def test_a_wrong_row_in_the_hot_buffer_is_caught(device):
    check = SparseAttentionCheck(AttentionCheckConfig(spec_steps=2, context=40), device)
    launch = check.pool.swap_in  # (speculative: top_k_tokens is [B, S, K])

    def corrupting_swap_in(state, top_k_tokens, **kwargs):
        plan = launch(state, top_k_tokens, **kwargs)
        loc = int(kwargs["top_k_device_locs"][0, 0, 0])
        kwargs["device_buffer"][loc] += 1  # a served row that is not the token's
        return plan

    check.pool.swap_in = corrupting_swap_in
    result = check.step()
    assert not result.exact and not result.ok and result.mismatched_outputs >= 1


def test_attend_leaves_out_rows_and_attends_to_nothing_without_rows():
    gen = torch.Generator().manual_seed(0)
    q, rows = torch.randn(2, 8, generator=gen), torch.randn(5, 8, generator=gen)
    keep = torch.tensor([True, False, True, False, True])
    masked = attend(q, rows, keep, 4)
    assert torch.equal(masked, attend(q, rows, keep, 4))  # deterministic: same inputs, same bits
    # leaving rows out equals attending over the kept rows only (equal up to the reduction order of the host's BLAS)
    torch.testing.assert_close(masked, attend(q, rows[keep], torch.ones(3, dtype=torch.bool), 4), rtol=1e-6, atol=1e-6)
    assert torch.equal(attend(q, rows, torch.zeros(5, dtype=torch.bool), 4), torch.zeros(2, 4))


def test_config_and_step_arguments_are_checked(device):
    with pytest.raises(ValueError, match="top_k must be <= hot"):
        AttentionCheckConfig(top_k=20, hot=16)
    with pytest.raises(ValueError, match="tail must be >= spec_steps"):
        AttentionCheckConfig(spec_steps=5, tail=4)
    check = SparseAttentionCheck(AttentionCheckConfig(context=90, max_len=96, spec_steps=2), device)
    with pytest.raises(ValueError, match=r"spec_steps must be an int in \[1, tail = 4\]"):
        check.step(spec_steps=5)
    check.step()
    with pytest.raises(ValueError, match="outgrew max_len"):
        for _ in range(10):
            check.step(spec_steps=4)
