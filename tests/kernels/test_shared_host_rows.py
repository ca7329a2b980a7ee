"""Host rows shared within a call (kvplan.kernels.hisparse, kvplan.kernels.copy): requests whose misses map to the
same host rows (SGLang's benchmark: every request on the same rows), and distinct tokens of one request on one host row.

Each distinct host row is read from the host once per call: the swap-in records, per plan entry, the entry whose
device row receives the same host row (``shared_from`` in the workspace), and every copy of the plan (its own and each
replay given the workspace) copies the others on the device. These tests check the results against the reference on
every path a call takes, the record itself (one host read per distinct host row), replays, and copies given a
workspace that is garbage or of the wrong shape.
"""

from __future__ import annotations

import importlib

import attrs
import pytest
import torch
from helpers.swap_in_scenarios import PATHS, Guard, assert_same, build, run, small_launch

from kvplan import kernels, reference
from kvplan.counters import new_counters
from kvplan.plan import MissPlan
from kvplan.workspace import (
    DISPATCH,
    HOST_ROW_LIMIT,
    ROW_WORDS,
    SHARED,
    swap_in_workspace_columns,
    swap_in_workspace_regions,
)

swap_in_module = importlib.import_module("kvplan.kernels.hisparse")

I32, I64 = torch.int32, torch.int64


def _shared_scenario(
    device, *, speculative: bool, batch: int = 4, same_row_tokens: int = 6, seed: int = 5, host_rows: int | None = None
):
    """``batch`` identical requests (same tokens, hot state and host rows; their own device rows), and within each
    request ``same_row_tokens`` tokens whose host row is another token's."""
    base = dict(steps=3, top_k=24, hot=40, tail=4, max_len=300, scratch=6) if speculative else dict(
        top_k=40, hot=48, tail=2, max_len=300)  # fmt: skip
    scn = build(seed=seed, speculative=speculative, batch=batch, lens=[200] * batch, miss_rate=0.6, dup_rate=0.1,
                invalid_rate=0.0, newest_rate=0.0, host_rows=host_rows, device=device, **base)  # fmt: skip
    state, rids = scn.state, scn.req_pool_indices.tolist()
    first = rids[0]
    rows = state.host_cache_locs[first].clone()
    rows[100 : 100 + same_row_tokens] = rows[0]  # several tokens on host row rows[0] (and so on one row per request)
    for rid in rids:
        state.host_cache_locs[rid] = rows
        state.device_buffer_tokens[rid] = state.device_buffer_tokens[first]
        state.lru_slots[rid] = state.lru_slots[first]
    scn.top_k_tokens[:] = scn.top_k_tokens[0].clone()
    return scn


def _swap_in_with_workspace(scn, device):
    """The kernel's swap-in on copies, with a workspace (returned) full of garbage before the call."""
    state, dev = scn.state.clone(), scn.device_buffer.clone()
    steps = scn.top_k_tokens.shape[1] if scn.speculative else 1
    n = steps * scn.top_k_tokens.shape[-1]
    ws = torch.randint(-5, 5, (scn.batch, swap_in_workspace_columns(steps, scn.top_k_tokens.shape[-1])), dtype=I64,
                       device=device)  # fmt: skip
    plan = MissPlan.allocate(scn.batch, n, device)
    kernels.swap_in(state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens), scn.req_pool_indices, scn.seq_lens,
                    scn.host_cache, dev, num_real_reqs=scn.num_real_reqs, plan=plan, workspace=ws)  # fmt: skip
    return plan, ws


def _record(plan: MissPlan, ws: torch.Tensor):
    """Every plan entry as (row, m, host row, shared_from), from the workspace's record."""
    words = ws.view(I32)
    entries = []
    for b in range(plan.src.shape[0]):
        n = int(plan.count[b])
        shares = int(words[b, SHARED]) > 0
        for m in range(n):
            entries.append((b, m, int(plan.src[b, m]), int(words[b, ROW_WORDS + m]) if shares else -1))
    return entries


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_identical_requests_equal_the_reference_on_every_path(path, speculative, monkeypatch, device):
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
    scn = _shared_scenario(device, speculative=speculative)
    guard = Guard()
    kernel = run(kernels, scn, guard=guard, workspace=True)
    guard.check()
    ref = run(reference, scn)
    assert int(ref.miss_count.sum()) > 2 * int(ref.miss_count[0])  # several requests copied the same host rows
    assert_same(kernel, ref)


