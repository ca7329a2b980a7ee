"""The swap-in's hash tables are never emptied per call (kvplan.workspace: epochs instead of clearing).

A table entry is live only under its call's stamp (7 bits of the row's epoch and which table); every other entry reads
as free. A row's table is emptied only when its tags could repeat (``TAG_PERIOD`` epochs since it was last emptied)
or when its words, or row 0's, do not vouch for it (a fresh or foreign workspace, another layout over the same
storage). These tests keep one workspace across calls and check every call against the reference, the decision each
call records (row word ``EMPTIES``), and the stale entries a call must read as free.
"""

from __future__ import annotations

import importlib

import attrs
import pytest
import torch
from helpers.swap_in_scenarios import PATHS, assert_same, build, decode_loop, run, small_launch

from kvplan import HotBufferState, kernels, reference
from kvplan.plan import MissPlan
from kvplan.workspace import (
    CLEARED,
    EMPTIES,
    EPOCH,
    FORMAT,
    MAX_OCCURRENCES,
    TAG_PERIOD,
    forget_tables,
    swap_in_workspace_columns,
    swap_in_workspace_regions,
)

swap_in_module = importlib.import_module("kvplan.kernels.hisparse")

I32, I64 = torch.int32, torch.int64
COMMON = dict(batch=3, top_k=8, hot=16, tail=4, max_len=160, requests=4, rids=[2, 0, 3], scratch=2, steps=3)


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch):
    """Each of the three ways a call runs, with rows spread over several chunks. A plan in miss order takes the
    Triton resolve on a GPU too: the on-chip resolve keeps such a row's tables in shared memory and leaves the
    workspace's tables and epoch words alone (its sorted plans keep them: the other two paths)."""
    launch = small_launch(request.param)
    if request.param == "flat":
        launch = attrs.evolve(launch, resolve="triton")
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", launch)
    return request.param


class Loop:
    """Speculative calls on one workspace: kernel and reference each carry their own state (as ``decode_loop``)."""

    def __init__(self, device, seed: int = 3):
        self.device, self.seed = device, seed
        self.lens = [60, 40, 90]
        first = build(seed=seed, speculative=True, lens=self.lens, device=device, **COMMON)
        self.host_cache = first.host_cache
        self.k_state, self.r_state = first.state, first.state.clone()
        self.k_dev, self.r_dev = first.device_buffer, first.device_buffer.clone()
        columns = swap_in_workspace_columns(COMMON["steps"], COMMON["top_k"])
        self.ws = torch.full((COMMON["batch"], columns), -11, dtype=I64, device=device)
        self.calls = 0

    def words(self, word: int) -> list[int]:
        """Row word ``word`` of every row."""
        return self.ws.view(I32)[:, word].tolist()

    def next_scenario(self):
        steps, tail = COMMON["steps"], COMMON["tail"]
        for rid, length in zip(COMMON["rids"], self.lens):
            draft = torch.arange(length - 1, length + steps - 1)[:tail]
            self.k_state.write_tail(rid, draft)
            self.r_state.write_tail(rid, draft)
        scn = build(seed=self.seed + 100 + self.calls, speculative=True, lens=self.lens, device=self.device,
                    miss_rate=0.5, state=self.k_state, host_cache=self.host_cache, device_buffer=self.k_dev,
                    **COMMON)  # fmt: skip
        self.lens = [length + steps for length in self.lens]
        self.calls += 1
        return scn

    def call(self, scn=None) -> None:
        scn = scn if scn is not None else self.next_scenario()
        k = run(kernels, scn, state=self.k_state, device_buffer=self.k_dev, workspace=self.ws)
        r = run(reference, scn, state=self.r_state, device_buffer=self.r_dev)
        assert_same(k, r)


def write_live_entries(loop: Loop, scn):
    """Fill every row's token table with entries live under the next call's stamp, each holding one of the call's
    tokens at a low occurrence (tables written between calls); returns the layout."""
    layout = swap_in_workspace_regions(COMMON["steps"], COMMON["top_k"])
    tb = layout.table_size
    words = loop.ws.view(I32)
    tokens = scn.top_k_tokens.reshape(COMMON["batch"], -1).cpu().clamp(min=0).to(I64)
    for b in range(COMMON["batch"]):
        stamp = (int(words[b, EPOCH]) + 1) % TAG_PERIOD * 2
        key = tokens[b][torch.arange(tb) % tokens.shape[1]]
        entries = (stamp << 55) | (key << 24) | (torch.arange(tb) % 3)
        words[b, layout.keys : layout.keys + 2 * tb].view(I64).copy_(entries.to(words.device))
    return layout


