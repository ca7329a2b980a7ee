"""One call of each kernel (swap_in, copy_planned, materialize) as a flat dict of named tensors, and the
helpers that call a kernel or the reference on such a dict: shared by the hostile-input tests and the launch-cache
tests (tests/kernels/). The swap-in's hot-buffer tables travel as one ``HotBufferState`` and the plan as one
``MissPlan``; a flat dict lets a test place each tensor in its own guard buffer and build the records per call."""

from __future__ import annotations

import torch

from helpers.swap_in_scenarios import build
from kvplan import reference
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.runtime.launch_replay import Recorder
from kvplan.state import HotBufferState
from kvplan.workspace import swap_in_workspace_columns

I32, I64 = torch.int32, torch.int64

STATE_TABLES = ("device_buffer_tokens", "device_buffer_locs", "lru_slots", "host_cache_locs", "scratch_locs")
PLAN_TENSORS = ("miss_src", "miss_dst", "miss_count")


def state_of(args: dict) -> HotBufferState:
    """The ``HotBufferState`` of a flat argument dict's tables (``scratch_locs`` when present)."""
    return HotBufferState(**{name: args.get(name) for name in STATE_TABLES})


def plan_of(args: dict) -> MissPlan:
    return MissPlan(args["miss_src"], args["miss_dst"], args["miss_count"])


def per_call(args: dict) -> dict:
    """The arguments other than the state tables and the plan tensors (the per-call tensors, by keyword)."""
    return {k: v for k, v in args.items() if k not in STATE_TABLES + PLAN_TENSORS}


# ---------------------------------------------------------------------------------------------------------------------
# swap_in


def swap_in_args(speculative: bool, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One call with hits, misses, scratch and overflow (speculative), a short row and a padding row."""
    steps = 3 if speculative else 1
    scn = build(
        seed=11,
        speculative=speculative,
        batch=3,
        steps=steps,
        top_k=4,
        hot=6,
        tail=3,
        lens=[30, 41, 5],
        max_len=48,
        requests=5,
        rids=[0, 3, 1],  # request 0 is a long row: its host rows, expanded to every request, are real ones
        scratch=2 if speculative else 0,
        miss_rate=0.6,
        item_bytes=12,
    )
    batch, n = 3, steps * 4
    args = dict(
        top_k_tokens=scn.top_k_tokens,
        top_k_device_locs=torch.full(scn.top_k_tokens.shape, -7, dtype=I32),
        req_pool_indices=scn.req_pool_indices,
        seq_lens=scn.seq_lens,
        num_real_reqs=torch.tensor([2], dtype=I32),
        host_cache=scn.host_cache,
        device_buffer=scn.device_buffer,
        miss_src=torch.full((batch, n), -9, dtype=I64),
        miss_dst=torch.full((batch, n), -9, dtype=I32),
        miss_count=torch.full((batch,), -9, dtype=I32),
        workspace=torch.zeros(batch, swap_in_workspace_columns(steps, 4), dtype=I64),
        counters=new_counters("cpu"),
    )
    state = scn.state.clone()
    args.update((name, getattr(state, name)) for name in STATE_TABLES if getattr(state, name) is not None)
    return {name: t.to(device) for name, t in args.items()}


def _call_swap_in(impl, speculative: bool, args: dict, state: HotBufferState | None = None, **options) -> None:
    """Call ``impl``'s swap-in on a flat argument dict: the tables as one state (``state`` when given), the plan
    tensors as one plan, the rest by keyword (no workspace for the reference); ``options`` too (``launch_records``)."""
    rest = per_call(args)
    if impl is reference:
        rest.pop("workspace", None)
    state = state_of(args) if state is None else state
    impl.swap_in(state, plan=plan_of(args), speculative=speculative, **rest, **options)


# ---------------------------------------------------------------------------------------------------------------------
# copy_planned


def copy_args(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    batch, columns, n_host, n_dev, item = 3, 5, 20, 24, 10
    dst = torch.randperm(n_dev, generator=gen)[: batch * columns].reshape(batch, columns).to(I32)
    args = dict(
        miss_src=torch.randint(n_host, (batch, columns), generator=gen),
        miss_dst=dst,
        miss_count=torch.tensor([5, 2, 4], dtype=I32),
        num_real_reqs=torch.tensor([3], dtype=I32),
        host_cache=torch.randint(0, 256, (n_host, item), dtype=torch.uint8, generator=gen),
        device_buffer=torch.zeros(n_dev, item, dtype=torch.uint8),
        counters=new_counters("cpu"),
    )
    return {name: t.to(device) for name, t in args.items()}


# ---------------------------------------------------------------------------------------------------------------------
# materialize

T, LYR, H, D, ROT = 5, 3, 2, 8, 6


def materialize_args(device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    args = dict(
        kv=torch.randn(T, LYR, 2 * H * D, generator=gen),
        k_norm_weight=torch.rand(LYR, D, generator=gen) + 0.5,
        eps=torch.tensor([1e-6, 0.5, 2.0]),
        cos_sin_cache=torch.randn(12, ROT, generator=gen),
        positions=torch.tensor([3, 0, 11, 7, 7]),
        k_out=torch.full((LYR, T, H, D), -3.0),
        v_out=torch.full((LYR, T, H, D), -4.0),
    )
    return {name: t.to(device) for name, t in args.items()}


def _materialize(impl, args: dict, **options):
    kw = {k: v for k, v in args.items() if k not in ("k_out", "v_out")}
    outputs = dict(k_out=args["k_out"], v_out=args["v_out"])
    return impl.materialize(**kw, num_kv_heads=H, head_dim=D, rotary_dim=ROT, **outputs, **options)


# ---------------------------------------------------------------------------------------------------------------------
# launch replay


class _KeepingRecorder(Recorder):
    """A recorder that keeps every launch (as the GPU's does), so the wrappers remember calls on the CPU too."""

    __slots__ = ()

    def launch(self, fn, grid, *args, **kwargs) -> None:
        fn[grid](*args, **kwargs)
        self.launches.append((fn, grid))
