"""Hostile inputs to the adapters (issue 20, third pass): the SGLang adapter (kvplan.compat.sglang) and the
end-to-end sparse-attention check (kvplan.testing.sparse_attention). Each refusal names the argument, what was expected
and what was given, and leaves everything as it was; what the caller passes is what is written, and nothing the caller
freed is kept alive."""

from __future__ import annotations

import gc
import math
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvplan.reference as ref
from kvplan import HotBufferState, PlanBufferPool
from kvplan.compat import sglang as sg
from kvplan.testing.sparse_attention import AttentionCheckConfig, SparseAttentionCheck

I16, I32, I64 = torch.int16, torch.int32, torch.int64
R, HOT, PAGE, MAX_LEN, DIM, TOP_K, SCRATCH = 2, 6, 2, 24, 8, 4, 2
ITEM = DIM * 2  # bf16 rows of 16 bytes
LENS = [20, 14]


class Tables(SimpleNamespace):
    """One layer's HiSparse tables as SGLang's coordinator passes them, with a history: some tokens hot."""


def _tables(device, seed: int = 0) -> Tables:
    gen = torch.Generator().manual_seed(seed)
    width = HOT + PAGE
    dbt = torch.full((R, width), -1, dtype=I32)
    lru = torch.stack([torch.randperm(HOT, generator=gen) for _ in range(R)]).to(I16)
    hcl = torch.full((R, MAX_LEN), -1, dtype=I64)
    for rid, length in enumerate(LENS):
        hcl[rid, :length] = rid * MAX_LEN + torch.arange(length)
        dbt[rid, : HOT - 2] = torch.randperm(length - 1, generator=gen)[: HOT - 2].to(I32)
        dbt[rid, HOT] = length - 1  # the newest token in the tail
    device_rows = R * width + R * SCRATCH
    t = Tables(
        dbt=dbt,
        dbl=torch.arange(R * width, dtype=I32).view(R, width),
        lru=lru,
        hcl=hcl,
        scratch=(R * width + torch.arange(R * SCRATCH, dtype=I32)).view(R, SCRATCH),
        host=torch.randn((R * MAX_LEN, 1, DIM), generator=gen).to(torch.bfloat16),
        dev=torch.randn((device_rows, 1, DIM), generator=gen).to(torch.bfloat16),
        top_k=torch.stack([torch.randint(0, n, (TOP_K,), generator=gen) for n in LENS]).to(I32),
        spec_top_k=torch.stack([torch.randint(0, n, (2, TOP_K), generator=gen) for n in LENS]).to(I32),
    )
    for name, value in vars(t).items():
        setattr(t, name, value.to(device))
    t.rids = torch.arange(R, dtype=I64, device=device)
    t.lens = torch.tensor(LENS, dtype=I64, device=device)
    t.out = torch.full((R, TOP_K), -7, dtype=I32, device=device)
    return t


def _single_step(t: Tables, **override) -> None:
    kwargs = dict(
        top_k_tokens=t.top_k, device_buffer_tokens=t.dbt, host_cache_locs=t.hcl, device_buffer_locs=t.dbl,
        host_cache=t.host, device_buffer=t.dev, top_k_device_locs=t.out, req_pool_indices=t.rids, seq_lens=t.lens,
        lru_slots=t.lru, item_size_bytes=ITEM, num_top_k=TOP_K, hot_buffer_size=HOT,
    )  # fmt: skip
    kwargs.update(override)
    sg.load_cache_to_device_buffer_mla(**kwargs)


def _reference_single_step(t: Tables) -> tuple[torch.Tensor, Tables]:
    """The reference on copies of ``t``: (top_k_device_locs, the tables and device rows after the call)."""
    twin = Tables(**{k: v.clone() for k, v in vars(t).items()})
    state = HotBufferState(twin.dbt, twin.dbl, twin.lru, twin.hcl)
    out = torch.full((R, TOP_K), -7, dtype=I32, device=t.dbt.device)
    host, dev = twin.host.view(-1, DIM), twin.dev.view(-1, DIM)
    ref.swap_in(state, twin.top_k, out, twin.rids, twin.lens, host, dev)
    return out, twin


def _repoint(old: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """What a caller does with ``set_``: ``old`` moves to new memory holding ``fill``; the returned fresh table
    lives at ``old``'s former address, with its shape and strides (as the allocator can place a new table)."""
    fresh = torch.empty(0, dtype=old.dtype, device=old.device)
    fresh.set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())
    old.set_(fill.clone())
    return fresh