def test_a_workspace_kept_across_calls_empties_its_tables_only_when_it_must(path, device):
    loop = Loop(device)
    loop.call()
    assert loop.words(EMPTIES) == [1, 1, 1]  # a workspace full of garbage vouches for nothing
    first_epoch = loop.words(EPOCH)
    for _ in range(3):
        loop.call()
        assert loop.words(EMPTIES) == [0, 0, 0]  # the entries of earlier calls read as free
    assert loop.words(EPOCH) == [e + 3 for e in first_epoch]
    # the tags would repeat at the next call: emptied then, and not after
    words = loop.ws.view(I32)
    words[:, CLEARED] = words[:, EPOCH] + 1 - TAG_PERIOD
    loop.call()
    assert loop.words(EMPTIES) == [1, 1, 1]
    loop.call()
    assert loop.words(EMPTIES) == [0, 0, 0]
    # epochs count in 31 bits and wrap; one row's words alone say its table is foreign
    words[:, EPOCH] = 0x7FFFFFFF
    words[:, CLEARED] = 0x7FFFFFFF - 5
    words[1, FORMAT] ^= 1
    loop.call()
    assert loop.words(EPOCH) == [0, 0, 0]
    assert loop.words(EMPTIES) == [0, 1, 0]
    loop.call()
    assert loop.words(EMPTIES) == [0, 0, 0]


def test_row_zeros_format_word_speaks_for_the_whole_workspace(path, device):
    """Row 0's words sit at the same place in every layout: another layout's call over the storage shows there."""
    loop = Loop(device)
    loop.call()
    loop.call()
    loop.ws.view(I32)[0, FORMAT] += 1
    loop.call()
    assert loop.words(EMPTIES) == [1, 1, 1]


def test_stale_entries_under_every_other_stamp_read_as_free(path, device):
    """Fill every row's table with entries of the next call's tokens and host rows under every stamp but the two the
    next call uses (earlier and later epochs of both tables): the call must read them all as free."""
    loop = Loop(device)
    loop.call()
    scn = loop.next_scenario()
    layout = swap_in_workspace_regions(COMMON["steps"], COMMON["top_k"])
    tb = layout.table_size
    epoch = loop.ws.view(I32)[:, EPOCH].to(I64) + 1
    gen = torch.Generator().manual_seed(11)
    tokens = scn.top_k_tokens.reshape(COMMON["batch"], -1).cpu().clamp(min=0).to(I64)
    for b in range(COMMON["batch"]):
        token_stamp = int(epoch[b]) % TAG_PERIOD * 2
        stamps = torch.tensor([s for s in range(256) if s not in (token_stamp, token_stamp + 1)], dtype=I64)
        stamp = stamps[torch.randint(len(stamps), (tb,), generator=gen)]
        rid = COMMON["rids"][b]
        hosts = loop.k_state.host_cache_locs[rid].cpu().clamp(min=0)
        key = torch.where(
            torch.rand(tb, generator=gen) < 0.5,
            tokens[b][torch.randint(tokens.shape[1], (tb,), generator=gen)],
            hosts[torch.randint(len(hosts), (tb,), generator=gen)],
        )
        low = torch.randint(0, 1 << 24, (tb,), generator=gen, dtype=I64)
        entries = (stamp << 55) | (key << 24) | low
        keys = loop.ws.view(I32)[b, layout.keys : layout.keys + 2 * tb].view(I64)
        keys.copy_(entries.to(keys.device))
    loop.call(scn)
    assert loop.words(EMPTIES) == [0, 0, 0]  # not emptied: read as free


def test_calls_of_two_layouts_over_one_storage_equal_the_reference(path, device):
    """Speculative and single-step calls alternate over one storage, as a pool's views of its workspace buffer do."""
    common = dict(batch=2, top_k=8, hot=16, tail=4, max_len=96, requests=3, rids=[2, 0], scratch=2, steps=3)
    columns = swap_in_workspace_columns(3, 8)
    storage = torch.full((2 * columns,), -11, dtype=I64, device=device)
    decode_loop(device, common, lens=[30, 12], calls=7, workspace_storage=storage)


