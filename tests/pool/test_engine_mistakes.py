"""An engine's mistakes through the native API (pool and ``HotBufferState``): each is refused before anything is
launched, with a message naming the fix, or ends in the documented safe outcome; none serves a wrong row silently.
"""

from __future__ import annotations

import pytest
import torch

from kvplan import HotBufferState, PlanBufferPool, PoolCapacityError, PoolConfig, StateCheckError
from kvplan.counters import read_counters

I32 = torch.int32


def _long_request(device, *, check=False, scratch=None, steps=None, top_k=None):
    """One long request (30 tokens, HOT = 8) whose tail holds its newest token, a pool and the step's buffers."""
    state = HotBufferState.allocate(1, hot=8, tail=3, max_len=64, device=device, scratch=scratch, steps=steps,
                                    top_k=top_k)  # fmt: skip
    state.admit(0, torch.arange(30) + 100)
    state.write_tail(0, [29])
    pool = PlanBufferPool(device, config=PoolConfig(check=check))
    pool.ensure_capacity(batch=1, num_steps=steps or 1, top_k=4)
    host = torch.arange(200, dtype=torch.float32).view(200, 1).to(device)  # row r holds r
    dev = torch.full((state.device_rows, 1), -5.0, device=device)
    return state, pool, host, dev


def _tables(state):
    return [getattr(state, name).clone() for name in ("device_buffer_tokens", "lru_slots", "host_cache_locs")]


# ---------------------------------------------------------------------------------------------------------------------
# A request that grew without write_tail: its tail's newest token is an older one


@pytest.mark.parametrize("check", [False, True], ids=["plain", "checked"])
def test_a_grown_request_without_write_tail_is_refused_before_the_single_step_launch(device, check):
    state, pool, host, dev = _long_request(device, check=check)
    tokens = torch.tensor([[29, 1, 2, 3]], dtype=I32, device=device)
    out = torch.empty_like(tokens)
    rids = torch.tensor([0], device=device)
    pool.swap_in(state, tokens, out, rids, torch.tensor([30], device=device), host, dev)
    state.append(0, 30, [130])  # token 30 committed; the engine forgets write_tail(0, [30])
    tokens = torch.tensor([[30, 1, 2, 3]], dtype=I32, device=device)
    out.fill_(-9)
    before, counters, rows = _tables(state), read_counters(pool.counters), dev.clone()
    with pytest.raises(
        StateCheckError,
        match=r"request slot 0's tail is stale: state.append backed its tokens up "
        r"to 30, but its tail holds newest token 29 .*Call state.write_tail\(0, \[newest, drafts",
    ):
        pool.swap_in(state, tokens, out, rids, torch.tensor([31], device=device), host, dev)
    assert (out == -9).all() and torch.equal(dev, rows) and read_counters(pool.counters) == counters
    assert all(torch.equal(a, b) for a, b in zip(before, _tables(state)))  # nothing launched
    state.write_tail(0, [30])  # the fix: the step now serves token 30 from the tail
    dev[state.device_buffer_locs[0, 8].long()] = 130.0  # (its KV, written by the engine's forward pass)
    pool.swap_in(state, tokens, out, rids, torch.tensor([31], device=device), host, dev)
    assert dev[out[0, 0].long()].item() == 130.0


@pytest.mark.parametrize("impl", ["kernels", "ops"])
def test_the_kernels_swap_in_refuses_a_stale_tail_as_the_pool_does(device, impl):
    """The native API's other entry points (kvplan.kernels.swap_in, and kvplan.ops.swap_in with the kernels' text:
    the caller's own plan) read the same host records: a grown request without write_tail is refused before anything
    is written."""
    import kvplan.kernels
    import kvplan.ops

    swap_in = (kvplan.ops if impl == "ops" else kvplan.kernels).swap_in
    state, _, host, dev = _long_request(device)
    state.append(0, 30, [130])  # token 30 committed; write_tail(0, [30]) forgotten
    tokens = torch.tensor([[30, 1, 2, 3]], dtype=I32, device=device)
    out = torch.full_like(tokens, -9)
    before, rows = _tables(state), dev.clone()
    with pytest.raises(StateCheckError, match=r"^kvplan.kernels.swap_in: request slot 0's tail is stale"):
        swap_in(state, tokens, out, torch.tensor([0], device=device), torch.tensor([31], device=device), host, dev)
    assert (
        (out == -9).all() and torch.equal(dev, rows) and all(torch.equal(a, b) for a, b in zip(before, _tables(state)))
    )
    state.write_tail(0, [30])
    swap_in(state, tokens, out, torch.tensor([0], device=device), torch.tensor([31], device=device), host, dev)
    assert out[0, 0].item() == state.device_buffer_locs[0, 8].item()  # the newest token from its tail slot