# ---------------------------------------------------------------------------------------------------------------------
# (3) The adapter writes the tensors it is given and keeps none alive


def test_a_fresh_table_at_a_repointed_tables_address_is_the_one_written(device):
    t = _tables(device)
    _single_step(t)  # the first call with these tables (an adapter caching by layout would keep these objects)
    elsewhere = _tables(device, seed=1)  # what the old objects hold after set_: another valid history
    fresh = {n: _repoint(getattr(t, n), getattr(elsewhere, n)) for n in ("dbt", "dbl", "lru", "hcl")}
    old = {n: getattr(t, n) for n in fresh}
    for name, table in fresh.items():  # the fresh tables hold a known state of their own
        table.copy_(getattr(_tables(device, seed=2), name))
        setattr(t, name, table)
    assert all(fresh[n].data_ptr() != old[n].data_ptr() for n in fresh)
    t.top_k = _tables(device, seed=2).top_k
    want_out, want = _reference_single_step(t)
    _single_step(t)
    assert torch.equal(t.out, want_out)
    for name in ("dbt", "lru", "dev"):
        assert torch.equal(getattr(t, name), getattr(want, name)), name
    for name, table in old.items():  # the re-pointed objects were not touched
        assert torch.equal(table, getattr(elsewhere, name)), name


@pytest.mark.parametrize("speculative", [False, True], ids=["single", "spec"])
def test_the_adapter_keeps_no_caller_tensor_alive(device, speculative):
    t = _tables(device)
    names = ("dbt", "dbl", "lru", "hcl", "scratch", "host", "dev")
    if speculative:
        out = torch.full((R, 2, TOP_K), -7, dtype=I32, device=device)
        sg.load_cache_to_device_buffer_spec_mla(
            top_k_tokens=t.spec_top_k, device_buffer_tokens=t.dbt, host_cache_locs=t.hcl, device_buffer_locs=t.dbl,
            host_cache=t.host, device_buffer=t.dev, top_k_device_locs=out, req_pool_indices=t.rids,
            seq_lens=t.lens.repeat_interleave(2).to(I32), state=sg.SpecState(t.lru, t.scratch),
            num_real_reqs=torch.tensor([R], dtype=I32, device=device),
        )  # fmt: skip
    else:
        _single_step(t)
    refs = {n: weakref.ref(getattr(t, n)) for n in names}
    del t
    gc.collect()
    assert [n for n, r in refs.items() if r() is not None] == []


# ---------------------------------------------------------------------------------------------------------------------
# (15) SGLang adapter arguments


def _copy_args(t: Tables):
    plan = (
        torch.zeros((R, TOP_K), dtype=I64, device=t.dbt.device),
        torch.zeros((R, TOP_K), dtype=I32, device=t.dbt.device),
        torch.zeros(R, dtype=I32, device=t.dbt.device),
    )
    return (*plan, torch.tensor([R], dtype=I32, device=t.dbt.device), t.host, t.dev)


@pytest.mark.parametrize(
    ("value", "error", "given"),
    [
        (None, TypeError, "NoneType None"),
        (16.0, TypeError, r"float 16\.0"),
        ("16", TypeError, "str '16'"),
        (True, TypeError, "bool True"),
        (torch.tensor(16), TypeError, r"Tensor tensor\(16\)"),
        (0, ValueError, "0$"),
        (-16, ValueError, "-16$"),
    ],
)
def test_item_size_bytes_must_be_a_positive_int(device, value, error, given):
    t = _tables(device)
    before = {k: v.clone() for k, v in vars(t).items()}
    with pytest.raises(error, match=rf"^item_size_bytes must be a positive int, got {given}"):
        _single_step(t, item_size_bytes=value)
    with pytest.raises(error, match=rf"^item_size_bytes must be a positive int, got {given}"):
        sg.copy_cache_planned_mla(*_copy_args(t), value)
    assert all(torch.equal(v, before[k]) for k, v in vars(t).items())