def test_more_occurrences_than_a_table_entry_holds_are_refused(device):
    """A table entry keeps an occurrence in 24 bits: a row of more is refused before anything is allocated."""
    tokens = torch.zeros(1, 1, 1, dtype=I32, device=device).expand(1, 1, MAX_OCCURRENCES + 1)
    scn = build(seed=0, speculative=True, lens=[40], device=device, **{**COMMON, "batch": 1, "rids": [0]})
    with pytest.raises(ValueError, match=rf"top_k_tokens must have steps \* top_k <= {MAX_OCCURRENCES}"):
        kernels.swap_in(scn.state, tokens, tokens, scn.req_pool_indices, scn.seq_lens, scn.host_cache,
                        scn.device_buffer)  # fmt: skip


def test_tables_written_between_calls_never_send_a_read_or_write_outside_the_tensors(path, device):
    """A workspace whose words still vouch for its tables but whose tables were written between calls (every entry
    live-looking, for the next call's tokens, hit slots past HOT) gives a wrong plan, never an access outside the
    tensors and never an endless search (the hot tokens' lookups find no free entry to stop at): the tables' rows sit
    inside wide buffers whose padding holds a sentinel the call must neither read nor change."""
    loop = Loop(device)
    loop.call()
    scn = loop.next_scenario()
    # the kernel's state tables as views of rows 70,000 wide (a slot read up to 65,535 past a row stays inside)
    sentinel, width = 99_999, 70_000
    state = loop.k_state
    wide = {}
    for name in ("device_buffer_tokens", "device_buffer_locs"):
        table = getattr(state, name)
        buffer = torch.full((table.shape[0], width), sentinel, dtype=table.dtype, device=device)
        buffer[:, : table.shape[1]] = table
        wide[name] = buffer
    tables = HotBufferState(
        wide["device_buffer_tokens"][:, : state.device_buffer_tokens.shape[1]],
        wide["device_buffer_locs"][:, : state.device_buffer_locs.shape[1]],
        state.lru_slots, state.host_cache_locs, state.scratch_locs,
    )  # fmt: skip
    # every entry live under the next call's stamp, holding one of its tokens at a low occurrence, its hit slot 65,535
    layout = write_live_entries(loop, scn)
    loop.ws.view(I32)[:, layout.hot : layout.hot + layout.table_size] = 0xFFFF
    out = torch.full_like(scn.top_k_tokens, -7)
    plan = MissPlan.allocate(COMMON["batch"], COMMON["steps"] * COMMON["top_k"], device)
    kernels.swap_in(tables, scn.top_k_tokens, out, scn.req_pool_indices, scn.seq_lens, scn.host_cache, loop.k_dev,
                    plan=plan, workspace=loop.ws)  # fmt: skip
    assert loop.words(EMPTIES) == [0, 0, 0]  # the words vouched: the tables were taken as they were
    assert not (out == sentinel).any(), "a slot past the table's row was read"
    for name, buffer in wide.items():
        assert (buffer[:, getattr(state, name).shape[1] :] == sentinel).all(), f"{name}: padding written"


def test_a_workspace_the_kernels_allocate_forgets_what_its_memory_held(path, device, monkeypatch):
    """Without a workspace the kernels allocate one; ``torch.empty`` may hand back an earlier workspace's storage
    whose words still vouch for its tables while the tables hold live-looking entries (here: every entry live under
    the next call's stamp, as the test above leaves them). The call must still equal the reference."""
    loop = Loop(device)
    loop.call()
    scn = loop.next_scenario()
    write_live_entries(loop, scn)
    stale, handed = loop.ws.clone(), []
    real_empty = torch.empty

    def empty(*size, **kwargs):
        if kwargs.get("dtype") == I64 and tuple(size) == tuple(stale.shape):
            handed.append(size)
            return stale
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    k = run(kernels, scn, state=loop.k_state, device_buffer=loop.k_dev)
    monkeypatch.setattr(torch, "empty", real_empty)
    r = run(reference, scn, state=loop.r_state, device_buffer=loop.r_dev)
    assert handed, "the kernels did not allocate the workspace"
    assert stale.view(I32)[:, EMPTIES].tolist() == [1, 1, 1]  # vouched for nothing: every table emptied
    assert_same(k, r)


def test_forget_tables_writes_row_zeros_words_of_any_workspace_view():
    """Callers bring their own workspace, possibly a strided view of a larger buffer: only row 0's words change."""
    buffer = torch.full((3, 40), 5, dtype=torch.int64)
    view = buffer[:, 2:30]  # rows 40 apart
    forget_tables(view)
    assert view.view(torch.int32)[0, :8].tolist() == [-1] * 8
    assert (buffer[0, :2] == 5).all() and (buffer[0, 6:] == 5).all() and (buffer[1:] == 5).all()
    forget_tables(torch.empty(0, 28, dtype=torch.int64))  # nothing to write
