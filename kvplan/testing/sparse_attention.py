"""An end-to-end sparse-attention decode step: the check that the rows a swap-in serves make attention come out right.

A small MLA-style decode loop in plain PyTorch around one :class:`~kvplan.pool.PlanBufferPool`. Every host-cache row
is one token's latent KV vector (``dim`` values; the first ``v_dim`` are its value part). Each step:

1. an *indexer* scores every context token against a per-request (per draft step) query and picks the top-k tokens;
2. the pool's swap-in (single-step or speculative) brings their rows into the hot buffer and returns the device rows
   ``top_k_device_locs``;
3. *sparse attention* gathers ``device_buffer[top_k_device_locs]`` and attends over those rows;
4. the same attention is computed from the host cache rows of the same tokens: the two outputs must be **equal bit
   for bit** (same rows, same order, same arithmetic); the kernel may leave out (``-1``) only tokens without a host
   row (invalid, padding) and the misses it counted as overflow (no evictable slot or scratch row left), which the
   host side then leaves out too;
5. when the top-k covers a request's whole context, its output is also compared with dense attention over the full
   cache in token order (the same math summed in another order: equal within floating-point tolerance).

The newest token (and the draft tokens) live in the tail slots, written there each step as an engine's forward pass
would; a short request (context <= HOT) holds token ``t`` at hot slot ``t`` from its prefill. ``kvplan demo`` runs
this check; tests run it on the CPU (Triton's interpreter) and at production shapes on a GPU.
"""

from __future__ import annotations

import math
import numbers

import attrs
import torch
from torch import Tensor

from kvplan.counters import read_counters
from kvplan.pool import PlanBufferPool
from kvplan.state import HotBufferState

__all__ = ["AttentionCheckConfig", "AttentionCheckResult", "SparseAttentionCheck", "attend"]


def _at_least(low: int, below: int | None = None):
    expected = f"an int >= {low}" if below is None else f"an int in [{low}, {below})"

    def check(instance: object, attribute: attrs.Attribute, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"AttentionCheckConfig.{attribute.name} must be {expected}, got {type(value).__name__} {value!r}"
            )
        if value < low or (below is not None and value >= below):
            raise ValueError(f"AttentionCheckConfig.{attribute.name} must be {expected}, got {value!r}")

    return check


def _floating_dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    expected = f"AttentionCheckConfig.{attribute.name} must be a floating torch.dtype (e.g. torch.bfloat16)"
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"{expected}, got {value}")


def _tolerance(instance: object, attribute: attrs.Attribute, value: object) -> None:
    expected = f"AttentionCheckConfig.{attribute.name} must be a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{expected}, got {value!r}")


@attrs.frozen
class AttentionCheckConfig:
    """Shapes of the check. Defaults are small enough for Triton's interpreter on a CPU."""

    batch: int = attrs.field(default=2, validator=_at_least(1))
    hot: int = attrs.field(default=16, validator=_at_least(1))
    tail: int = attrs.field(default=4, validator=_at_least(1))
    scratch: int = attrs.field(default=8, validator=_at_least(0))
    top_k: int = attrs.field(default=8, validator=_at_least(1))
    spec_steps: int = attrs.field(default=2, validator=_at_least(1))  # 1 = single-step swap-in
    context: int = attrs.field(default=40, validator=_at_least(1))  # each request's length at the first step
    max_len: int = attrs.field(default=96, validator=_at_least(2))
    dim: int = attrs.field(default=32, validator=_at_least(1))  # latent KV values per row (MLA: 512 + 64)
    v_dim: int = attrs.field(default=24, validator=_at_least(1))  # its value part (MLA: 512)
    heads: int = attrs.field(default=2, validator=_at_least(1))
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, validator=_floating_dtype)
    # |sparse - dense| allowed where the top-k covers the whole context
    dense_tolerance: float = attrs.field(default=1e-4, validator=_tolerance)
    seed: int = attrs.field(default=0, validator=_at_least(0, 2**64))  # a torch.Generator seed

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.hot:
            raise ValueError(f"AttentionCheckConfig.top_k must be <= hot = {self.hot}, got {self.top_k}")
        if self.spec_steps > self.tail:
            raise ValueError(f"AttentionCheckConfig.tail must be >= spec_steps = {self.spec_steps}, got {self.tail}")
        if self.v_dim > self.dim:
            raise ValueError(f"AttentionCheckConfig.v_dim must be <= dim = {self.dim}, got {self.v_dim}")
        if self.context + self.spec_steps >= self.max_len:
            raise ValueError(f"AttentionCheckConfig.max_len must exceed context + spec_steps, got {self.max_len}")


