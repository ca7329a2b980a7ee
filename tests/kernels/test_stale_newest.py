"""The single-step newest token when the engine forgot ``write_tail`` (issue 43 item 1; docs/kernels.md §2 rule 11).

Slot ``HOT`` serves the newest token (``seq_len - 1``) unless ``device_buffer_tokens[rid, HOT]`` names another token; a
stale tail (the previous step's token still there, written on the device, so no host record knows) resolves to ``-1``:
the native API never hands out a row whose table says it holds another token. An empty slot (``-1``) names none: the
contract's step 1 holds there. ``check_newest=False`` is SGLang's rule
(slot ``HOT`` whatever it holds), the adapter's. The reference defines both and every kernel equals it: the Triton
resolve's three paths here (interpreter), the on-chip resolve and the compiled Triton resolve on a GPU (``gpu``).
The block front end (``swap_in_blocks``, docs/kernels.md §2a) follows the same rule for the place of the newest token.
"""

from __future__ import annotations

import pytest
import torch
from helpers.block_scenarios import assert_same_blocks, build_blocks, run_blocks
from helpers.swap_in_scenarios import PATHS, assert_same, build, run, small_launch

from kvplan import PlanBufferPool, kernels, reference
from kvplan.kernels import hisparse, planner

STALE_ROWS = (0, 2)
EMPTY_ROWS = (1,)  # slot HOT empty (-1): it names no other token, so the newest token is served from it (step 1)


def _stale(seed: int, device: torch.device | str = "cpu", **sizes):
    """A single-step call whose rows 0 and 2 want their newest token while slot HOT still names the token before."""
    shape = dict(batch=4, top_k=16, hot=24, tail=2, lens=[60, 80, 70, 90], max_len=128, requests=6)
    shape.update(sizes)
    scn = build(seed=seed, speculative=False, newest_rate=0.3, miss_rate=0.4, device=device, **shape)
    hot = scn.state.hot
    for b in range(scn.batch):
        rid, newest = int(scn.req_pool_indices[b]), int(scn.seq_lens[b]) - 1
        scn.top_k_tokens[b, 0] = newest  # every row wants its newest token
        if b in STALE_ROWS:  # the forgotten write_tail, on the device: no host record knows
            scn.state.device_buffer_tokens[rid, hot] = newest - 1
        elif b in EMPTY_ROWS:
            scn.state.device_buffer_tokens[rid, hot] = -1
    return scn


class _Sglang:
    """An implementation's swap-in under SGLang's rule (the adapter's ``check_newest=False``)."""

    def __init__(self, impl) -> None:
        self.impl = impl

    def swap_in(self, *args, **kwargs):
        return self.impl.swap_in(*args, **kwargs, check_newest=False)

    def swap_in_blocks(self, *args, **kwargs):
        return self.impl.swap_in_blocks(*args, **kwargs, check_newest=False)


def _rules(impl, sglang: bool):
    return _Sglang(impl) if sglang else impl


def test_the_reference_serves_no_row_its_table_says_holds_another_token():
    scn = _stale(1)
    native, sglang = run(reference, scn), run(_Sglang(reference), scn)
    hot = scn.state.hot
    for b in range(scn.batch):
        rid = int(scn.req_pool_indices[b])
        slot_hot = int(scn.state.device_buffer_locs[rid, hot])
        assert int(sglang.out[b, 0]) == slot_hot  # SGLang's rule: slot HOT, whatever it holds
        assert int(native.out[b, 0]) == (-1 if b in STALE_ROWS else slot_hot)  # EMPTY_ROWS too: slot HOT
    assert all(int(native.out[b, 0]) >= 0 for b in EMPTY_ROWS)
    # nothing else differs: the stale newest token is not looked up, not copied, not counted
    keep = torch.ones_like(native.out, dtype=torch.bool)
    keep[list(STALE_ROWS), 0] = False
    keep &= native.out != -1  # (a repeat of the newest token in its row resolves the same way)
    assert torch.equal(native.out[keep], sglang.out[keep])
    assert torch.equal(native.device_buffer_tokens, sglang.device_buffer_tokens)
    assert torch.equal(native.miss_count, sglang.miss_count) and torch.equal(native.counters, sglang.counters)


