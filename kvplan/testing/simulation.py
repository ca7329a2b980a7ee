"""A simulated engine worker: the decode loop an engine runs around one PlanBufferPool.

Requests arrive and finish (the batch changes), speculative steps switch between single-step and several draft steps,
top_k changes, contexts grow. Each step calls ``ensure_capacity``, runs the (speculative) swap-in through the pool,
replays its plan into the layers that share the anchor layer's top-k, and materializes the draft model's KV into the
pool's slabs. With ``check=True`` every step is also run through the PyTorch reference on a copy of the state and
compared exactly (KV within the spec's tolerance). The demo CLI and the multi-GPU script both drive this class.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from decimal import Decimal

import attrs
import torch
from torch import Tensor

from kvplan import sizing
from kvplan.config import GROWTH_POLICIES, MaterializeGeometry, PoolConfig, not_one_of
from kvplan.plan import MissPlan
from kvplan.pool import PlanBufferPool
from kvplan.state import HotBufferState

__all__ = ["LoopConfig", "StepRecord", "DecodeLoop", "MismatchError"]


class MismatchError(AssertionError):
    """A kernel result differed from the reference."""


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"LoopConfig.{attribute.name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"LoopConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _seed(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"LoopConfig.seed must be an int in [0, 2**64), got {type(value).__name__} {value!r}")
    if not 0 <= value < 1 << 64:  # what torch.Generator.manual_seed takes
        raise ValueError(f"LoopConfig.seed must be an int in [0, 2**64), got {value!r}")


def _scratch(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    expected = "LoopConfig.scratch must be None (sized by kvplan.sizing.scratch_rows) or an int >= 0"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{expected}, got {value!r}")


def _growth(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if error := not_one_of("LoopConfig.growth", value, GROWTH_POLICIES):  # (PoolConfig.growth's rule)
        raise error


def _choices(instance: object, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not isinstance(value, tuple) or not value or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TypeError(f"LoopConfig.{attribute.name} must be a non-empty tuple of ints, got {value!r}")
    if min(value) < 1:
        raise ValueError(f"LoopConfig.{attribute.name} must hold ints >= 1, got {value!r}")


@attrs.frozen
class LoopConfig:
    """Shapes of the simulated worker. Defaults are small enough for Triton's interpreter on a CPU."""

    steps: int = attrs.field(default=24, validator=_positive)
    seed: int = attrs.field(default=0, validator=_seed)
    max_batch: int = attrs.field(default=4, validator=_positive)  # real requests at most
    num_reqs: int = attrs.field(default=6, validator=_positive)  # request-pool slots R
    hot: int = attrs.field(default=16, validator=_positive)  # HOT
    tail: int = attrs.field(default=4, validator=_positive)  # P
    # scratch rows per request C; None: kvplan.sizing.scratch_rows at the largest steps x top_k (nothing overflows)
    scratch: int | None = attrs.field(default=None, validator=_scratch)
    max_len: int = attrs.field(default=128, validator=_positive)  # Lmax
    top_k_choices: tuple[int, ...] = attrs.field(default=(4, 8), validator=_choices)
    spec_steps_choices: tuple[int, ...] = attrs.field(default=(1, 2, 4), validator=_choices)  # 1 = single-step
    item_bytes: int = attrs.field(default=64, validator=_positive)  # host/device row width
    shared_layers: int = attrs.field(default=1, validator=attrs.validators.ge(0))  # layers replaying the plan
    n_layers: int = attrs.field(default=2, validator=_positive)  # draft model (materialize)
    num_kv_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=16, validator=_positive)
    kv_dtype: torch.dtype = torch.float32
    # every policy of PoolConfig; bucketed: the batch rounded up to batch_buckets, the batch sizes the loop launches
    growth: str = attrs.field(default="geometric", validator=_growth)
    graph_pad: bool = True  # pad the batch to a power of two, as CUDA-graph engines do

    def __attrs_post_init__(self) -> None:
        if max(self.top_k_choices) > self.hot:
            raise ValueError(f"LoopConfig.top_k_choices must be <= hot = {self.hot}, got {self.top_k_choices}")
        if max(self.spec_steps_choices) > self.tail:
            raise ValueError(
                f"LoopConfig.tail must hold the newest token and the drafts (>= max steps), got {self.tail}"
            )
        if self.max_len < 2 * max(self.spec_steps_choices) + 3:
            raise ValueError(
                f"LoopConfig.max_len must leave room for a request to grow (>= 2 * max steps + 3 = "
                f"{2 * max(self.spec_steps_choices) + 3}), got {self.max_len}"
            )
        if self.max_batch > self.num_reqs:
            raise ValueError(f"LoopConfig.max_batch must be <= num_reqs = {self.num_reqs}, got {self.max_batch}")

    @property
    def scratch_rule(self) -> int:
        """Scratch rows per request no speculative swap-in of this loop can overflow:
        ``kvplan.sizing.scratch_rows(hot, the largest steps, the largest top_k)``."""
        return sizing.scratch_rows(self.hot, max(self.spec_steps_choices), max(self.top_k_choices))

    @property
    def scratch_rows(self) -> int:
        """Scratch rows per request the loop's state holds: ``scratch``, or :attr:`scratch_rule` when it is None."""
        return self.scratch_rule if self.scratch is None else self.scratch

    @property
    def can_overflow(self) -> bool:
        """Whether a speculative swap-in can drop misses (``-1``, counted as overflow): fewer scratch rows than the
        rule needs."""
        return self.scratch_rows < self.scratch_rule

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """The batch sizes the loop launches: with ``graph_pad`` the powers of two up to the padded ``max_batch`` (the
        CUDA-graph batches), else every batch from 1 to ``max_batch``. The pool's buckets under growth='bucketed'."""
        if self.graph_pad:
            padded = 1 << (self.max_batch - 1).bit_length()
            return tuple(1 << i for i in range(padded.bit_length()))
        return tuple(range(1, self.max_batch + 1))

    def pool_config(self) -> PoolConfig:
        """The loop's pool policy: ``growth``, with :attr:`batch_buckets` when it is bucketed."""
        buckets = self.batch_buckets if self.growth == "bucketed" else ()
        return PoolConfig(growth=self.growth, batch_buckets=buckets)