def test_numpy_ints_are_ints(device):
    t = _tables(device)
    want_out, want = _reference_single_step(t)
    _single_step(t, item_size_bytes=np.int64(ITEM), num_top_k=np.int32(TOP_K), hot_buffer_size=np.int16(HOT))
    assert torch.equal(t.out, want_out) and torch.equal(t.dev, want.dev)
    sg.copy_cache_planned_mla(*_copy_args(t), np.uint16(ITEM), np.int8(4))


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"page_size": 1.0}, TypeError, r"^page_size must be a positive int, got float 1\.0"),
        ({"page_size": True}, TypeError, r"^page_size must be a positive int, got bool True"),
        ({"skip_io": "no"}, TypeError, r"^skip_io must be a bool, got str 'no'"),
        ({"skip_io": None}, TypeError, r"^skip_io must be a bool, got NoneType None"),
        ({"num_top_k": 4.0}, TypeError, r"^num_top_k must be a positive int, got float 4\.0"),
    ],
)
def test_single_step_scalars_are_checked(device, override, error, message):
    t = _tables(device)
    before = {k: v.clone() for k, v in vars(t).items()}
    with pytest.raises(error, match=message):
        _single_step(t, **override)
    assert all(torch.equal(v, before[k]) for k, v in vars(t).items())


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({0: lambda p: p.to(I32)}, "^miss_src must be int64 and miss_dst must be int32"),
        ({2: lambda p: p.to(I64)}, "^miss_count must be int32"),
        ({0: lambda p: p[:1]}, r"^miss_src and miss_dst must both have shape \[batch, columns\]"),
        ({2: lambda p: p[:1]}, r"^miss_count must be a contiguous \[>= 2\] vector"),
        ({3: lambda n: n.to(I64)}, "num_real_reqs"),
    ],
)
def test_copy_validates_the_plan_with_skip_io(device, broken, message):
    t = _tables(device)
    args = list(_copy_args(t))
    for index, change in broken.items():
        args[index] = change(args[index])
    before = t.dev.clone()
    for skip_io in (False, True):
        with pytest.raises(ValueError, match=message):
            sg.copy_cache_planned_mla(*args, ITEM, skip_io=skip_io)
    assert torch.equal(t.dev, before)


def test_copy_refuses_a_non_bool_skip_io(device):
    t = _tables(device)
    with pytest.raises(TypeError, match="^skip_io must be a bool, got int 1"):
        sg.copy_cache_planned_mla(*_copy_args(t), ITEM, skip_io=1)
    with pytest.raises(TypeError, match="^is_dsv4_layout must be a bool, got str 'False'"):
        sg.copy_cache_planned_mla(*_copy_args(t), ITEM, is_dsv4_layout="False")
    sg.copy_cache_planned_mla(*_copy_args(t), ITEM, skip_io=np.bool_(True))


H, D, HIDDEN, NL = 2, 8, 16, 2


class Rope:
    """A neox rotary embedding; ``growable`` gives it SGLang's ``_ensure_cos_sin_cache_length``."""

    def __init__(self, max_pos: int, device, *, growable: bool) -> None:
        self.rotary_dim, self.is_neox_style, self.device = D, True, device
        self.cos_sin_cache = self._cache(max_pos)
        if growable:
            self._ensure_cos_sin_cache_length = self._grow

    def _cache(self, max_pos: int) -> torch.Tensor:
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.device)

    def _grow(self, max_position: int) -> None:
        if max_position >= self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self._cache(max_position + 1)


def _layers(device, rope):
    gen = torch.Generator().manual_seed(0)
    q_size, kv_size = 2 * D, H * D
    return [
        SimpleNamespace(self_attn=SimpleNamespace(
            num_kv_heads=H, head_dim=D, q_size=q_size, kv_size=kv_size, rotary_emb=rope,
            qkv_proj=SimpleNamespace(weight=torch.randn((q_size + 2 * kv_size, HIDDEN), generator=gen).to(device)),
            k_norm=SimpleNamespace(weight=torch.ones(D, device=device), variance_epsilon=1e-6),
        ))
        for _ in range(NL)
    ]  # fmt: skip


def _collect(written):
    return lambda layer, k, v: written.append((layer, k.clone(), v.clone()))


def test_helper_refuses_a_hint_beyond_a_rope_cache_that_cannot_grow(device):
    rope = Rope(16, device, growable=False)
    with pytest.raises(ValueError, match=r"^max_position_hint must be <= 16 \(the RoPE cos/sin cache rows\), got 17"):
        sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device, 17)
    sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device, 16)  # the whole cache: fine
    grows = Rope(16, device, growable=True)  # SGLang's rotary embedding grows its cache for the hint
    sg.FusedKVMaterializeHelper(_layers(device, grows), grows, H, D, device, 40)
    assert grows.cos_sin_cache.shape[0] >= 40