@pytest.mark.parametrize("sglang", [False, True], ids=["native", "sglang"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_triton_resolve_equals_the_reference_on_stale_tails(monkeypatch, path, sglang):
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
    scn = _stale(2)
    assert_same(run(_rules(kernels, sglang), scn, workspace=True), run(_rules(reference, sglang), scn))


def _served_rows_hold_their_tokens(state, tokens, out, rids) -> None:
    """Every row handed out holds the token its slot's table entry names (rows of an allocated state: r * W + j), or
    is slot HOT's with an empty entry (-1 names no other token: the contract's step 1 serves the newest token there)."""
    table = state.device_buffer_tokens.cpu().flatten()
    for b, rid in enumerate(rids.tolist()):
        row_out, row_tok = out[b].cpu(), tokens[b].cpu()
        served = row_out >= 0
        assert (row_out[served] // state.width == rid).all()
        held = table[row_out[served].long()]
        empty_hot = (held == -1) & (row_out[served] % state.width == state.hot)
        assert ((held == row_tok[served]) | empty_hot).all(), f"row {b} serves another token's row"


def test_the_pool_never_hands_out_a_row_naming_another_token():
    scn = _stale(3)
    pool = PlanBufferPool("cpu")
    pool.ensure_capacity(batch=scn.batch, top_k=scn.top_k_tokens.shape[1])
    state, out = scn.state.clone(), torch.full_like(scn.top_k_tokens, -7)
    pool.swap_in(state, scn.top_k_tokens, out, scn.req_pool_indices, scn.seq_lens, scn.host_cache,
                 scn.device_buffer.clone())  # fmt: skip
    _served_rows_hold_their_tokens(state, scn.top_k_tokens, out, scn.req_pool_indices)
    assert (out[list(STALE_ROWS), 0] == -1).all()


def test_check_newest_must_be_a_bool():
    scn = _stale(4)
    with pytest.raises(TypeError, match=r"check_newest must be a bool, got int 1"):
        run(type("Impl", (), {"swap_in": staticmethod(lambda *a, **k: kernels.swap_in(*a, **k, check_newest=1))}), scn)


# ---------------------------------------------------------------------------------------------------------------------
# The block front end (docs/kernels.md §2a): the newest token's place, whatever block and column it falls in


def _stale_blocks(seed: int, device: torch.device | str = "cpu", **sizes):
    """A block selection whose every row selects its newest token's block, rows 0 and 2 with slot HOT still naming
    the token before (block 4: the newest token at column ``(L - 1) % 4`` of that block)."""
    shape = dict(batch=4, num_blocks=4, block=4, hot=24, tail=2, lens=[62, 80, 71, 93], max_len=128, requests=6)
    shape.update(sizes)
    scn = build_blocks(seed=seed, newest_rate=0.3, device=device, **shape)
    hot = scn.base.state.hot
    for b in range(scn.batch):
        rid, newest = int(scn.base.req_pool_indices[b]), int(scn.base.seq_lens[b]) - 1
        scn.top_k_blocks[b, 0] = newest // scn.block
        if b in STALE_ROWS:  # the forgotten write_tail, on the device: no host record knows
            scn.base.state.device_buffer_tokens[rid, hot] = newest - 1
    return scn


def _newest_places(scn, b: int) -> torch.Tensor:
    """The columns of row ``b``'s output that hold its newest token (each block naming it)."""
    newest = int(scn.base.seq_lens[b]) - 1
    return (scn.top_k_blocks[b].cpu().long() == newest // scn.block).nonzero().flatten() * scn.block + (
        newest % scn.block
    )


def test_the_reference_block_front_end_serves_no_row_its_table_says_holds_another_token():
    scn = _stale_blocks(11)
    native, sglang = run_blocks(reference, scn), run_blocks(_Sglang(reference), scn)
    hot = scn.base.state.hot
    keep = torch.ones_like(native.k.out, dtype=torch.bool)
    for b in range(scn.batch):
        rid = int(scn.base.req_pool_indices[b])
        slot_hot = int(scn.base.state.device_buffer_locs[rid, hot])
        places = _newest_places(scn, b)
        assert places.numel() >= 1
        assert (sglang.k.out[b, places] == slot_hot).all()  # SGLang's rule: slot HOT, whatever it holds
        assert (native.k.out[b, places] == (-1 if b in STALE_ROWS else slot_hot)).all()
        keep[b, places] = False
    # nothing else differs: the stale newest token is not looked up, not copied, not counted
    assert torch.equal(native.k.out[keep], sglang.k.out[keep])
    assert torch.equal(native.k.device_buffer_tokens, sglang.k.device_buffer_tokens)
    assert torch.equal(native.k.miss_count, sglang.k.miss_count) and torch.equal(native.k.counters, sglang.k.counters)
    assert torch.equal(native.device_buffer_v, sglang.device_buffer_v)


@pytest.mark.parametrize("sglang", [False, True], ids=["native", "sglang"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_triton_block_resolve_equals_the_reference_on_stale_tails(monkeypatch, path, sglang):
    monkeypatch.setattr(hisparse, "RESOLVE_LAUNCH", small_launch(path))
    scn = _stale_blocks(12)
    assert_same_blocks(
        run_blocks(_rules(kernels, sglang), scn, workspace=True), run_blocks(_rules(reference, sglang), scn)
    )


def test_the_pool_block_front_end_never_hands_out_a_row_naming_another_token():
    scn = _stale_blocks(13)
    base = scn.base
    pool = PlanBufferPool("cpu")
    pool.ensure_capacity(batch=scn.batch, top_k=scn.tokens)
    state, out = base.state.clone(), torch.full((scn.batch, scn.tokens), -7, dtype=torch.int32)
    pool.swap_in_blocks(state, scn.top_k_blocks, out, base.req_pool_indices, base.seq_lens, base.host_cache,
                        scn.host_cache_v, base.device_buffer.clone(), scn.device_buffer_v.clone(),
                        sparse_block_size=scn.block)  # fmt: skip
    tokens = reference.expand_blocks(scn.top_k_blocks, scn.block).to(torch.int32)
    _served_rows_hold_their_tokens(state, tokens, out, base.req_pool_indices)
    for b in STALE_ROWS:
        assert (out[b, _newest_places(scn, b)] == -1).all()


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the on-chip resolve and the compiled Triton resolve


@pytest.mark.gpu
@pytest.mark.parametrize("sglang", [False, True], ids=["native", "sglang"])
@pytest.mark.parametrize("resolve", ["onchip", "triton"])
@pytest.mark.parametrize("batch", [4, 6, 40])
def test_gpu_resolves_equal_the_reference_on_stale_tails(monkeypatch, resolve, batch, sglang):
    monkeypatch.setenv(planner.RESOLVE_ENV, resolve)
    lens = [60 + 7 * b for b in range(batch)]
    scn = _stale(5 + batch, "cuda", batch=batch, lens=lens, requests=batch + 2)
    assert_same(run(_rules(kernels, sglang), scn, workspace=True), run(_rules(reference, sglang), scn))


@pytest.mark.gpu
@pytest.mark.parametrize("sglang", [False, True], ids=["native", "sglang"])
@pytest.mark.parametrize("resolve", ["onchip", "triton"])
@pytest.mark.parametrize("batch", [4, 6, 40])
def test_gpu_block_resolves_equal_the_reference_on_stale_tails(monkeypatch, resolve, batch, sglang):
    monkeypatch.setenv(planner.RESOLVE_ENV, resolve)
    lens = [62 + 7 * b for b in range(batch)]
    scn = _stale_blocks(15 + batch, "cuda", batch=batch, lens=lens, requests=batch + 2)
    assert_same_blocks(
        run_blocks(_rules(kernels, sglang), scn, workspace=True), run_blocks(_rules(reference, sglang), scn)
    )
