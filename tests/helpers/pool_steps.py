"""Hot-buffer states and swap-in calls shared by the pool's tests: ``_setup``/``_run``, a small call through the pool
or the reference (tests/pool/test_pool_launches.py and the hostile and checked-mode tests), and ``_worst_case``, a
request with as many misses as a call can have (tests/state/test_lifecycle.py and the checked-mode tests)."""

from __future__ import annotations

import torch

from kvplan import HotBufferState

I32 = torch.int32


def _setup(device, batch=2, steps=2, top_k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = HotBufferState.allocate(num_reqs=4, hot=8, tail=3, max_len=64, device=device, scratch=2)
    for rid in range(4):
        state.set_host_rows(rid, torch.arange(40) + rid * 64)
        state.write_tail(rid, [29, 30, 31][:steps])
    host = torch.randint(0, 1000, (4 * 64, 6), dtype=torch.int32, generator=gen).to(device)
    dev = torch.zeros(state.device_rows, 6, dtype=torch.int32, device=device)
    tokens = torch.randint(-1, 31, (batch, steps, top_k), dtype=torch.int32, generator=gen).to(device)
    rids = torch.tensor([3, 1, 0, 2][:batch], device=device)
    seq_lens = (torch.arange(steps) + 30).repeat(batch).to(device)
    return state, host, dev, tokens, rids, seq_lens


def _run(pool_or_ref, state, host, dev, tokens, rids, seq_lens, spec):
    """The launch's output and keyword arguments; the state (with scratch rows) serves both paths as it is."""
    out = torch.full(tokens.shape if spec else tokens.shape[::2], -9, dtype=torch.int32, device=dev.device)
    kwargs = dict(
        state=state,
        top_k_tokens=tokens if spec else tokens[:, 0],
        top_k_device_locs=out,
        req_pool_indices=rids,
        seq_lens=seq_lens if spec else seq_lens.view(len(rids), -1)[:, 0].contiguous(),
        host_cache=host,
        device_buffer=dev,
    )
    return out, kwargs


def _worst_case(hot: int, steps: int, top_k: int, scratch: int, seed: int, device="cpu", hits: int | None = None):
    """A long request whose hot slots hold tokens 0 .. HOT-1, and per draft step ``hits`` of them (the same ones)
    plus distinct fresh tokens: as many misses as a call can have beside those hits (``hits=0``: the most)."""
    gen = torch.Generator().manual_seed(seed)
    length = hot + steps * top_k + 50
    state = HotBufferState.allocate(1, hot, steps + 1, length + steps, device, scratch=scratch)
    state.admit(0, torch.arange(length) + 1000)
    if hits is None:
        hits = int(torch.randint(0, min(hot, top_k) + 1, (1,), generator=gen))
    state.set_hot(0, torch.randperm(hot, generator=gen).to(I32) + 0, None)  # hot holds tokens 0 .. hot-1
    fresh = (hot + torch.randperm(length - hot - 1, generator=gen)[: steps * top_k]).to(I32).view(steps, top_k)
    fresh[:, :hits] = torch.randperm(hot, generator=gen)[:hits].to(I32)  # the same hits at every step
    state.write_tail(0, torch.arange(length - 1, length - 1 + steps))
    return state, fresh.unsqueeze(0).contiguous(), torch.full((steps,), length, dtype=torch.int64)