@pytest.mark.parametrize("impl", ["kernels", "ops"])
def test_the_block_swap_in_refuses_a_stale_tail_before_its_record_is_built(device, impl):
    """``swap_in_blocks`` of kvplan.kernels and kvplan.ops (the kernels' text) run the same rule first: a stale tail
    is named before any argument (here a ``sparse_block_size`` the record refuses) and nothing is written."""
    import kvplan.kernels
    import kvplan.ops

    swap_in_blocks = (kvplan.ops if impl == "ops" else kvplan.kernels).swap_in_blocks
    state, _, host, dev = _long_request(device)
    state.append(0, 30, [130])  # write_tail(0, [30]) forgotten
    blocks, out = torch.tensor([[15, 0]], dtype=I32, device=device), torch.full((1, 4), -9, dtype=I32, device=device)
    call = (state, blocks, out, torch.tensor([0], device=device), torch.tensor([31], device=device), host, host, dev,
            dev.clone())  # fmt: skip
    before = _tables(state)
    for size in (2, None):
        with pytest.raises(StateCheckError, match=r"^kvplan.kernels.swap_in_blocks: request slot 0's tail is stale"):
            swap_in_blocks(*call, sparse_block_size=size)
    assert (out == -9).all() and all(torch.equal(a, b) for a, b in zip(before, _tables(state)))
    state.write_tail(0, [30])
    with pytest.raises(TypeError, match="sparse_block_size must be an int >= 1"):  # (the control: then the record's)
        swap_in_blocks(*call, sparse_block_size=None)


def test_a_stale_tail_is_refused_on_the_speculative_path_too(device):
    """A rejected draft still in the tail would be served as the committed token of the same position."""
    state, pool, host, dev = _long_request(device, steps=2, top_k=4)
    state.write_tail(0, [29, 30])  # newest 29, draft 30
    state.append(0, 30, [130, 131])  # tokens 30 and 31 committed (30 may differ from the draft)
    tokens = torch.tensor([[[31, 30, 1, 2], [32, 31, 3, 4]]], dtype=I32, device=device)
    with pytest.raises(StateCheckError, match=r"tail is stale.*backed its tokens up to 31"):
        pool.swap_in(state, tokens, torch.empty_like(tokens), torch.tensor([0], device=device),
                     torch.tensor([32, 33], device=device), host, dev)  # fmt: skip
    assert "tail is stale" in _message(lambda: state.check())  # state.check (no step) names it too


def test_tails_written_as_documented_are_never_called_stale():
    state = HotBufferState.allocate(2, hot=4, tail=3, max_len=64)
    state.admit(0, range(10))
    state.write_tail(0, [9, 10])  # newest token 9, backed up to 9
    state.write_tail(1, [5])  # (a slot without a request: nothing backed)
    state.append(0, 10, [10])  # token 10 backed before the next write_tail: stale until it comes
    assert state.lifecycle.stale == {0}
    state.write_tail(0, torch.tensor([10, 11]))  # a CPU tensor is read on the host
    assert not state.lifecycle.stale
    state.write_tail(0, [11])  # the tail ahead of the backed tokens (their host rows lag): fine
    state.append(0, 11, [11])
    assert not state.lifecycle.stale
    state.set_host_rows(1, range(40))  # host rows set ahead of a request's length are not a growth
    state.fill_short(1, 3, range(3))
    state.append(1, 3, range(3, 12))  # a short request that grew: its tail was emptied by fill_short (unknown)
    assert not state.lifecycle.stale
    state.append(0, 12, [12])
    state.finish(0)  # a finished request is not stale
    assert not state.lifecycle.stale
    state.check()


# ---------------------------------------------------------------------------------------------------------------------
# A device_buffer smaller than the state's device rows


@pytest.mark.parametrize("steps", [1, 2])
def test_a_device_buffer_smaller_than_the_states_rows_is_refused_before_launching(device, steps):
    state = HotBufferState.allocate(3, hot=8, tail=2, max_len=64, device=device, steps=2, top_k=4)
    for rid in range(3):
        state.admit(rid, torch.arange(30) + 64 * rid)
        state.write_tail(rid, [29, 30][:steps])
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=3, num_steps=steps, top_k=4)
    need = state.device_rows if steps > 1 else 3 * state.width  # the single-step path uses no scratch rows
    shape = (3, steps, 4) if steps > 1 else (3, 4)
    tokens = torch.arange(20, 24, dtype=I32, device=device).expand(*shape).contiguous()
    out = torch.full(shape, -9, dtype=I32, device=device)
    rids, lens = torch.arange(3, device=device), (torch.arange(steps) + 30).repeat(3).to(device)
    host = torch.randn(192, 2, device=device)
    small = torch.zeros(need - 1, 2, device=device)
    before = _tables(state)
    with pytest.raises(ValueError, match=rf"pool.swap_in: device_buffer has {need - 1} rows, but the state's tables "
                       rf"name {need} device rows.*Allocate device_buffer with state.device_rows = "
                       rf"{state.device_rows} rows"):  # fmt: skip
        pool.swap_in(state, tokens, out, rids, lens, host, small)
    assert (out == -9).all() and not small.any() and all(torch.equal(a, b) for a, b in zip(before, _tables(state)))
    with pytest.raises(
        ValueError, match="top_k_tokens must be torch.int32, got torch.int64"
    ):  # the engines' text first
        pool.swap_in(state, tokens.long(), out, rids, lens, host, small)
    pool.swap_in(state, tokens, out, rids, lens, host, torch.zeros(need, 2, device=device))  # enough rows