@pytest.mark.parametrize("path", ["sorted", "per_row"])
def test_each_distinct_host_row_is_read_once(path, monkeypatch, device):
    """The record: one entry per distinct host row reads the host; every other entry names an entry holding the
    same host row that reads it."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
    scn = _shared_scenario(device, speculative=True)
    plan, ws = _swap_in_with_workspace(scn, device)
    entries = _record(plan, ws)
    stride = plan.src.stride(0)
    readers = {}
    for b, m, host, shared_from in entries:
        if shared_from < 0:
            assert host not in readers, f"host row {host} read twice"
            readers[host] = (b, m)
    assert set(readers) == {host for _, _, host, _ in entries}  # every distinct host row read once
    assert len(readers) < len(entries) // 2  # most entries share (4 identical requests)
    for _, _, host, shared_from in entries:
        if shared_from >= 0:
            ob, om = divmod(shared_from, stride)
            assert int(plan.src[ob, om]) == host and readers[host] == (ob, om)


def _colliding_host_rows(count: int, table_entries: int, below: int) -> list[int]:
    """Host rows < ``below`` whose first entry in the call's table of host rows (``table_entries`` entries: the
    kernels' ``_claim_host_rows``) is one of two adjacent entries: one probe chain many windows long."""
    h = torch.arange(below, dtype=I64)
    mixed = (h * 0x61C88647) & 0xFFFFFFFF
    mixed = mixed ^ (mixed >> 15)
    slot = (mixed * table_entries) >> 32
    same = h[(slot == slot[3]) | (slot == (slot[3] + 1) % table_entries)]
    assert same.numel() >= count
    return same[torch.randperm(same.numel(), generator=torch.Generator().manual_seed(1))[:count]].tolist()