@attrs.frozen
class StepRecord:
    """What one step asked of the pool and what the pool held afterwards."""

    step: int
    batch: int  # real requests
    padded_batch: int  # rows launched (graph padding included)
    num_steps: int
    top_k: int
    total_ctx: int
    grew: bool
    generation: int
    reserved_bytes: dict[str, int]
    capacity: dict[str, int]  # the stats keys {buffer}.capacity.{dim} (docs/pool.md §5) and their values
    checked: bool


@attrs.define
class _Request:
    rid: int
    length: int  # tokens in context (the newest is length - 1)
    recent: list[int]  # tokens the last top-k picked, for locality


def footprint(config: LoopConfig) -> dict[str, int]:
    """Bytes the tensors a ``DecodeLoop`` allocates up front take: ``state`` (hot-buffer tables), ``device_buffers``
    (every layer's device rows) on the loop's device, and ``host_caches`` (pinned host memory on a GPU)."""
    c = config
    width, words, scratch = c.hot + c.tail, max(1, c.item_bytes // 4), c.scratch_rows
    layers = 1 + c.shared_layers
    return {
        "state": c.num_reqs * (8 * width + 2 * c.hot + 8 * c.max_len + 4 * scratch),
        "device_buffers": layers * c.num_reqs * (width + scratch) * words * 4,
        "host_caches": layers * c.num_reqs * c.max_len * words * 4,
    }


def _check_memory(config: LoopConfig, device: torch.device) -> None:
    """Refuse, before allocating anything, a config whose tables alone outgrow the machine (a ValueError naming the
    sizes instead of an allocator failure, or the host swapping, part-way through the set-up)."""
    need = footprint(config)
    places = {"host": need["host_caches"]}
    if device.type == "cuda":
        places["device"] = need["state"] + need["device_buffers"]
        capacity = {"device": torch.cuda.get_device_properties(device).total_memory}
    else:
        places["host"] += need["state"] + need["device_buffers"]
        capacity = {}
    try:
        capacity["host"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: nothing to compare with
        pass
    for where, nbytes in places.items():
        if where in capacity and nbytes > capacity[where]:
            c = config
            parts = ", ".join(f"{name} {_gib(n)}" for name, n in need.items())
            raise ValueError(
                f"LoopConfig needs {_gib(nbytes)} of {where} memory ({parts} for num_reqs={c.num_reqs}, "
                f"max_len={c.max_len}, hot={c.hot}, item_bytes={c.item_bytes}), more than the "
                f"{_gib(capacity[where])} this machine has; lower max_batch/num_reqs, max_len, hot or item_bytes"
            )


def _gib(nbytes: int) -> str:
    return f"{Decimal(nbytes) / (1 << 30):.3g} GiB"


class DecodeLoop:
    """One simulated worker on ``device`` (``check``: compare every step with the reference; a step can also be
    checked alone, ``step(i, check=True)``)."""

    def __init__(self, config: LoopConfig, device: torch.device | str, *, check: bool = False) -> None:
        self.config = config
        self.device = torch.device(device)
        self.check = check
        _check_memory(config, self.device)
        self.rng = random.Random(config.seed)
        gen = torch.Generator().manual_seed(config.seed)
        c = config
        self.pool = PlanBufferPool(
            self.device,
            geometry=MaterializeGeometry(c.n_layers, c.num_kv_heads, c.head_dim, c.kv_dtype),
            config=c.pool_config(),
        )
        # scratch_rows: the given rows, or kvplan.sizing.scratch_rows at the largest steps x top_k (nothing overflows)
        self.state = HotBufferState.allocate(c.num_reqs, c.hot, c.tail, c.max_len, self.device, scratch=c.scratch_rows)
        pinned = self.device.type == "cuda"
        words = max(1, c.item_bytes // 4)
        host_rows = c.num_reqs * c.max_len

        def host_cache() -> Tensor:
            table = torch.randint(-(2**31), 2**31 - 1, (host_rows, words), dtype=torch.int32, generator=gen)
            return table.pin_memory() if pinned else table

        # layer 0 is the anchor whose top-k drives the swap-in; the others replay its plan
        self.host_caches = [host_cache() for _ in range(1 + c.shared_layers)]
        self.device_buffers = [
            torch.zeros(self.state.device_rows, words, dtype=torch.int32, device=self.device) for _ in self.host_caches
        ]
        d = c.head_dim
        self.rotary_dim = d - d % 2  # full neox rotary, as DFlash drafts run
        self.k_norm_weight = (1 + 0.1 * torch.randn(c.n_layers, d, generator=gen)).to(self.device, c.kv_dtype)
        self.eps = torch.full((c.n_layers,), 1e-6, dtype=torch.float32, device=self.device)
        max_pos = c.max_len + max(c.spec_steps_choices) + 1
        inv = 1.0 / (10000 ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim))
        freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=1).to(self.device, torch.float32)
        self.requests: list[_Request] = []
        self.free_rids = list(range(c.num_reqs))
        self.num_real = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._gen = gen
        self.mismatches = 0
        self.reference_counters = torch.zeros_like(self.pool.counters)

    # ---- the schedule

    def _schedule(self) -> None:
        """Requests finish and arrive; contexts grow; never past max_len."""
        c = self.config
        grow_by = max(c.spec_steps_choices)
        for req in list(self.requests):
            if req.length + 2 * grow_by + 1 >= c.max_len or self.rng.random() < 0.12:
                self.requests.remove(req)
                self.free_rids.append(req.rid)
        while len(self.requests) < c.max_batch and self.free_rids and (not self.requests or self.rng.random() < 0.4):
            rid = self.free_rids.pop(self.rng.randrange(len(self.free_rids)))
            length = self.rng.randint(1, c.max_len // 2)
            self.requests.append(_Request(rid, length, []))
            self.state.finish(rid)
            if length <= c.hot:
                self.state.fill_short(rid, length, self._host_rows(rid, length))

    def _host_rows(self, rid: int, length: int) -> Tensor:
        """Host rows of a request's first ``length`` tokens; every 23rd token is not backed (unbacked misses)."""
        rows = torch.arange(length, dtype=torch.int64) + rid * self.config.max_len
        rows[11::23] = -1
        return rows

    def _pick_tokens(self, req: _Request, steps: int, top_k: int) -> list[list[int]]:
        """Per draft step a top-k: mostly recent tokens (hits), some fresh ones (misses), duplicates, padding."""
        out = []
        for s in range(steps):
            visible = req.length + s
            picks = []
            for _ in range(top_k):
                roll = self.rng.random()
                if roll < 0.55 and req.recent:
                    picks.append(self.rng.choice(req.recent))
                elif roll < 0.9:
                    picks.append(self.rng.randrange(visible))
                elif roll < 0.95:
                    picks.append(visible - 1 - self.rng.randrange(min(visible, steps + 1)))  # newest and drafts
                else:
                    picks.append(-1)  # padding in the indexer's output
            out.append(picks)
        req.recent = [t for row in out for t in row if t >= 0][: self.config.hot]
        return out

    # ---- one step

    def run(self) -> Iterator[StepRecord]:
        for step in range(self.config.steps):
            yield self.step(step)

    def step(self, step: int, *, check: bool | None = None) -> StepRecord:
        """One decode step; ``check`` (default: the loop's) compares it with the reference, swap-in counters included
        (the step's change of the device counters against the reference's, so steps can be checked alone)."""
        check = self.check if check is None else check
        c = self.config
        self._schedule()
        steps = self.rng.choice(c.spec_steps_choices)
        top_k = self.rng.choice(c.top_k_choices)
        batch = len(self.requests)
        padded = max(1, 1 << (batch - 1).bit_length()) if c.graph_pad else max(batch, 1)
        draft_tokens = batch * steps
        grew = self.pool.ensure_capacity(batch=padded, num_steps=steps, top_k=top_k, total_ctx=draft_tokens)

        tokens, seq_lens, rids = self._inputs(padded, steps, top_k)
        self.num_real.fill_(batch)
        out_shape = (padded, top_k) if steps == 1 else (padded, steps, top_k)
        out = torch.full(out_shape, -7, dtype=torch.int32, device=self.device)
        kwargs = dict(
            top_k_tokens=tokens if steps > 1 else tokens[:, 0],
            req_pool_indices=rids,
            seq_lens=seq_lens,
            num_real_reqs=self.num_real,
            host_cache=self.host_caches[0],
            device_buffer=self.device_buffers[0],
            top_k_device_locs=out,
        )
        before = self._snapshot() if check else None

        plan = self.pool.swap_in(self.state, **kwargs)  # speculative when top_k_tokens is [B, S, K]
        for layer in range(1, len(self.host_caches)):
            self.pool.replay(
                plan,
                host_cache=self.host_caches[layer],
                device_buffer=self.device_buffers[layer],
                num_real_reqs=self.num_real,
            )
        kv, positions = self._draft_kv(steps)
        k_out, v_out = self.pool.materialize(
            kv, self.k_norm_weight, self.eps, self.cos_sin_cache, positions, rotary_dim=self.rotary_dim
        )

        if check:
            self._compare(before, kwargs, plan, out, steps, kv, positions, k_out, v_out)
        self._advance(steps)
        stats = self.pool.stats() if grew or step == 0 else None
        return self._record(step, batch, padded, steps, top_k, draft_tokens, grew, stats, check)

    def _inputs(self, padded: int, steps: int, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        tokens = torch.randint(-3, c.max_len, (padded, steps, top_k), dtype=torch.int32, generator=self._gen)
        seq_lens = torch.ones(padded, steps, dtype=torch.int64)
        rids = torch.zeros(padded, dtype=torch.int64)
        for b, req in enumerate(self.requests):
            rids[b] = req.rid
            tokens[b] = torch.tensor(self._pick_tokens(req, steps, top_k), dtype=torch.int32)
            seq_lens[b] = req.length + torch.arange(steps)
            last = req.length + steps - 1
            if last <= c.hot:  # short row: token t at hot slot t
                self.state.fill_short(req.rid, last, self._host_rows(req.rid, last))
            else:
                self.state.set_host_rows(req.rid, self._host_rows(req.rid, last))
                self.state.write_tail(req.rid, list(range(req.length - 1, last)))
        # mix index dtypes, as engines do
        dtype = torch.int32 if steps % 2 else torch.int64
        to = dict(device=self.device, dtype=dtype)
        return tokens.to(self.device), seq_lens.reshape(-1).to(**to), rids.to(**to)

    def _draft_kv(self, steps: int) -> tuple[Tensor, Tensor]:
        """The draft model's fused KV projection output for this step's draft tokens, and their positions."""
        c = self.config
        positions = [req.length + s for req in self.requests for s in range(steps)]
        width = 2 * c.num_kv_heads * c.head_dim
        kv = torch.randn(len(positions), c.n_layers, width, generator=self._gen).to(self.device, c.kv_dtype)
        return kv, torch.tensor(positions, dtype=torch.int32)

    def _advance(self, steps: int) -> None:
        for req in self.requests:
            req.length += self.rng.randint(1, steps)  # accepted draft tokens

    # ---- checking against the reference

    def _snapshot(self) -> dict[str, object]:
        return {
            "state": self.state.clone(),
            "buffers": [b.clone() for b in self.device_buffers],
            "counters": (self.pool.counters.clone(), self.reference_counters.clone()),
        }

    def _compare(self, before, kwargs, plan, out, steps, kv, positions, k_out, v_out) -> None:
        from kvplan import reference

        state: HotBufferState = before["state"]
        buffers: list[Tensor] = before["buffers"]
        padded, cols = plan.src.shape
        ref_out = torch.full_like(out, -7)
        ref_src = torch.zeros(padded, cols, dtype=torch.int64, device=self.device)
        ref_dst = torch.zeros(padded, cols, dtype=torch.int32, device=self.device)
        ref_count = torch.full((padded,), -7, dtype=torch.int32, device=self.device)
        ref_plan = MissPlan(ref_src, ref_dst, ref_count)
        ref_kwargs = dict(kwargs, device_buffer=buffers[0], top_k_device_locs=ref_out)
        reference.swap_in(state, **ref_kwargs, plan=ref_plan, counters=self.reference_counters)
        for layer in range(1, len(buffers)):
            reference.copy_planned(ref_plan, self.host_caches[layer], buffers[layer], num_real_reqs=self.num_real)
        real = len(self.requests)
        # single-step padding rows leave miss_count untouched (stale pool memory): compare the real rows there
        counted = padded if steps > 1 else real
        checks = {
            "top_k_device_locs": (out, ref_out),
            "device_buffer_tokens": (self.state.device_buffer_tokens, state.device_buffer_tokens),
            "lru_slots": (self.state.lru_slots, state.lru_slots),
            "miss_count": (plan.count[:counted], ref_count[:counted]),
        }
        for layer, buffer in enumerate(buffers):
            checks[f"device_buffer[layer {layer}]"] = (self.device_buffers[layer], buffer)
        for name, (got, want) in checks.items():
            if not torch.equal(got, want):
                self.mismatches += 1
                raise MismatchError(f"step result {name} differs from the reference")
        counts = ref_count[:real].tolist()
        for b, n in enumerate(counts):  # a plan row is a set of copies: the kernel writes host-row order
            if plan.row_copies(b, n) != ref_plan.row_copies(b, n):
                self.mismatches += 1
                raise MismatchError(f"miss plan row {b} differs from the reference")
        pool_before, reference_before = before["counters"]
        for index, name in enumerate(("misses_copied", "bytes_moved", "hits", "overflow")):
            got = int(self.pool.counters[index] - pool_before[index])
            want = int(self.reference_counters[index] - reference_before[index])
            if got != want:
                self.mismatches += 1
                raise MismatchError(f"device counter {name} grew by {got} in this step, the reference's by {want}")
        k_ref, v_ref = reference.materialize(
            kv,
            self.k_norm_weight,
            self.eps,
            self.cos_sin_cache,
            positions,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            rotary_dim=self.rotary_dim,
        )
        tol = {torch.bfloat16: 1.5e-2, torch.float16: 1e-2}.get(self.config.kv_dtype, 1e-4)
        if not torch.equal(v_out, v_ref) or not torch.allclose(k_out.float(), k_ref.float(), atol=tol, rtol=tol):
            self.mismatches += 1
            raise MismatchError("materialized KV differs from the reference")

    def counters_match(self) -> dict[str, int]:
        """The pool's device counters, after checking the swap-in ones equal the reference's (reads the device)."""
        from kvplan.counters import read_counters

        got, want = read_counters(self.pool.counters), read_counters(self.reference_counters)
        for name in ("misses_copied", "bytes_moved", "hits", "overflow"):
            if got[name] != want[name]:
                raise MismatchError(f"device counter {name} = {got[name]}, the reference counted {want[name]}")
        return got

    # ---- records

    def _record(self, step, batch, padded, steps, top_k, total_ctx, grew, stats, checked) -> StepRecord:
        if stats is not None:
            flat = stats.as_dict()
            self._last_sizes = (
                {b.name: b.reserved_bytes for b in stats.buffers},
                {k: v for k, v in flat.items() if k.split(".")[1:2] == ["capacity"]},
            )
        reserved, capacity = self._last_sizes
        return StepRecord(
            step=step,
            batch=batch,
            padded_batch=padded,
            num_steps=steps,
            top_k=top_k,
            total_ctx=total_ctx,
            grew=grew,
            generation=self.pool.generation,
            reserved_bytes=dict(reserved),
            capacity=dict(capacity),
            checked=checked,
        )