def test_helper_refuses_a_per_call_hint_beyond_the_cache_before_writing(device):
    rope = Rope(16, device, growable=False)
    helper = sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device)
    written = []
    ctx = torch.randn((2, HIDDEN), device=device)
    with pytest.raises(ValueError, match=r"^max_position_hint must be <= 16 \(the RoPE cos/sin cache rows\), got 99"):
        helper.materialize(ctx, torch.tensor([1, 2], device=device), _collect(written), max_position_hint=99)
    assert written == []


def test_helper_cache_replaced_by_a_shorter_one_breaks_the_hint(device):
    rope = Rope(32, device, growable=False)
    helper = sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device, 32)
    rope.cos_sin_cache = rope._cache(8)  # the engine swapped in a shorter cache: the promise no longer holds
    written = []
    with pytest.raises(ValueError, match=r"^max_position_hint must be <= 8 \(the RoPE cos/sin cache rows\), got 32"):
        helper.materialize(torch.randn((1, HIDDEN), device=device), torch.tensor([3], device=device), _collect(written))
    assert written == []


@pytest.mark.parametrize("positions", [[-1, 3], [2, -5]])
def test_helper_refuses_negative_positions_where_it_reads_them(device, positions):
    """Without a hint the helper reads positions back anyway (SGLang's max check): negative ones are refused in the
    same read; SGLang's kernel would read before the cos/sin cache."""
    rope = Rope(16, device, growable=True)
    helper = sg.FusedKVMaterializeHelper(_layers(device, rope), rope, H, D, device)
    written = []
    message = r"^positions out of range: expected 0 <= position < 16 \(the RoPE cos/sin cache rows\), got positions \[-"
    with pytest.raises(ValueError, match=message):
        helper.materialize(torch.randn((2, HIDDEN), device=device), torch.tensor(positions, device=device),
                           _collect(written))  # fmt: skip
    assert written == []


def test_helper_with_a_hint_clamps_unless_asked_to_check(device):
    rope = Rope(16, device, growable=False)
    layers, ctx = _layers(device, rope), torch.randn((2, HIDDEN), device=device)
    bad, clamped = torch.tensor([-1, 15], device=device), torch.tensor([0, 15], device=device)
    unchecked, reference = [], []
    sg.FusedKVMaterializeHelper(layers, rope, H, D, device, 16).materialize(ctx, bad, _collect(unchecked))
    sg.FusedKVMaterializeHelper(layers, rope, H, D, device, 16).materialize(ctx, clamped, _collect(reference))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(unchecked, reference))  # -1 read as row 0, never before it
    checked = sg.FusedKVMaterializeHelper(layers, rope, H, D, device, 16, check_positions=True)
    written = []
    with pytest.raises(ValueError, match=r"^positions out of range: expected 0 <= position < 16 \(max_position_hint"):
        checked.materialize(ctx, bad, _collect(written))
    with pytest.raises(ValueError, match=r"^positions out of range: expected 0 <= position < 4 \(max_position_hint"):
        checked.materialize(ctx, torch.tensor([1, 5], device=device), _collect(written), max_position_hint=4)
    assert written == []
    checked.materialize(ctx, clamped, _collect(written))
    assert len(written) == NL
    with pytest.raises(TypeError, match="^check_positions must be a bool, got str 'yes'"):
        sg.FusedKVMaterializeHelper(layers, rope, H, D, device, 16, check_positions="yes")