@pytest.mark.parametrize("path", ["sorted", "per_row"])
def test_host_rows_colliding_in_the_calls_table_are_each_read_once(path, monkeypatch, device):
    """Long probe chains in the call's table of host rows: 40 host rows (shared by every request) whose first entry is
    one of two, many probe windows deep. Exact, and each distinct host row still read once."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
    scn = _shared_scenario(device, speculative=True, host_rows=1 << 16)
    steps, top_k = scn.top_k_tokens.shape[1], scn.top_k_tokens.shape[-1]
    entries = scn.batch * swap_in_workspace_regions(steps, top_k).table_size
    colliding = torch.tensor(_colliding_host_rows(40, entries, scn.host_cache.shape[0]), dtype=I64, device=device)
    for rid in scn.req_pool_indices.tolist():
        scn.state.host_cache_locs[rid, : colliding.numel()] = colliding
    scn.top_k_tokens[:, :, :20] = torch.arange(20, dtype=scn.top_k_tokens.dtype, device=device)  # misses among them
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))
    plan, ws = _swap_in_with_workspace(scn, device)
    entries_read = [(b, m, host) for b, m, host, shared_from in _record(plan, ws) if shared_from < 0]
    hosts = [host for _, _, host in entries_read]
    assert len(hosts) == len(set(hosts)) == len({host for _, _, host, _ in _record(plan, ws)})
    assert len(set(hosts) & set(colliding.tolist())) >= 8  # several colliding host rows were misses


@pytest.mark.parametrize("path", ["sorted", "per_row"])
def test_a_launch_that_shares_no_host_rows_reads_each_entry_from_the_host(path, monkeypatch, device):
    """``ResolveLaunch(shared_rows=False)`` (what the benchmark times to price sharing): the same results, no entry
    recorded as shared, so every entry reads the host."""
    launch = attrs.evolve(small_launch(path), shared_rows=False)
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", launch)
    scn = _shared_scenario(device, speculative=True)
    assert_same(run(kernels, scn, workspace=True), run(reference, scn))
    plan, ws = _swap_in_with_workspace(scn, device)
    assert all(int(w) == 0 for w in ws.view(I32)[:, SHARED])
    assert len(_record(plan, ws)) == int(plan.count.sum()) > 0


@pytest.mark.parametrize("span", ["never", "always"])
def test_the_copy_choosing_its_work_counter_on_the_device_equals_the_reference(span, monkeypatch, device):
    """Random host rows (few shared): the swap-in's copy takes the work counter when the plan spans enough host rows
    and has enough entries (decided on the device). Both choices give the reference's results; the counter shows
    which was taken, and the next call on the same workspace (its resolve zeroes the counter) is exact again."""
    launch_module = importlib.import_module("kvplan.kernels.plan_copy.launch")
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch("sorted"))
    monkeypatch.setattr(launch_module, "DYNAMIC_SPAN_BYTES", 1 << 62 if span == "never" else 0)
    monkeypatch.setattr(launch_module, "DYNAMIC_MIN_ENTRIES", 4)
    scn = _random_rows_scenario(device)
    steps, top_k = scn.top_k_tokens.shape[1], scn.top_k_tokens.shape[-1]
    ws = torch.full((scn.batch, swap_in_workspace_columns(steps, top_k)), -3, dtype=I64, device=device)
    kernel = run(kernels, scn, workspace=ws)  # (no launch records: each call checked and launched under its setting)
    handed_out = int(ws.view(I32)[0, DISPATCH])
    again = run(kernels, scn, workspace=ws)
    ref = run(reference, scn)
    assert_same(kernel, ref)
    assert_same(again, ref)
    assert int(ref.miss_count.sum()) >= 4
    if span == "never":
        assert handed_out == 0
    else:  # every item taken from the counter (the resolve zeroed it), then one ticket more per reading program
        assert handed_out > 0


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "single"])
def test_a_replay_given_the_workspace_equals_the_reference(speculative, monkeypatch, device):
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch("sorted"))
    scn = _shared_scenario(device, speculative=speculative)
    plan, ws = _swap_in_with_workspace(scn, device)
    other_host = torch.randint(0, 256, scn.host_cache.shape, dtype=torch.uint8).view(scn.host_cache.dtype).to(device)
    dev, ref_dev = (torch.zeros_like(scn.device_buffer) for _ in range(2))
    counters, ref_counters = new_counters(device), new_counters(device)
    reference.copy_planned(plan, other_host, ref_dev, counters=ref_counters)
    kernels.copy_planned(plan, other_host, dev, counters=counters, workspace=ws)
    assert torch.equal(dev.view(torch.uint8), ref_dev.view(torch.uint8))
    assert torch.equal(counters, ref_counters)
    assert int(ws.view(I32)[:, SHARED].sum()) > 0  # the replay had shared entries to copy on the device


def _random_rows_scenario(device):
    """Three requests on random host rows of a large cache: few host rows repeat."""
    return build(seed=9, speculative=True, batch=3, steps=3, top_k=24, hot=40, tail=4, max_len=300, scratch=6,
                 lens=[200, 150, 260], miss_rate=0.6, host_rows=1 << 16, device=device)  # fmt: skip


@pytest.mark.parametrize("path", ["sorted", "per_row"])
def test_the_span_words_hold_each_rows_lowest_and_highest_host_row(path, monkeypatch, device):
    """The share step leaves in each row's span words (``kvplan.workspace``) the lowest and highest host row the
    row's plan reads, entries outside ``host_cache`` left out: the swap-in's copy chooses its work counter from them
    without reading the plan first."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch(path))
    scn = _random_rows_scenario(device)
    n_host = scn.host_cache.shape[0]
    rows = scn.state.host_cache_locs
    rows[:, ::5] = n_host + 3  # tokens whose host row is outside the cache: in the plan, never read
    rows[:, 1::11] = 7  # and one host row many tokens hold
    plan, ws = _swap_in_with_workspace(scn, device)
    steps, top_k = scn.top_k_tokens.shape[1], scn.top_k_tokens.shape[-1]
    span = swap_in_workspace_regions(steps, top_k).span
    words = ws.view(I32)
    outside = checked = 0
    for b in range(scn.batch):
        src = plan.src[b, : int(plan.count[b])]
        inside = src[(src >= 0) & (src < n_host)]
        outside += int(src.numel() - inside.numel())
        if inside.numel():
            assert int(words[b, span]) == HOST_ROW_LIMIT - int(inside.min())
            assert int(words[b, span + 1]) == int(inside.max()) + 1
            checked += 1
    assert checked == scn.batch and outside > 0


def _planned(scn):
    """The launch planner's decision for the scenario's call (with the launch the test set)."""
    from kvplan.calls import swap_in_call
    from kvplan.kernels import planner
    from kvplan.validate.arguments import check_swap_in

    call = swap_in_call(scn.speculative, scn.state, scn.top_k_tokens, torch.empty_like(scn.top_k_tokens),
                        scn.req_pool_indices, scn.seq_lens, scn.host_cache, scn.device_buffer, scn.num_real_reqs,
                        None, None, None)  # fmt: skip
    return planner.plan_swap_in(call, check_swap_in(call), swap_in_module.RESOLVE_LAUNCH, scn.occurrences)


