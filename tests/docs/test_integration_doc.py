"""docs/integration.md's code runs as written, and its whole-step walkthrough exists and checks what it shows.

Rule for the ```python blocks of docs/integration.md: a block whose previous non-blank line is an HTML comment
``<!-- not run: REASON -->`` is a fragment (placeholders such as ``...``, a GPU, an engine's names) and is not run;
every other python block runs as written, each in a fresh interpreter, and must exit 0. A new example is therefore
run unless it is marked, with its reason, as a fragment.

The section "One decode step, end to end" must hold exactly one run block, which ends by asserting on its outputs and
printing ``decode step ok:``; removing or marking it fails :func:`test_whole_step_block_is_present`. The block walks a
request's whole lifecycle (admit, append, write_tail, finish, a slot reused) through a speculative and a single-step
swap-in: a short request copies nothing, one past ``HOT`` copies its misses.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integration.md"
WHOLE_STEP_TITLE = "One decode step, end to end"
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
SENTINEL = "decode step ok:"
# Calls the whole-step block must show (the brief of the section: every call of one decode step, and a request's
# lifecycle on the hot-buffer state).
WHOLE_STEP_CALLS = (
    "MaterializeGeometry(",
    "HotBufferState.allocate(",
    "state.device_rows",
    "state.admit(",
    "state.append(",
    "state.finish(",
    "write_tail(",
    "ensure_capacity(",
    "pool.swap_in(state,",
    "pool.replay(",
    "pool.materialize(",
    "pool.stats().as_dict()",
    "pool.overflow",
)


def _blocks(text: str) -> list[dict]:
    """Every ```python block: its section heading, its code, and the reason it is not run (None: it runs)."""
    blocks, heading, previous = [], "", ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip().startswith("```"):  # a fenced block: its lines are code, never headings
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            assert end < len(lines), f"docs/integration.md: unclosed code block at line {i + 1}"
            if line.strip() != "```python":
                i, previous = end + 1, ""
                continue
            marker = NOT_RUN.fullmatch(previous.strip())
            blocks.append(
                dict(
                    heading=heading,
                    line=i + 1,
                    code="\n".join(lines[start:end]) + "\n",
                    not_run=marker.group(1) if marker else None,
                )
            )
            i, previous = end + 1, ""
            continue
        if line.strip():
            previous = line
        i += 1
    return blocks


BLOCKS = _blocks(DOC.read_text(encoding="utf-8"))
RUN = [b for b in BLOCKS if b["not_run"] is None]


def _section_number(heading: str) -> str:
    return heading.split(".", 1)[0]


def test_whole_step_block_is_present():
    in_section = [b for b in BLOCKS if b["heading"].endswith(WHOLE_STEP_TITLE)]
    assert in_section, f"docs/integration.md has no python block under a '{WHOLE_STEP_TITLE}' section"
    run = [b for b in in_section if b["not_run"] is None]
    assert len(run) == 1, f"the '{WHOLE_STEP_TITLE}' section must hold exactly one run block, got {len(run)}"
    code = run[0]["code"]
    missing = [call for call in WHOLE_STEP_CALLS if call not in code]
    assert not missing, f"the whole-step block no longer shows {missing}"
    assert SENTINEL in code.strip().splitlines()[-1], "the whole-step block must end by printing its result"
    assert _section_number(in_section[0]["heading"]) == "2", in_section[0]["heading"]


def test_fragments_say_why():
    for block in BLOCKS:
        if block["not_run"] is not None:
            assert block["not_run"].strip(), f"docs/integration.md:{block['line']}: 'not run' without a reason"
    assert RUN, "docs/integration.md has no block that runs"


@pytest.mark.parametrize("block", RUN, ids=[f"line{b['line']}" for b in RUN])
def test_run_blocks_run_as_written(block):
    proc = subprocess.run(
        [sys.executable, "-c", block["code"]],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
        timeout=300,
    )
    where = f"docs/integration.md:{block['line']} ({block['heading']})"
    assert proc.returncode == 0, f"{where} failed:\n{proc.stderr[-4000:]}"
    if block["heading"].endswith(WHOLE_STEP_TITLE):
        match = re.search(rf"{SENTINEL} \[(\d+), (\d+)\] \[(\d+), (\d+)\] (\d+)", proc.stdout)
        assert match, f"{where} printed no result line:\n{proc.stdout}"
        # speculative step: [short request, long request]; single step: [grown past HOT, new short request]
        spec_short, spec_long, single_grown, single_new, total = map(int, match.groups())
        assert spec_short == 0 and spec_long > 0 and single_grown > 0 and single_new == 0
        assert spec_short + spec_long + single_grown + single_new == total


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_into_integration_doc_resolve():
    text = DOC.read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{2,3} ", line)]
    anchors = {_slug(h) for h in headings}
    numbered = {_section_number(h): h for h in headings if re.match(r"\d+\. ", h)}
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = []
    for path in sources:
        for match in re.finditer(r"\[([^\]]*)\]\((?:docs/)?integration\.md(?:#([^)]*))?\)", path.read_text()):
            label, anchor = match.groups()
            if anchor is not None and anchor not in anchors:
                problems.append(f"{path.name}: {match.group(0)}: no such heading")
            cited = re.search(r"§\s*(\d+)", label)
            if cited and (cited.group(1) not in numbered or (anchor and not anchor.startswith(f"{cited.group(1)}-"))):
                problems.append(f"{path.name}: {match.group(0)}: section {cited.group(1)} does not match")
    assert not problems, "\n".join(problems)


def test_one_state_with_scratch_rows_serves_single_step_and_speculative_calls(device):
    """The bug docs/integration.md once documented (``pool.swap_in(**state.kernel_kwargs())`` raised TypeError when
    the state had scratch rows) is gone: the state is one argument, and the single-step path ignores its scratch."""
    from kvplan import HotBufferState, PlanBufferPool

    state = HotBufferState.allocate(1, 4, 2, 8, device, scratch=2)
    state.set_host_rows(0, list(range(8)))
    state.write_tail(0, [5, 6])
    host_cache = torch.arange(32.0).view(8, 4)
    host_cache = host_cache.pin_memory() if device.type == "cuda" else host_cache
    device_buffer = torch.zeros(state.device_rows, 4, device=device)
    pool = PlanBufferPool(device)
    pool.ensure_capacity(batch=1, num_steps=2, top_k=2)
    rids = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(1, 2, 2, dtype=torch.int32, device=device)
    tokens = torch.tensor([[[0, 1], [2, 3]]], dtype=torch.int32, device=device)
    lens = torch.tensor([6, 7], device=device)
    pool.swap_in(state, tokens, out, rids, lens, host_cache, device_buffer)
    single_out = torch.empty(1, 2, dtype=torch.int32, device=device)
    plan = pool.swap_in(state, tokens[:, 0], single_out, rids, lens[1:], host_cache, device_buffer)
    assert torch.equal(single_out, out[:, 0])  # tokens 0 and 1 are hits now
    assert plan.count.tolist() == [0]
    assert torch.equal(device_buffer[out[0].flatten().long()].cpu(), host_cache[torch.tensor([0, 1, 2, 3])])
    assert "Known bug" not in DOC.read_text(encoding="utf-8")