# ---------------------------------------------------------------------------------------------------------------------
# (16) The sparse-attention check's arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": "bf16"}, TypeError, r"^AttentionCheckConfig.dtype must be a floating torch.dtype .*got str 'bf16'"),
        ({"dtype": torch.int32}, ValueError, r"^AttentionCheckConfig.dtype must be a floating torch.dtype .*int32"),
        ({"dense_tolerance": math.nan}, ValueError, r"^AttentionCheckConfig.dense_tolerance must be a finite .*nan"),
        ({"dense_tolerance": -1e-4}, ValueError, r"^AttentionCheckConfig.dense_tolerance must be a finite .*-0.0001"),
        ({"dense_tolerance": math.inf}, ValueError, r"^AttentionCheckConfig.dense_tolerance must be a finite .*inf"),
        ({"dense_tolerance": "1e-4"}, TypeError, r"^AttentionCheckConfig.dense_tolerance must be a finite .*str"),
        ({"dense_tolerance": True}, TypeError, r"^AttentionCheckConfig.dense_tolerance must be a finite .*True"),
    ],
)
def test_attention_check_config_fields_are_validated(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionCheckConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch": 2.0}, TypeError, r"^AttentionCheckConfig.batch must be an int >= 1, got float 2\.0$"),
        ({"hot": True}, TypeError, r"^AttentionCheckConfig.hot must be an int >= 1, got bool True$"),
        ({"scratch": -1}, ValueError, r"^AttentionCheckConfig.scratch must be an int >= 0, got -1$"),
        ({"seed": 2**64}, ValueError, r"^AttentionCheckConfig.seed must be an int in \[0, 18446744073709551616\)"),
    ],
)
def test_attention_check_config_sizes_are_ints(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionCheckConfig(**kwargs)


def test_attention_check_config_takes_valid_values():
    assert AttentionCheckConfig(dtype=torch.float32, dense_tolerance=0).dense_tolerance == 0
    assert AttentionCheckConfig(dense_tolerance=np.float32(1e-3)).dense_tolerance == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (
            ("x", "cpu"),
            {},
            TypeError,
            r"^config must be a kvplan.testing.sparse_attention.AttentionCheckConfig, got str",
        ),  # fmt: skip
        ((None, "cpu"), {"pool": "x"}, TypeError, r"^pool must be a kvplan.PlanBufferPool or None, got str 'x'"),
        ((None, ""), {}, ValueError, r"^device must be a torch device .*, got ''"),
        ((None, "cpu:1"), {}, ValueError, r"^device must be cpu or cpu:0 on the CPU, got cpu:1"),
        # a pool of another device than the check's (refused before the check touches its device, so it runs here)
        ((None, "cuda"), {"pool": PlanBufferPool("cpu")}, ValueError, r"^pool is on cpu, not on the check's cuda"),
        ((None, "meta"), {}, ValueError, r"^PlanBufferPool: device=.* holds no memory the kernels can use"),
    ],
)
def test_sparse_attention_check_arguments_are_validated(args, kwargs, error, message):
    args = (AttentionCheckConfig() if args[0] is None else args[0], args[1])
    with pytest.raises(error, match=message):
        SparseAttentionCheck(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Fifth pass: the adapter under threads. Each thread has its own tables, caches and plan buffers; the adapters' pool
# is per (device, thread), so no call reads another thread's workspace or plan between its launches.


def _thread_steps(device, seed: int, own_plan: bool, barrier, wrong: list, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    t = _tables(device, seed=seed)
    plan = dict(
        miss_src=torch.zeros(R, TOP_K, dtype=I64, device=device),
        miss_dst=torch.zeros(R, TOP_K, dtype=I32, device=device),
        miss_count=torch.zeros(R, dtype=I32, device=device),
    )
    for step in range(steps):
        t.top_k = torch.stack([torch.randint(0, n, (TOP_K,), generator=gen) for n in LENS]).to(I32).to(device)
        want_out, want = _reference_single_step(t)
        barrier.wait()
        _single_step(t, **(plan if own_plan else {}))
        last = sg.last_miss_plan(device) if not own_plan else None
        same = torch.equal(t.out, want_out) and torch.equal(t.dev, want.dev)
        same = same and torch.equal(t.dbt, want.dbt) and torch.equal(t.lru, want.lru)
        if not own_plan:  # the thread's own last plan: its entries are this call's copies
            host, dev = t.host.view(-1, DIM), t.dev.view(-1, DIM)
            for b in range(R):
                n = int(last.count[b])
                same = same and torch.equal(dev[last.dst[b, :n].long()], host[last.src[b, :n]])
        if not same:
            wrong.append((seed, step))


@pytest.mark.parametrize("own_plan", [True, False], ids=["plan-buffers", "pool-plan"])
def test_threads_with_their_own_tables_each_get_the_reference(device, own_plan):
    import threading

    threads, wrong, barrier = [], [], threading.Barrier(2)

    def steps(seed: int) -> None:
        try:
            _thread_steps(device, seed, own_plan, barrier, wrong)
        except Exception as error:  # noqa: BLE001 (that thread's failure, reported; the other one stops waiting)
            wrong.append((seed, repr(error)[:400]))
            barrier.abort()

    for seed in range(2):
        threads.append(threading.Thread(target=steps, args=(seed,)))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), f"a thread did not finish; wrong so far: {wrong}"
    assert wrong == []


def test_each_thread_has_its_own_adapter_pool(device):
    import threading

    pools = []
    th = threading.Thread(target=lambda: pools.append(sg.pool_for(device)))
    th.start()
    th.join()
    assert pools[0] is not sg.pool_for(device) and sg.pool_for(device) is sg.pool_for(device)
