"""Block-selection swap-in scenarios (docs/kernels.md §2a): the state of ``swap_in_scenarios.build`` with a block
selection drawn over it, K and V caches, and a runner that calls ``impl.swap_in_blocks`` on private copies.

The selection mixes blocks holding hot tokens, cold blocks (misses), the newest token's block, ``-1`` and other
negative ids, blocks past the row's length and repeated blocks, at given rates."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from helpers.swap_in_scenarios import Guard, Result, Scenario, build, random_rows
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.workspace import swap_in_workspace_columns

I32, I64 = torch.int32, torch.int64


@attrs.define
class BlockScenario:
    base: Scenario  # its state, K rows (host_cache, device_buffer), lengths, request slots, num_real_reqs
    top_k_blocks: Tensor
    block: int
    host_cache_v: Tensor
    device_buffer_v: Tensor

    @property
    def batch(self) -> int:
        return self.top_k_blocks.shape[0]

    @property
    def tokens(self) -> int:
        return self.top_k_blocks.shape[1] * self.block


@attrs.define
class BlockResult:
    k: Result  # outputs, state, plan, K rows, counters
    device_buffer_v: Tensor


def build_blocks(
    *,
    seed: int,
    batch: int,
    num_blocks: int,
    block: int,
    hot: int,
    tail: int,
    lens: list[int],
    max_len: int,
    none_rate: float = 0.15,
    past_rate: float = 0.1,
    dup_rate: float = 0.1,
    newest_rate: float = 0.15,
    item_bytes: int = 16,
    dtype: torch.dtype = torch.uint8,
    device: torch.device | str = "cpu",
    **common,
) -> BlockScenario:
    """``batch`` rows selecting ``num_blocks`` blocks of ``block`` tokens each; ``common`` goes to ``build``."""
    base = build(seed=seed, speculative=False, batch=batch, top_k=num_blocks * block, hot=hot, tail=tail, lens=lens,
                 max_len=max_len, item_bytes=item_bytes, dtype=dtype, device=device, **common)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 7)
    blocks = torch.full((batch, num_blocks), -1, dtype=I64)
    for b in range(batch):
        length = lens[b]
        count = max(-(-length // block), 1)  # blocks the row has (the last one may be partial)
        rid = int(base.req_pool_indices[b])
        hot_tokens = base.state.device_buffer_tokens[rid, :hot].cpu().to(I64)
        hot_tokens = hot_tokens[(hot_tokens >= 0) & (hot_tokens < length)]
        row = torch.randint(count, (num_blocks,), generator=gen)
        if hot_tokens.numel():  # about half the blocks hold a hot token (hits), the rest drawn anywhere (misses)
            pick = hot_tokens[torch.randint(hot_tokens.numel(), (num_blocks,), generator=gen)] // block
            row = torch.where(torch.rand(num_blocks, generator=gen) < 0.5, pick, row)
        u = torch.rand(num_blocks, generator=gen)
        row = torch.where(u < newest_rate, torch.full_like(row, (length - 1) // block), row)
        none = (u >= newest_rate) & (u < newest_rate + none_rate)
        row = torch.where(none, -1 - (torch.rand(num_blocks, generator=gen) < 0.3).long() * 5, row)  # -1, some -6
        past = (u >= newest_rate + none_rate) & (u < newest_rate + none_rate + past_rate)
        row = torch.where(past, count + torch.randint(3, (num_blocks,), generator=gen), row)
        dup = torch.rand(num_blocks, generator=gen) < dup_rate
        dup[:1] = False
        source = (torch.rand(num_blocks, generator=gen) * torch.arange(num_blocks)).long()
        blocks[b] = torch.where(dup, row[source], row)
    host_v = random_rows(base.host_cache.shape[0], item_bytes, dtype, seed=seed + 11, device=device)
    dev_v = random_rows(base.device_buffer.shape[0], item_bytes, dtype, seed=seed + 12, device=device)
    return BlockScenario(base, blocks.to(I32).to(device), block, host_v, dev_v)


def run_blocks(
    impl,
    scn: BlockScenario,
    *,
    plan: bool = True,
    workspace: bool | Tensor = False,
    guard: Guard | None = None,
    state: HotBufferState | None = None,
    device_buffers: tuple[Tensor, Tensor] | None = None,
) -> BlockResult:
    """Call ``impl.swap_in_blocks`` on copies (or on the given state and K/V device buffers, mutated in place)."""
    base = scn.base
    state = state if state is not None else base.state.clone()
    dev_k, dev_v = device_buffers if device_buffers is not None else (base.device_buffer.clone(),
                                                                         scn.device_buffer_v.clone())  # fmt: skip
    dev = scn.top_k_blocks.device
    batch, n = scn.batch, max(scn.tokens, 1)
    out = torch.full((batch, scn.tokens), -7, dtype=I32, device=dev)
    miss_src = torch.full((batch, n), -9, dtype=I64, device=dev)
    miss_dst = torch.full((batch, n), -9, dtype=I32, device=dev)
    miss_count = torch.full((batch,), -9, dtype=I32, device=dev)
    counters = new_counters(dev)
    host_k, host_v = base.host_cache, scn.host_cache_v
    call_state, call_k, call_v = state, dev_k, dev_v
    if guard is not None:
        out = guard.embed("top_k_device_locs", out, -3)
        tables = {
            "device_buffer_tokens": guard.embed("device_buffer_tokens", state.device_buffer_tokens, 1),
            "device_buffer_locs": guard.embed("device_buffer_locs", state.device_buffer_locs, 2),
            "lru_slots": guard.embed("lru_slots", state.lru_slots, 0, row_pad=5),
            "host_cache_locs": guard.embed("host_cache_locs", state.host_cache_locs, 1, row_pad=4),
            "scratch_locs": None,
        }
        call_state = HotBufferState(**tables)
        # K and V rows share one row pitch: the same padding for both
        call_k = guard.embed("device_buffer_k", dev_k, 5, row_pad=1)
        call_v = guard.embed("device_buffer_v", dev_v, 6, row_pad=1)
        host_k = guard.embed("host_cache_k", host_k.to(dev), 7, row_pad=1)
        host_v = guard.embed("host_cache_v", host_v.to(dev), 8, row_pad=1)
        miss_src = guard.embed("miss_src", miss_src, -5)
        miss_dst = guard.embed("miss_dst", miss_dst, -5)
        miss_count = guard.embed("miss_count", miss_count, -5)
        counters = guard.embed("counters", counters, 0)
    kwargs = dict(num_real_reqs=base.num_real_reqs, counters=counters, sparse_block_size=scn.block)
    if plan:
        kwargs["plan"] = MissPlan(miss_src, miss_dst, miss_count)
    if isinstance(workspace, Tensor):
        kwargs["workspace"] = workspace
    elif workspace:
        columns = swap_in_workspace_columns(1, scn.tokens)
        kwargs["workspace"] = torch.full((batch, columns), -11, dtype=I64, device=dev)
    impl.swap_in_blocks(call_state, scn.top_k_blocks, out, base.req_pool_indices, base.seq_lens, host_k, host_v,
                        call_k, call_v, **kwargs)  # fmt: skip
    if guard is not None:
        state.device_buffer_tokens.copy_(call_state.device_buffer_tokens)
        state.lru_slots.copy_(call_state.lru_slots)
        dev_k.copy_(call_k)
        dev_v.copy_(call_v)
    k = Result(
        out=out.cpu(),
        device_buffer_tokens=state.device_buffer_tokens.cpu(),
        lru_slots=state.lru_slots.cpu(),
        device_buffer=dev_k.cpu(),
        miss_src=miss_src.cpu(),
        miss_dst=miss_dst.cpu(),
        miss_count=miss_count.cpu(),
        counters=counters.cpu(),
        miss_ordered=True,
    )
    return BlockResult(k, dev_v.cpu())


def assert_same_blocks(kernel: BlockResult, ref: BlockResult) -> None:
    """Exact equality on everything the contract defines, the V rows included."""
    from helpers.swap_in_scenarios import assert_same

    assert_same(kernel.k, ref.k)
    assert torch.equal(kernel.device_buffer_v.view(torch.uint8), ref.device_buffer_v.view(torch.uint8)), "V rows"