# ---------------------------------------------------------------------------------------------------------------------
# A plan replayed after the next swap-in of the same shape


def test_a_plan_is_refused_after_the_next_swap_in_of_the_same_shape(device):
    state, pool, host, dev = _long_request(device)
    out = torch.empty(1, 4, dtype=I32, device=device)
    call = (torch.tensor([0], device=device), torch.tensor([30], device=device), host, dev)
    first = pool.swap_in(state, torch.tensor([[20, 21, 22, 23]], dtype=I32, device=device), out, *call)
    layer = torch.zeros_like(dev)
    pool.replay(first, host_cache=host, device_buffer=layer)  # before the next swap-in: accepted
    second = pool.swap_in(state, torch.tensor([[10, 11, 12, 13]], dtype=I32, device=device), out, *call)
    layer.zero_()
    counters = read_counters(pool.counters)
    with pytest.raises(PoolCapacityError, match=r"pool.replay: the plan \(\[1, 4\]\) is not the handle of the pool's "
                       r"latest swap-in: a plan is good until the pool's next swap-in"):  # fmt: skip
        pool.replay(first, host_cache=host, device_buffer=layer)
    assert not layer.any() and read_counters(pool.counters) == counters  # nothing copied
    pool.replay(second, host_cache=host, device_buffer=layer)  # this step's plan replays its own rows
    assert sorted(layer[layer != 0].tolist()) == [110.0, 111.0, 112.0, 113.0]
    assert pool.miss_plan(1, 1, 4) is pool.miss_plan(1, 1, 4)  # (the views stay cached per shape)
    pool.replay(second, host_cache=host, device_buffer=layer)  # handing out its views again keeps it valid


# ---------------------------------------------------------------------------------------------------------------------
# Tokens the state was never told about (no append), and two rows on one request slot


@pytest.mark.parametrize("check", [False, True], ids=["state.check", "checked"])
def test_tokens_past_what_the_state_backs_are_named(device, check):
    state, pool, host, dev = _long_request(device, check=check)
    state.write_tail(0, [39])  # the request is at 40 tokens: append(0, 30, ...) forgotten
    tokens = torch.tensor([[35, 36, 37, 2]], dtype=I32, device=device)
    out = torch.full_like(tokens, -9)
    rids, lens = torch.tensor([0], device=device), torch.tensor([40], device=device)
    pattern = r"token 30 \(of 9 below its newest token 39\) has no host row .*Call state.append\(rid, start, host_rows"
    before = _tables(state)
    with pytest.raises(StateCheckError, match=pattern):
        if check:
            pool.swap_in(state, tokens, out, rids, lens, host, dev)
        else:
            state.check(rids, lens)
    assert (out == -9).all() and all(torch.equal(a, b) for a, b in zip(before, _tables(state)))
    state.append(0, 30, torch.arange(130, 139))
    pool.swap_in(state, tokens, out, rids, lens, host, dev)  # the fix
    assert (out >= 0).all() and int(pool.overflow) == 0


def test_two_real_rows_on_one_request_slot_are_refused_before_the_checked_launch(device):
    state, pool, host, dev = _long_request(device, check=True)
    pool.ensure_capacity(batch=2, top_k=4)
    tokens = torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]], dtype=I32, device=device)
    out = torch.full_like(tokens, -9)
    rids, lens = torch.tensor([0, 0], device=device), torch.tensor([30, 30], device=device)
    before, rows = _tables(state), dev.clone()
    with pytest.raises(StateCheckError, match=r"batch rows 0 and 1 both name request slot 0: the real rows of a step "
                       r"have distinct request slots"):  # fmt: skip
        pool.swap_in(state, tokens, out, rids, lens, host, dev)
    assert (
        (out == -9).all() and torch.equal(dev, rows) and all(torch.equal(a, b) for a, b in zip(before, _tables(state)))
    )
    with pytest.raises(StateCheckError, match="both name request slot 0"):
        state.check(rids, lens)
    state.check(rids, lens, num_real_reqs=torch.tensor([1], dtype=I32))  # the second row as padding: fine


def test_step_major_seq_lens_are_named_request_major():
    state = HotBufferState.allocate(2, hot=8, tail=3, max_len=64, steps=2, top_k=4)
    state.admit(0, range(30))
    state.write_tail(0, [29, 30])
    state.admit(1, range(64, 84))
    state.write_tail(1, [19, 20])
    rids = torch.tensor([0, 1])
    with pytest.raises(StateCheckError, match=r"lengths \[30, 20\], which decrease: seq_lens is request-major"):
        state.check(rids, torch.tensor([30, 20, 31, 21]), steps=2)  # step-major
    state.check(rids, torch.tensor([30, 31, 20, 21]), steps=2)


def _message(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the message is what is compared)
        return str(error)
    return ""