def _launched(monkeypatch) -> list[str]:
    """The name of every kernel launched from now on, recorded or not."""
    launch_replay = importlib.import_module("kvplan.runtime.launch_replay")
    launched = []
    for kind in (launch_replay.Recorder, type(launch_replay.UNRECORDED)):
        original = kind.launch

        def recording(self, fn, grid, *args, original=original, **kwargs):
            launched.append(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
            return original(self, fn, grid, *args, **kwargs)

        monkeypatch.setattr(kind, "launch", recording)
    return launched


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "random"])
def test_the_swap_ins_copy_is_one_launch_and_a_replays_two(shared, monkeypatch, device):
    """Above the flat batches the swap-in's own copy reads the host and copies the shared entries in one launch
    (``_copy_reads_then_shared_kernel``), whether or not its entries share host rows; a replay given the workspace
    takes two (the host reads, then the shared entries)."""
    monkeypatch.setattr(swap_in_module, "RESOLVE_LAUNCH", small_launch("sorted"))
    scn = _shared_scenario(device, speculative=True) if shared else _random_rows_scenario(device)
    launched = _launched(monkeypatch)  # (the kernels keep no launch records: every call below launches)
    plan, ws = _swap_in_with_workspace(scn, device)
    # (after the on-chip resolve, whose blocks claim host rows themselves, no share launch)
    share_launch = [] if _planned(scn).share_launch is False else ["_sort_plan_kernel"]
    assert launched[-1 - len(share_launch) :] == [*share_launch, "_copy_reads_then_shared_kernel"]
    assert [name for name in launched if name.startswith("_copy_")] == ["_copy_reads_then_shared_kernel"]
    assert (int(ws.view(I32)[:, SHARED].sum()) > 0) == shared
    launched.clear()
    kernels.copy_planned(plan, scn.host_cache, torch.zeros_like(scn.device_buffer), workspace=ws)
    assert [name for name in launched if name.startswith("_copy_")] == [
        "_copy_host_reads_kernel",
        "_copy_shared_entries_kernel",
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_copy_given_a_garbage_workspace_equals_the_reference_within_bounds(seed, device):
    """Row words and ``shared_from`` hostile: shared flags on rows that share nothing, offsets past the plan,
    negative, at entries of other host rows, at entries that are themselves shared, at rows past the count."""
    gen = torch.Generator().manual_seed(seed)
    batch, columns, n_host, n_dev = 4, 7, 12, 40
    src = torch.randint(n_host, (batch, columns), generator=gen)  # few host rows: many equal sources
    dst = torch.randperm(n_dev, generator=gen)[: batch * columns].reshape(batch, columns).to(I32)
    count = torch.tensor([7, 3, 0, 5], dtype=I32)
    plan = MissPlan(src.to(device), dst.to(device), count.to(device))
    words = 4 + (ROW_WORDS + columns + 1) // 2
    ws = torch.randint(-(2**40), 2**40, (batch, words), generator=gen, dtype=I64)
    w32 = ws.view(I32)
    w32[:, SHARED] = torch.tensor([1, 0, 5, 1], dtype=I32)
    w32[:, ROW_WORDS : ROW_WORDS + columns] = torch.randint(-3, batch * columns + 9, (batch, columns), generator=gen)
    host = torch.randint(0, 256, (n_host, 12), dtype=torch.uint8, generator=gen).to(device)
    guard = Guard()
    ws_g = guard.embed("workspace", ws.to(device), 3)
    dev = guard.embed("device_buffer", torch.zeros(n_dev, 12, dtype=torch.uint8, device=device), 9, row_pad=1)
    ref_dev = torch.zeros(n_dev, 12, dtype=torch.uint8, device=device)
    counters, ref_counters = new_counters(device), new_counters(device)
    reference.copy_planned(plan, host, ref_dev, counters=ref_counters)
    kernels.copy_planned(plan, host, dev, counters=counters, workspace=ws_g)
    guard.check()
    assert torch.equal(dev, ref_dev)
    assert torch.equal(counters, ref_counters)


def test_a_workspace_too_small_or_of_another_dtype_is_refused_by_name(device):
    plan = MissPlan.allocate(2, 6, device)
    plan.count.zero_()
    host, dev = torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"workspace must be the swap-in workspace .* \[>= 2, >= 7\]"):
        kernels.copy_planned(plan, host.to(device), dev, workspace=torch.zeros(2, 6, dtype=I64, device=device))
    with pytest.raises(ValueError, match="workspace must be torch.int64"):
        kernels.copy_planned(plan, host.to(device), dev, workspace=torch.zeros(2, 7, dtype=I32, device=device))
    with pytest.raises(TypeError, match="workspace"):
        kernels.copy_planned(plan, host.to(device), dev, workspace=[0] * 14)
