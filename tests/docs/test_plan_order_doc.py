"""The docs say where the kernels switch a plan row from miss order to host-row order: the batch the code uses."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["docs/kernels.md", "docs/integration.md", "docs/sglang.md"])
def test_the_batch_above_which_plan_rows_are_in_host_row_order_is_the_codes(doc):
    from kvplan.kernels.planner import FLAT_COPY_MAX_BATCH

    text = " ".join((ROOT / doc).read_text().split())  # (a phrase may be broken across lines)
    said = {int(n) for n in re.findall(r"host-row order above batch (\d+)|above batch (\d+) kvplan writes", text)
            for n in n if n}  # fmt: skip
    assert said == {FLAT_COPY_MAX_BATCH}, f"{doc} says batch {sorted(said)}, the code {FLAT_COPY_MAX_BATCH}"
