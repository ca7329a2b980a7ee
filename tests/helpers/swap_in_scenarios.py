"""Swap-in scenarios shared by the kernel tests (CPU, interpreter) and the GPU suite (production shapes).

``build(...)`` makes a random but controlled call: per batch row a request (``rids`` permute batch rows and request
slots), a hot region of distinct tokens in a random LRU order, the newest token and draft tokens in the tail, and a
top-k mixing hits, misses, duplicates, invalid and newest tokens at given rates. ``run(...)`` calls an implementation
(``kvplan.kernels`` or ``kvplan.reference``) on private copies of every mutable tensor and returns what it wrote;
with ``guard=True`` every tensor is embedded in a larger one whose padding (before, after and between rows) must come
back untouched, and read-only tables are padded with plausible values so an out-of-bounds read shows up as a
difference from the reference. Everything is vectorised per row, so production shapes build in seconds.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from helpers.plans import assert_host_row_order, assert_same_plan_rows
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.state import HotBufferState
from kvplan.workspace import swap_in_workspace_columns

I32, I64 = torch.int32, torch.int64


@attrs.define
class Scenario:
    speculative: bool
    state: HotBufferState
    host_cache: Tensor
    device_buffer: Tensor
    top_k_tokens: Tensor
    seq_lens: Tensor
    req_pool_indices: Tensor
    num_real_reqs: Tensor | None

    @property
    def batch(self) -> int:
        return self.top_k_tokens.shape[0]

    @property
    def occurrences(self) -> int:
        return self.top_k_tokens[0].numel() if self.batch else 0


@attrs.define
class Result:
    """What one implementation wrote (CPU copies)."""

    out: Tensor
    device_buffer_tokens: Tensor
    lru_slots: Tensor
    device_buffer: Tensor
    miss_src: Tensor
    miss_dst: Tensor
    miss_count: Tensor
    counters: Tensor
    host_ordered: int = 0  # a kernel's sorted plan: rows of up to this many entries in host-row order (the reference
    # writes miss order)
    miss_ordered: bool = False  # a single-step plan: each row in miss order, entry for entry (docs/kernels.md §2)


def _pick(pool: Tensor, n: int, gen: torch.Generator) -> Tensor:
    """``n`` entries of ``pool`` drawn with replacement (``-1``s when the pool is empty)."""
    if pool.numel() == 0:
        return torch.full((n,), -1, dtype=I64)
    return pool[torch.randint(pool.numel(), (n,), generator=gen)]


def build(
    *,
    seed: int,
    speculative: bool,
    batch: int,
    top_k: int,
    hot: int,
    tail: int,
    lens: list[int],
    max_len: int,
    steps: int = 1,
    requests: int | None = None,
    miss_rate: float = 0.3,
    dup_rate: float = 0.1,
    invalid_rate: float = 0.05,
    newest_rate: float = 0.05,
    unbacked_rate: float = 0.0,
    empty_rate: float = 0.1,
    dead_tail: bool = False,
    tail_in_hot: bool = False,
    item_bytes: int = 16,
    dtype: torch.dtype = torch.uint8,
    index_dtype: torch.dtype = I64,
    scratch: int = 0,
    rids: list[int] | None = None,
    num_real: int | None = None,
    host_rows: int | None = None,
    host_cache: Tensor | None = None,
    state: HotBufferState | None = None,
    device_buffer: Tensor | None = None,
    device: torch.device | str = "cpu",
    pin: bool = False,
) -> Scenario:
    """A call of ``batch`` rows; ``lens[b]`` is row ``b``'s length at step 0 (step ``s`` sees ``lens[b] + s``).

    Given ``state`` (a decode loop's), only the top-k is drawn, against that state's hot tokens, and the scenario
    holds that state itself (and ``device_buffer``/``host_cache`` when given), not copies."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    steps = steps if speculative else 1
    requests = requests or batch + 1
    rids = list(rids) if rids is not None else torch.randperm(requests, generator=gen)[:batch].tolist()
    if host_cache is not None:
        host_rows = host_cache.shape[0]
    host_rows = host_rows or max(requests * max_len // 2, 1) + 7
    fresh = state is None
    if fresh:
        state = HotBufferState.allocate(requests, hot, tail, max_len, device="cpu", scratch=scratch)
    table = state.device_buffer_tokens.cpu()
    tokens = torch.full((batch, steps, top_k), -1, dtype=I64)
    for b in range(batch):
        rid, first_len = rids[b], lens[b]
        if fresh:
            rows = torch.randint(host_rows, (max_len,), generator=gen)
            rows[torch.rand(max_len, generator=gen) < unbacked_rate] = -1
            state.host_cache_locs[rid] = rows
            _fill_slots(state, gen, rid, first_len, steps, empty_rate, tail_in_hot, dead_tail)
        hot_tokens = table[rid, :hot].to(I64) if not fresh else state.device_buffer_tokens[rid, :hot].to(I64)
        hot_tokens = hot_tokens[hot_tokens >= 0]
        for s in range(steps):
            tokens[b, s] = _draw_step(gen, hot_tokens, first_len + s, top_k, miss_rate, newest_rate, invalid_rate)
        flat = tokens[b].reshape(-1)
        dup = torch.rand(flat.numel(), generator=gen) < dup_rate
        dup[:1] = False  # the first occurrence has nothing before it to repeat
        source = (torch.rand(flat.numel(), generator=gen) * torch.arange(flat.numel())).long()
        tokens[b] = torch.where(dup, flat[source], flat).reshape(steps, top_k)
    lens_t = torch.tensor([lens[b] + s for b in range(batch) for s in range(steps)], dtype=index_dtype)
    if host_cache is None and pin:
        host_cache = pinned_random_rows(host_rows, item_bytes, dtype, seed=seed, device=device)
    elif host_cache is None:
        host_cache = random_rows(host_rows, item_bytes, dtype, seed=seed, device=device)
    if fresh and device.type != "cpu":
        state = _state_to(state, device)
    if device_buffer is None:
        device_buffer = random_rows(state.device_rows, item_bytes, dtype, seed=seed + 1, device=device)
    return Scenario(
        speculative=speculative,
        state=state,
        host_cache=host_cache,
        device_buffer=device_buffer,
        top_k_tokens=(tokens if speculative else tokens[:, 0]).to(I32).to(device),
        seq_lens=lens_t.to(device),
        req_pool_indices=torch.tensor(rids, dtype=index_dtype, device=device),
        num_real_reqs=None if num_real is None else torch.tensor([num_real], dtype=I32, device=device),
    )


def _fill_slots(state, gen, rid, first_len, steps, empty_rate, tail_in_hot, dead_tail) -> None:
    """Hot region, LRU order and tail of one request: positional for a short row, random for a long one."""
    hot, tail = state.hot, state.tail
    last_len = first_len + steps - 1
    if last_len <= hot:  # short row: token t at slot t
        state.set_hot(rid, torch.arange(max(last_len, 0)))
        return
    committed = max(first_len - 1, 0)  # tokens before the newest one
    held = torch.randperm(committed, generator=gen)[:hot]
    held[torch.rand(held.numel(), generator=gen) < empty_rate] = -1
    if tail_in_hot:  # the newest token (and the first draft) also sit in the hot region
        n = min(steps, 2, held.numel())
        held[:n] = torch.arange(first_len - 1, first_len + 1)[:n]
        held = held[torch.randperm(held.numel(), generator=gen)]
    state.set_hot(rid, held, torch.randperm(hot, generator=gen))
    state.write_tail(rid, torch.arange(first_len - 1, first_len + steps - 1)[:tail])
    if dead_tail and tail > 1:
        state.device_buffer_locs[rid, hot + 1] = -1


def _draw_step(gen, hot_tokens, length, top_k, miss_rate, newest_rate, invalid_rate) -> Tensor:
    """One step's top-k: hot tokens, cold tokens (misses) at ``miss_rate``, the newest and invalid tokens."""
    cold = torch.randperm(max(length, 1), generator=gen)
    cold = cold[~torch.isin(cold, hot_tokens) & (cold < length) & (cold != length - 1)]
    row = _pick(hot_tokens[hot_tokens < length], top_k, gen)
    row = torch.where(torch.rand(top_k, generator=gen) < miss_rate, _pick(cold, top_k, gen), row)
    v = torch.rand(top_k, generator=gen)
    row = torch.where(v < newest_rate, torch.full_like(row, length - 1), row)
    bad = torch.where(
        torch.rand(top_k, generator=gen) < 0.5,
        -1 - torch.randint(3, (top_k,), generator=gen),
        length + torch.randint(3, (top_k,), generator=gen),
    )
    return torch.where((v >= newest_rate) & (v < newest_rate + invalid_rate), bad, row)


def random_rows(rows: int, item_bytes: int, dtype: torch.dtype, *, seed: int, device: torch.device | str) -> Tensor:
    """``[rows, item]`` of random bytes viewed as ``dtype``, generated on ``device`` (fast for GB-sized caches)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, item_bytes), dtype=torch.uint8, generator=gen, device=device)
    return raw.view(dtype).reshape(rows, -1)


def pinned_random_rows(rows: int, item_bytes: int, dtype: torch.dtype, *, seed: int, device: torch.device) -> Tensor:
    """Like :func:`random_rows` but in pinned host memory, generated on ``device`` in 256 MiB chunks."""
    host = torch.empty((rows, item_bytes), dtype=torch.uint8, pin_memory=True)
    step = max(1, (256 << 20) // item_bytes)
    for start in range(0, rows, step):
        chunk = random_rows(min(step, rows - start), item_bytes, torch.uint8, seed=seed + start, device=device)
        host[start : start + chunk.shape[0]].copy_(chunk)
    return host.view(dtype).reshape(rows, -1)


def _state_to(state: HotBufferState, device: torch.device) -> HotBufferState:
    return attrs.evolve(
        state,
        device_buffer_tokens=state.device_buffer_tokens.to(device),
        device_buffer_locs=state.device_buffer_locs.to(device),
        lru_slots=state.lru_slots.to(device),
        host_cache_locs=state.host_cache_locs.to(device),
        scratch_locs=None if state.scratch_locs is None else state.scratch_locs.to(device),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Guarded copies: a tensor embedded in a larger one whose padding must stay untouched.


class Guard:
    """Copies of tensors embedded in padded buffers; ``check()`` asserts every pad element kept its fill."""

    def __init__(self) -> None:
        self._regions: list[tuple[str, Tensor, Tensor, Tensor]] = []

    def embed(self, name: str, t: Tensor, fill: int, *, row_pad: int = 3, edge: int = 2) -> Tensor:
        """``t`` copied into a buffer with ``edge`` rows before and after and ``row_pad`` extra last-dim elements."""
        shape = list(t.shape)
        big_shape = (
            [shape[0] + 2 * edge] + shape[1:-1] + [shape[-1] + row_pad] if t.dim() > 1 else [shape[0] + 2 * edge]
        )
        big = torch.full(big_shape, fill, dtype=t.dtype, device=t.device)
        index = (slice(edge, edge + shape[0]),) + tuple(slice(0, n) for n in shape[1:])
        view = big[index]
        view.copy_(t)
        inside = torch.zeros(big_shape, dtype=torch.bool, device=t.device)
        inside[index] = True
        self._regions.append((name, big, inside, torch.tensor(fill, dtype=t.dtype, device=t.device)))
        return view

    def check(self) -> None:
        for name, big, inside, fill in self._regions:
            pad = big[~inside]
            assert bool((pad == fill).all()), f"{name}: padding written ({int((pad != fill).sum())} elements)"


def run(
    impl,
    scn: Scenario,
    *,
    plan: bool = True,
    workspace: bool | Tensor = False,
    guard: Guard | None = None,
    state: HotBufferState | None = None,
    device_buffer: Tensor | None = None,
) -> Result:
    """Call ``impl.swap_in`` on copies (or on the given ``state``/``device_buffer``,
    mutated in place, for decode loops). Plan entries start as sentinels (-9). ``workspace``: a fresh one full of
    garbage (True), the given tensor (kept across calls), or none."""
    state = state if state is not None else scn.state.clone()
    device_buffer = device_buffer if device_buffer is not None else scn.device_buffer.clone()
    dev = scn.top_k_tokens.device
    batch, n = scn.batch, max(scn.occurrences, 1)
    out = torch.full(scn.top_k_tokens.shape, -7, dtype=I32, device=dev)
    miss_src = torch.full((batch, n), -9, dtype=I64, device=dev)
    miss_dst = torch.full((batch, n), -9, dtype=I32, device=dev)
    miss_count = torch.full((batch,), -9, dtype=I32, device=dev)
    counters = new_counters(dev)
    call_state = state
    kwargs = dict(
        top_k_tokens=scn.top_k_tokens,
        host_cache=scn.host_cache,
        req_pool_indices=scn.req_pool_indices,
        seq_lens=scn.seq_lens,
        num_real_reqs=scn.num_real_reqs,
    )
    if guard is not None:
        tables = {
            "device_buffer_tokens": state.device_buffer_tokens,
            "device_buffer_locs": state.device_buffer_locs,
            "lru_slots": state.lru_slots,
            "host_cache_locs": state.host_cache_locs,
            "scratch_locs": state.scratch_locs,
        }
        # mutable outputs and state: padding must stay as filled
        out = guard.embed("top_k_device_locs", out, -3)
        tables["device_buffer_tokens"] = guard.embed("device_buffer_tokens", tables["device_buffer_tokens"], 1)
        # device_buffer_locs shares the tokens' row stride; its padding holds plausible rows (read-only)
        tables["device_buffer_locs"] = guard.embed("device_buffer_locs", tables["device_buffer_locs"], 2)
        tables["lru_slots"] = guard.embed("lru_slots", tables["lru_slots"], 0, row_pad=5)
        tables["host_cache_locs"] = guard.embed("host_cache_locs", tables["host_cache_locs"], 1, row_pad=4)
        if tables["scratch_locs"] is not None:
            tables["scratch_locs"] = guard.embed("scratch_locs", tables["scratch_locs"], 3)
        call_state = HotBufferState(**tables)
        device_buffer = guard.embed("device_buffer", device_buffer, 5, row_pad=1)
        miss_src = guard.embed("miss_src", miss_src, -5)
        miss_dst = guard.embed("miss_dst", miss_dst, -5)  # same padding: the slabs share a row stride
        miss_count = guard.embed("miss_count", miss_count, -5)
        counters = guard.embed("counters", counters, 0)
        kwargs["host_cache"] = guard.embed("host_cache", scn.host_cache.to(dev), 7, row_pad=1)
    if plan:
        kwargs["plan"] = MissPlan(miss_src, miss_dst, miss_count)
    if isinstance(workspace, Tensor):  # the caller's, kept across calls
        kwargs["workspace"] = workspace
    elif workspace:
        steps = scn.top_k_tokens.shape[1] if scn.speculative else 1
        columns = swap_in_workspace_columns(steps, scn.top_k_tokens.shape[-1])
        ws = torch.full((batch, columns), -11, dtype=I64, device=dev)
        kwargs["workspace"] = guard.embed("workspace", ws, -11) if guard is not None else ws
    impl.swap_in(call_state, **kwargs, device_buffer=device_buffer, top_k_device_locs=out, counters=counters)
    if guard is not None:
        state.device_buffer_tokens.copy_(call_state.device_buffer_tokens)
        state.lru_slots.copy_(call_state.lru_slots)
    return Result(
        out=out.cpu(),
        device_buffer_tokens=state.device_buffer_tokens.cpu(),
        lru_slots=state.lru_slots.cpu(),
        device_buffer=device_buffer.cpu(),
        miss_src=miss_src.cpu(),
        miss_dst=miss_dst.cpu(),
        miss_count=miss_count.cpu(),
        counters=counters.cpu(),
        host_ordered=0
        if getattr(impl, "__name__", "") == "kvplan.reference" or not scn.speculative
        else _sorted_rows_up_to(batch),
        miss_ordered=not scn.speculative,
    )


def _sorted_rows_up_to(batch: int) -> int:
    """Up to how many entries a kernel swap-in of ``batch`` rows writes a plan row in host-row order: none on the flat
    path (miss order, up to ``FLAT_COPY_MAX_BATCH``), any with the split resolve's sort, ``ROW_SORT_MAX`` when one
    program per row sorts (longer rows keep miss order), any when the on-chip resolve runs (on a GPU, unless Triton's
    resolve is forced)."""
    from kvplan.kernels import hisparse, planner
    from kvplan.kernels.resolve.constants import ROW_SORT_MAX

    launch = hisparse.RESOLVE_LAUNCH
    if not (launch.sorted_plan if launch.sorted_plan is not None else batch > planner.FLAT_COPY_MAX_BATCH):
        return 0
    if torch.cuda.is_available() and planner.requested_resolve(launch.resolve) != "triton":
        return 1 << 62
    per_row = launch.per_row if launch.per_row is not None else batch >= planner.PER_ROW_MIN_BATCH
    return ROW_SORT_MAX if per_row else 1 << 62


def assert_same(kernel: Result, ref: Result) -> None:
    """Exact equality on everything the contract defines (plan entries only in ``[0, miss_count)``)."""
    assert torch.equal(kernel.out, ref.out), _diff("top_k_device_locs", kernel.out, ref.out)
    assert torch.equal(kernel.device_buffer_tokens, ref.device_buffer_tokens), "device_buffer_tokens differ"
    assert torch.equal(kernel.lru_slots, ref.lru_slots), _diff("lru_slots", kernel.lru_slots, ref.lru_slots)
    assert torch.equal(kernel.miss_count, ref.miss_count), f"miss_count {kernel.miss_count} vs {ref.miss_count}"
    assert_same_plan_rows(kernel.miss_src, kernel.miss_dst, ref.miss_src, ref.miss_dst, ref.miss_count)
    if kernel.miss_ordered:  # single-step: the plan row itself, in miss order
        for row, count in enumerate(ref.miss_count.tolist()):
            count = max(count, 0)
            assert torch.equal(kernel.miss_src[row, :count], ref.miss_src[row, :count]), f"miss_src row {row} order"
            assert torch.equal(kernel.miss_dst[row, :count], ref.miss_dst[row, :count]), f"miss_dst row {row} order"
    if kernel.host_ordered:
        count = kernel.miss_count
        assert_host_row_order(kernel.miss_src, torch.where(count <= kernel.host_ordered, count, 0))
    # bit-exact (random bytes viewed as floats include NaNs, which never compare equal)
    assert torch.equal(kernel.device_buffer.view(torch.uint8), ref.device_buffer.view(torch.uint8)), "device rows"
    assert torch.equal(kernel.counters, ref.counters), f"counters {kernel.counters} vs {ref.counters}"


def _diff(name: str, a: Tensor, b: Tensor) -> str:
    where = (a != b).nonzero()[:5].tolist()
    got = [a[tuple(i)].item() for i in where]
    want = [b[tuple(i)].item() for i in where]
    return f"{name} differ at {where}: kernel {got}, reference {want}"


def decode_loop(
    device, common: dict, *, lens: list[int], calls: int, seed: int = 0, host_cache: Tensor | None = None,
    workspace_storage: Tensor | None = None,
):  # fmt: skip
    """Kernel and reference each carry their own state through ``calls`` calls (speculative, speculative,
    single-step, ...; contexts growing); equal after every one. With ``workspace_storage`` (int64, flat) every kernel
    call takes its workspace as a view of it, as a pool's calls of different shapes do."""
    from kvplan import kernels as kernels_module
    from kvplan import reference as reference_module

    first = build(seed=seed, speculative=True, lens=lens, device=device, host_cache=host_cache, **common)
    k_state, r_state = first.state, first.state.clone()
    k_dev, r_dev = first.device_buffer, first.device_buffer.clone()
    steps, tail = common["steps"], common["tail"]
    hits = 0
    for call in range(calls):
        speculative = call % 3 != 2
        for rid, length in zip(common["rids"], lens):  # the engine writes the newest and draft tokens each step
            draft = torch.arange(length - 1, length + steps - 1)[:tail] if speculative else torch.tensor([length - 1])
            k_state.write_tail(rid, draft)
            r_state.write_tail(rid, draft)
        scn = build(
            seed=seed + 100 + call,
            speculative=speculative,
            lens=lens,
            device=device,
            miss_rate=0.4,
            state=k_state,
            host_cache=first.host_cache,
            device_buffer=k_dev,
            **common,
        )
        workspace = False
        if workspace_storage is not None:
            columns = swap_in_workspace_columns(steps if speculative else 1, common["top_k"])
            workspace = workspace_storage[: scn.batch * columns].view(scn.batch, columns)
        k = run(kernels_module, scn, state=k_state, device_buffer=k_dev, workspace=workspace)
        r = run(reference_module, scn, state=r_state, device_buffer=r_dev)
        assert_same(k, r)
        hits += int(r.counters[2])
        lens = [length + (steps if speculative else 1) for length in lens]
    assert hits > 0  # tokens were drawn against the evolving state


# The three ways a call runs (kvplan.kernels.hisparse): the split resolve with the plan in miss order and the flat
# copy; the split resolve, sort, shared host rows and the ordered copies; one program per row, then the same.
PATHS = {
    "flat": dict(sorted_plan=False, per_row=False),
    "sorted": dict(sorted_plan=True, per_row=False),
    "per_row": dict(sorted_plan=True, per_row=True),
}


def small_launch(path: str) -> object:
    """The smallest chunks (rows span several chunks in every step) on one of the three paths."""
    from kvplan.kernels import hisparse

    return hisparse.ResolveLaunch(occ_chunk=64, hot_chunk=32, row_occ_chunk=64, row_hot_chunk=32, **PATHS[path])