@attrs.frozen
class AttentionCheckResult:
    """One step: how the sparse attention from the hot buffer compared with the host cache and dense attention."""

    step: int
    speculative: bool
    exact: bool  # device-row attention == host-row attention, bit for bit, with the same rows left out
    mismatched_outputs: int  # (request, draft step) outputs that differ
    rows_left_out: int  # selected occurrences served no row (-1): invalid or padding tokens, or overflow
    overflowed: int  # distinct backed tokens left out, = the swap-in's overflow count for the step
    dense_checked: int  # outputs whose top-k covered the whole context, compared with dense attention
    dense_max_error: float  # largest |sparse - dense| among those (0.0 when none)
    misses_copied: int  # rows the swap-in brought in this step
    dense_tolerance: float

    @property
    def ok(self) -> bool:
        return self.exact and self.dense_max_error <= self.dense_tolerance


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` without an index is the current GPU."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        current = torch.cuda.current_device
        return (current() if a.index is None else a.index) == (current() if b.index is None else b.index)
    return (a.index or 0) == (b.index or 0)


def attend(query: Tensor, rows: Tensor, keep: Tensor, v_dim: int) -> Tensor:
    """Attention of ``query [H, D]`` over ``rows [N, D]`` (float32 math), rows with ``keep`` False left out; values
    are the first ``v_dim`` entries of each row. Deterministic: same inputs, same bits."""
    q, kv = query.float(), rows.float()
    scores = (q @ kv.T) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~keep[None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no row left attends to nothing
    return weights @ kv[:, :v_dim]


class SparseAttentionCheck:
    """Requests decoding through a pool; :meth:`step` runs one indexer + swap-in + attention step and compares."""

    def __init__(self, config: AttentionCheckConfig, device: torch.device | str, pool: PlanBufferPool | None = None):
        if not isinstance(config, AttentionCheckConfig):
            raise TypeError(
                f"config must be a kvplan.testing.sparse_attention.AttentionCheckConfig, got {type(config).__name__}"
            )
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}") from None
        if self.device.type == "cpu" and self.device.index not in (None, 0):
            raise ValueError(f"device must be cpu or cpu:0 on the CPU, got {self.device}")
        if self.device.type == "cpu":  # tensors made on cpu:0 report "cpu"
            self.device = torch.device("cpu")
        if pool is not None and not isinstance(pool, PlanBufferPool):
            raise TypeError(f"pool must be a kvplan.PlanBufferPool or None, got {type(pool).__name__} {pool!r}")
        if pool is not None and not _same_device(pool.device, self.device):
            raise ValueError(f"pool is on {pool.device}, not on the check's {self.device}: give a pool of that device")
        c = self.config = config
        self.pool = pool if pool is not None else PlanBufferPool(self.device)
        gen = self._gen = torch.Generator().manual_seed(c.seed)
        self.state = HotBufferState.allocate(c.batch, c.hot, c.tail, c.max_len, self.device, scratch=c.scratch)
        host_rows = c.batch * c.max_len
        host = (torch.randn(host_rows, c.dim, generator=gen) * 2).to(c.dtype)
        self.host_cache = host.pin_memory() if self.device.type == "cuda" else host
        self.device_buffer = torch.zeros(self.state.device_rows, c.dim, dtype=c.dtype, device=self.device)
        self.indexer_keys = torch.randn(c.batch, c.max_len, 8, generator=gen)
        self.lengths = [c.context] * c.batch  # request r is batch row r, rid r
        for rid in range(c.batch):  # every token of every request backed by a random host row
            self.state.set_host_rows(rid, torch.randperm(host_rows, generator=gen)[: c.max_len])
        self.host_locs = self.state.host_cache_locs.cpu().clone()  # (on a CPU, .cpu() is the table itself)
        self.device_locs = self.state.device_buffer_locs.cpu().clone()
        self._step = 0

    # ---- one step ----------------------------------------------------------------------------------------------

    def step(self, spec_steps: int | None = None) -> AttentionCheckResult:
        """One decode step with ``spec_steps`` draft steps (default the config's; 1 = single-step): single-step and
        speculative calls can be mixed on the same requests, as engines do."""
        c = self.config
        s_count = c.spec_steps if spec_steps is None else spec_steps
        if isinstance(s_count, bool) or not isinstance(s_count, int) or not 1 <= s_count <= c.tail:
            raise ValueError(f"spec_steps must be an int in [1, tail = {c.tail}], got {spec_steps!r}")
        speculative = s_count > 1
        if max(self.lengths) + s_count > c.max_len:
            raise ValueError(f"the requests outgrew max_len = {c.max_len}: {max(self.lengths)} + {s_count} draft steps")
        seq_lens = torch.tensor([length + s for length in self.lengths for s in range(s_count)], dtype=torch.int64)
        self._write_context_rows(s_count)
        tokens = self._indexer(seq_lens.view(c.batch, s_count))  # [B, S, K] int32, -1 where nothing to pick
        out = torch.full((c.batch, s_count, c.top_k), -7, dtype=torch.int32, device=self.device)
        before = read_counters(self.pool.counters)
        self.pool.ensure_capacity(batch=c.batch, num_steps=s_count, top_k=c.top_k)
        self.pool.swap_in(
            self.state,
            top_k_tokens=(tokens if speculative else tokens[:, 0]).to(self.device),
            top_k_device_locs=out if speculative else out[:, 0],
            req_pool_indices=torch.arange(c.batch, dtype=torch.int64, device=self.device),
            seq_lens=(seq_lens if speculative else seq_lens[::s_count]).to(self.device),
            host_cache=self.host_cache,
            device_buffer=self.device_buffer,
        )
        after = read_counters(self.pool.counters)
        overflow = after["overflow"] - before["overflow"]
        result = self._compare(tokens, seq_lens.view(c.batch, s_count), out.cpu(), speculative, overflow)
        copied = after["misses_copied"] - before["misses_copied"]
        self.lengths = [length + 1 for length in self.lengths]
        self._step += 1
        return attrs.evolve(result, misses_copied=copied)

    def _write_context_rows(self, s_count: int) -> None:
        """What the model's forward pass keeps on the device: a short request's tokens at their hot slots, a long
        one's newest token (and the drafts) in the tail slots, each with its row."""
        c = self.config
        for rid, length in enumerate(self.lengths):
            last = length + s_count - 1  # tokens 0 .. last - 1 exist at the last draft step
            if last <= c.hot:
                slots = torch.arange(last)
                tokens = slots
                self.state.fill_short(rid, last, self.host_locs[rid, :last])
                self.state.set_host_rows(rid, self.host_locs[rid])  # fill_short backs only its tokens
            else:
                tokens = torch.arange(length - 1, last)  # the newest token, then the drafts
                slots = c.hot + torch.arange(tokens.numel())
                self.state.write_tail(rid, tokens)
            rows = self.host_cache[self.host_locs[rid, tokens]]
            self.device_buffer[self.device_locs[rid, slots].to(self.device)] = rows.to(self.device)

    def _indexer(self, seq_lens: Tensor) -> Tensor:
        """Top-k tokens of each request at each draft step by indexer score; ``-1`` fills what a short context
        cannot."""
        c = self.config
        tokens = torch.full((*seq_lens.shape, c.top_k), -1, dtype=torch.int32)
        for b in range(c.batch):
            for s in range(seq_lens.shape[1]):
                length = int(seq_lens[b, s])
                query = torch.randn(8, generator=self._gen)
                scores = self.indexer_keys[b, :length] @ query
                picked = torch.topk(scores, min(c.top_k, length)).indices
                tokens[b, s, : picked.numel()] = picked.to(torch.int32)
        return tokens

    def _compare(
        self, tokens: Tensor, seq_lens: Tensor, locs: Tensor, speculative: bool, overflow: int
    ) -> AttentionCheckResult:
        c = self.config
        s_count = tokens.shape[1]
        queries = torch.randn(c.batch, s_count, c.heads, c.dim, generator=self._gen).to(c.dtype)
        device_rows = self.device_buffer.cpu()
        mismatched = left_out = dense_checked = overflowed = 0
        dense_error = 0.0
        exact = True
        for b in range(c.batch):
            dropped: set[int] = set()
            for s in range(s_count):
                tok, loc, length = tokens[b, s].long(), locs[b, s].long(), int(seq_lens[b, s])
                valid = (tok >= 0) & (tok < length)
                host_row = torch.where(valid, self.host_locs[b, tok.clamp(0, c.max_len - 1)], -1)
                backed = valid & (host_row >= 0)
                served = loc >= 0
                left_out += int((~served).sum())
                dropped.update(tok[backed & ~served].tolist())
                if bool((served & ~backed).any()):  # a row for a token that has none
                    exact = False
                    mismatched += 1
                    continue
                from_device = attend(queries[b, s], device_rows[loc.clamp(min=0)], served, c.v_dim)
                from_host = attend(queries[b, s], self.host_cache[host_row.clamp(min=0)], served, c.v_dim)
                if not torch.equal(from_device, from_host):
                    exact = False
                    mismatched += 1
                if int(served.sum()) == length:  # the top-k covers the whole context: dense attention
                    rows = self.host_cache[self.host_locs[b, :length]]
                    dense = attend(queries[b, s], rows, torch.ones(length, dtype=torch.bool), c.v_dim)
                    dense_error = max(dense_error, float((from_device - dense).abs().max()))
                    dense_checked += 1
            overflowed += len(dropped)
        if overflowed != overflow:  # a backed token left out without being counted as overflow (or the reverse)
            exact = False
        return AttentionCheckResult(
            step=self._step,
            speculative=speculative,
            exact=exact,
            mismatched_outputs=mismatched,
            rows_left_out=left_out,
            overflowed=overflowed,
            dense_checked=dense_checked,
            dense_max_error=dense_error,
            misses_copied=0,
            dense_tolerance=c.dense_tolerance,
        )
