"""kvplan.compat.sglang.load_blocks_to_device_buffer_mha: SGLang 0.5.23's block-selection swap-in of MHA K and V
caches (MiniMax M3), called the way SGLang's coordinator calls it, compared with ``kvplan.reference.swap_in_blocks``.

The tests marked ``gpu`` run the same calls with pinned host caches on a GPU.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import kvplan.reference as ref
from kvplan import HotBufferState
from kvplan.compat import sglang as sg

ROOT = Path(__file__).resolve().parents[2]
I16, I32, I64 = torch.int16, torch.int32, torch.int64
HOT, PAGE, BLOCKS, BS, MAX_LEN, R, HEADS, DIM = 16, 1, 3, 4, 80, 4, 2, 4  # K/V rows: 2 heads x 4 bf16 = 16 bytes
ITEM = HEADS * DIM * 2


def test_signature_is_the_one_docs_sglang_md_lists():
    text = (ROOT / "docs" / "sglang.md").read_text()
    match = re.search(r"```python\n(def load_blocks_to_device_buffer_mha\(.*?\) -> None)\n```", text, re.S)
    assert match, "docs/sglang.md lists SGLang 0.5.23's signature of load_blocks_to_device_buffer_mha"
    listed = ast.parse(match.group(1) + ": ...").body[0].args
    defaults = [None] * (len(listed.args) - len(listed.defaults)) + [ast.literal_eval(d) for d in listed.defaults]
    want = [(a.arg, d is not None or i >= len(listed.args) - len(listed.defaults), d)
            for i, (a, d) in enumerate(zip(listed.args, defaults))]  # fmt: skip
    params = list(inspect.signature(sg.load_blocks_to_device_buffer_mha).parameters.values())
    got = [(p.name, p.default is not inspect.Parameter.empty,
            None if p.default is inspect.Parameter.empty else p.default) for p in params]  # fmt: skip
    assert got == want
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    assert [name for name, *_ in got][-4:] == ["page_size", "block_size", "num_real_reqs", "skip_io"]


class Tables:
    """One layer's HiSparse tables as SGLang's coordinator keeps them, with K and V buffers ``[rows, heads, dim]``."""

    def __init__(self, device, lens: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = HOT + PAGE
        self.tokens = torch.full((R, width), -1, dtype=I32)
        self.locs = torch.arange(R * width, dtype=I32).view(R, width)
        self.lru = torch.arange(HOT, dtype=I16).repeat(R, 1)
        self.host_locs = torch.full((R, MAX_LEN + PAGE), -1, dtype=I64)
        for rid, length in enumerate(lens):
            self.host_locs[rid, :length] = rid * MAX_LEN + torch.arange(length)
            if length <= HOT:
                self.tokens[rid, :length] = torch.arange(length, dtype=I32)
            else:
                self.tokens[rid, : HOT - 3] = torch.randperm(length - 1, generator=gen)[: HOT - 3].to(I32)
                self.lru[rid] = torch.randperm(HOT, generator=gen).to(I16)
                self.tokens[rid, HOT] = length - 1
        self.host_k = torch.randn((R * MAX_LEN, HEADS, DIM), generator=gen).to(torch.bfloat16)
        self.host_v = torch.randn((R * MAX_LEN, HEADS, DIM), generator=gen).to(torch.bfloat16)
        self.dev_k = torch.randn((R * width, HEADS, DIM), generator=gen).to(torch.bfloat16)
        self.dev_v = torch.randn((R * width, HEADS, DIM), generator=gen).to(torch.bfloat16)
        for name, value in vars(self).items():
            setattr(self, name, value.to(device))

    def clone(self) -> Tables:
        twin = object.__new__(Tables)
        for name, value in vars(self).items():
            setattr(twin, name, value.clone())
        return twin

    def positional(self, top_k_blocks, out, rids, lens, num_real_reqs=None, **extra) -> tuple:
        return (top_k_blocks, self.tokens, self.host_locs, self.locs, self.host_k, self.host_v, self.dev_k,
                self.dev_v, out, rids, lens, self.lru, ITEM, HOT, BS, 1, 256, num_real_reqs)  # fmt: skip

    def reference(self, top_k_blocks, out, rids, lens, num_real_reqs=None, check_newest=False):
        """The reference under the adapter's rule (SGLang's: the newest token at slot HOT whatever it holds), or the
        native one (``check_newest=True``)."""
        state = HotBufferState(self.tokens, self.locs, self.lru, self.host_locs)
        return ref.swap_in_blocks(
            state, top_k_blocks, out, rids, lens, self.host_k.view(-1, HEADS * DIM), self.host_v.view(-1, HEADS * DIM),
            self.dev_k.view(-1, HEADS * DIM), self.dev_v.view(-1, HEADS * DIM), sparse_block_size=BS,
            num_real_reqs=num_real_reqs, check_newest=check_newest,
        )  # fmt: skip


def _equal(a: Tables, b: Tables) -> None:
    for name in ("tokens", "lru", "dev_k", "dev_v"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


LENS = [60, 9, 33, 70]  # long, short (shorter than two blocks), long, long


@pytest.mark.parametrize("batch", [1, 4])
def test_adapter_matches_the_reference_with_padding_rows_and_wider_outputs(device, batch):
    tables = Tables(device, LENS, seed=batch)
    twin = tables.clone()
    gen = torch.Generator().manual_seed(batch)
    blocks = torch.randint(-1, 18, (batch, BLOCKS), generator=gen).to(I32)
    blocks[0, 0] = (LENS[0] - 1) // BS  # the newest token's block
    blocks = blocks.to(device)
    rids = torch.arange(batch, dtype=I64, device=device)
    lens = torch.tensor(LENS[:batch], dtype=I64, device=device)
    num_real = torch.tensor([max(batch - 1, 1)], dtype=I32, device=device)
    # the coordinator's output buffer: more rows and columns than this call's (left alone beyond them)
    out = torch.full((R + 2, BLOCKS * BS + 5), -9, dtype=I32, device=device)
    sg.load_blocks_to_device_buffer_mha(*tables.positional(blocks, out, rids, lens, num_real))
    want = torch.full((batch, BLOCKS * BS), -9, dtype=I32, device=device)
    twin.reference(blocks, want, rids, lens, num_real)
    assert torch.equal(out[:batch, : BLOCKS * BS], want)
    assert bool((out[batch:] == -9).all()) and bool((out[:, BLOCKS * BS :] == -9).all())
    if batch > 1:
        assert out[batch - 1, : BLOCKS * BS].tolist() == [-1] * (BLOCKS * BS)  # the padding row
    _equal(tables, twin)
    plan = sg.last_miss_plan(device)
    assert plan is not None and plan.src.shape == (batch, BLOCKS * BS)


def test_the_adapter_keeps_sglangs_newest_token_rule(device):
    """SGLang serves the newest token from slot HOT's row whatever req_device_buffer_tokens says there; the adapter
    keeps that (docs/sglang.md), where the native API's default resolves it to -1 (docs/kernels.md §2 rule 11)."""
    tables = Tables(device, LENS, seed=7)
    tables.tokens[0, HOT] = LENS[0] - 2  # request 0's slot HOT still names the token before its newest
    twin, native = tables.clone(), tables.clone()
    newest = LENS[0] - 1
    blocks = torch.tensor([[newest // BS, 2, -1], [0, 1, 2]], dtype=I32, device=device)
    rids = torch.tensor([0, 1], dtype=I64, device=device)
    lens = torch.tensor(LENS[:2], dtype=I64, device=device)
    out = torch.empty((2, BLOCKS * BS), dtype=I32, device=device)
    sg.load_blocks_to_device_buffer_mha(*tables.positional(blocks, out, rids, lens))
    want = torch.empty_like(out)
    twin.reference(blocks, want, rids, lens)
    assert torch.equal(out, want)
    _equal(tables, twin)
    assert int(out[0, newest % BS]) == int(tables.locs[0, HOT])  # SGLang's rule: slot HOT, whatever it holds
    native_out = torch.empty_like(out)
    native.reference(blocks, native_out, rids, lens, check_newest=True)
    assert int(native_out[0, newest % BS]) == -1  # the native rule


def test_keywords_as_the_coordinator_passes_them_and_a_replay_into_another_layer(device):
    tables = Tables(device, LENS, seed=3)
    twin = tables.clone()
    blocks = torch.tensor([[14, 3, -1], [1, 0, 2], [5, 6, 7], [17, 16, 2]], dtype=I32, device=device)
    rids = torch.tensor([2, 1, 0, 3], dtype=I32, device=device)
    lens = torch.tensor([LENS[2], LENS[1], LENS[0], LENS[3]], dtype=I32, device=device)
    out = torch.empty((4, BLOCKS * BS), dtype=I32, device=device)
    sg.load_blocks_to_device_buffer_mha(
        top_k_blocks=blocks, device_buffer_tokens=tables.tokens, host_cache_locs=tables.host_locs,
        device_buffer_locs=tables.locs, host_cache_k=tables.host_k, host_cache_v=tables.host_v,
        device_buffer_k=tables.dev_k, device_buffer_v=tables.dev_v, top_k_device_locs=out, req_pool_indices=rids,
        seq_lens=lens, lru_slots=tables.lru, item_size_bytes=ITEM, hot_buffer_size=HOT, sparse_block_size=BS,
    )  # fmt: skip
    want = torch.empty_like(out)
    twin.reference(blocks, want, rids, lens)
    assert torch.equal(out, want)
    _equal(tables, twin)
    # another layer sharing the selection: the recorded plan into its own K and V caches
    plan = sg.last_miss_plan(device)
    assert int(plan.count.clamp(min=0).sum()) > 0
    layer_k, layer_v = tables.host_k.flip(0).contiguous(), tables.host_v.flip(0).contiguous()
    into_k, into_v = torch.zeros_like(tables.dev_k), torch.zeros_like(tables.dev_v)
    sg.pool_for(device).replay(
        plan, host_cache=layer_k.view(-1, HEADS * DIM), device_buffer=into_k.view(-1, HEADS * DIM),
        host_cache_v=layer_v.view(-1, HEADS * DIM), device_buffer_v=into_v.view(-1, HEADS * DIM),
    )  # fmt: skip
    want_k, want_v = torch.zeros_like(into_k), torch.zeros_like(into_v)
    row = HEADS * DIM
    ref.copy_planned(plan, layer_k.view(-1, row), want_k.view(-1, row), host_cache_v=layer_v.view(-1, row),
                     device_buffer_v=want_v.view(-1, row))  # fmt: skip
    assert torch.equal(into_k, want_k) and torch.equal(into_v, want_v)


def test_skip_io_resolves_and_records_but_moves_no_bytes(device):
    tables = Tables(device, LENS, seed=5)
    twin = tables.clone()
    blocks = torch.tensor([[3, 9, 12], [0, 1, -1]], dtype=I32, device=device)
    rids = torch.tensor([0, 2], dtype=I64, device=device)
    lens = torch.tensor([LENS[0], LENS[2]], dtype=I64, device=device)
    out = torch.empty((2, BLOCKS * BS), dtype=I32, device=device)
    sg.load_blocks_to_device_buffer_mha(*tables.positional(blocks, out, rids, lens), skip_io=True)
    want = torch.empty_like(out)
    twin_before = twin.clone()
    twin.reference(blocks, want, rids, lens)
    assert torch.equal(out, want) and torch.equal(tables.tokens, twin.tokens) and torch.equal(tables.lru, twin.lru)
    assert torch.equal(tables.dev_k, twin_before.dev_k) and torch.equal(tables.dev_v, twin_before.dev_v)


def _refused(device, **change):
    tables = Tables(device, LENS)
    blocks = torch.zeros((2, BLOCKS), dtype=I32, device=device)
    out = torch.empty((2, BLOCKS * BS), dtype=I32, device=device)
    rids = torch.arange(2, dtype=I64, device=device)
    args = list(tables.positional(blocks, out, rids, torch.tensor(LENS[:2], device=device)))
    names = list(inspect.signature(sg.load_blocks_to_device_buffer_mha).parameters)
    args += [inspect.signature(sg.load_blocks_to_device_buffer_mha).parameters[n].default for n in names[len(args) :]]
    for name, value in change.items():
        args[names.index(name)] = value(tables) if callable(value) else value
    before = tables.clone()
    return args, tables, before


def test_sglangs_refusals_with_sglangs_texts_and_nothing_written(device):
    args, tables, before = _refused(device, hot_buffer_size=BLOCKS * BS - 1)
    with pytest.raises(ValueError, match=re.escape(f"hot_buffer_size ({BLOCKS * BS - 1}) must be >= selected tokens "
                                                   f"({BLOCKS * BS})")):  # fmt: skip
        sg.load_blocks_to_device_buffer_mha(*args)
    _equal(tables, before)
    wide = lambda t: torch.zeros((R * MAX_LEN, HEADS, DIM + 4), dtype=torch.bfloat16, device=device)[..., :DIM]  # noqa: E731
    args, tables, before = _refused(device, host_cache_v=wide)
    text = (f"K/V token strides must equal item_size_bytes: k_stride={ITEM}, v_stride={ITEM + 16}, "
            f"item_size_bytes={ITEM}")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(text)):
        sg.load_blocks_to_device_buffer_mha(*args)
    _equal(tables, before)
    args, tables, before = _refused(device, item_size_bytes=ITEM * 2)
    with pytest.raises(ValueError, match="K/V token strides must equal item_size_bytes: k_stride=16, v_stride=16"):
        sg.load_blocks_to_device_buffer_mha(*args)


@pytest.mark.parametrize(
    "change, error, text",
    [
        (dict(page_size=2), ValueError, "page_size=2 is not supported"),
        (dict(top_k_device_locs=lambda t: torch.empty((2, BLOCKS * BS - 1), dtype=I32)), ValueError,
         "top_k_device_locs must have shape [>= batch=2, >= num_blocks * sparse_block_size=12]"),
        (dict(host_cache_v=lambda t: t.host_v.to(torch.float16)), ValueError,
         "host_cache_v must have host_cache's dtype"),
        (dict(device_buffer_v=lambda t: t.dev_v[:-1]), ValueError, "device_buffer_v must have device_buffer's shape"),
        (dict(sparse_block_size=0), ValueError, "sparse_block_size must be a positive int"),
        (dict(skip_io="no"), TypeError, "skip_io must be a bool"),
        (dict(lru_slots=lambda t: t.lru[:, :-1]), ValueError,
         "lru_slots must have shape [num_requests, hot_buffer_size"),
    ],
)  # fmt: skip
def test_other_refusals_name_the_argument_and_write_nothing(device, change, error, text):
    change = {k: (lambda t, v=v: v(t).to(device)) if callable(v) else v for k, v in change.items()}
    args, tables, before = _refused(device, **change)
    with pytest.raises(error, match=re.escape(text)):
        sg.load_blocks_to_device_buffer_mha(*args)
    _equal(tables, before)


@pytest.mark.gpu
def test_gpu_adapter_with_pinned_caches_matches_the_reference():
    dev = torch.device("cuda")
    tables = Tables(dev, LENS, seed=9)
    tables.host_k, tables.host_v = tables.host_k.cpu().pin_memory(), tables.host_v.cpu().pin_memory()
    twin = tables.clone()
    twin.host_k, twin.host_v = tables.host_k, tables.host_v
    blocks = torch.tensor([[14, 3, -1], [1, 0, 2], [5, 6, 7], [17, 16, 2]], dtype=I32, device=dev)
    rids = torch.arange(4, dtype=I64, device=dev)
    lens = torch.tensor(LENS, dtype=I64, device=dev)
    num_real = torch.tensor([3], dtype=I32, device=dev)
    out = torch.empty((4, BLOCKS * BS), dtype=I32, device=dev)
    sg.load_blocks_to_device_buffer_mha(*tables.positional(blocks, out, rids, lens, num_real))
    want = torch.empty_like(out)
    twin.reference(blocks, want, rids, lens, num_real)
    assert torch.equal(out, want)
    _equal(tables, twin)
