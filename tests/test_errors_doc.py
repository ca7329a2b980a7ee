"""docs/errors.md quotes every pool error class and every message engines match on (kernels.md §6).

Engines match these texts with anchored regexes, so a message the doc does not quote is an error they cannot look
up. Placeholders are compared loosely: the spec writes ``{steps*top_k}`` where the doc writes ``{S*K}``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvplan.errors

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
SPEC = ROOT.parent / "shared" / "spec" / "kernels.md"

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _normalized(text: str) -> str:
    return _PLACEHOLDER.sub("{}", text)


def _doc_spans() -> list[str]:
    """Every backticked span of errors.md, placeholders normalized."""
    return [_normalized(span) for span in _CODE_SPAN.findall(DOC.read_text())]


def _spec_messages(spec: str) -> list[str]:
    """The backticked messages of kernels.md §6: spans that are sentences (a space, a final period)."""
    section = re.search(r"^## 6\.[^\n]*\n(.*?)(?=^## )", spec, re.S | re.M)
    assert section is not None, "kernels.md has no '## 6.' section followed by another '## ' section"
    return [span for span in _CODE_SPAN.findall(section.group(1)) if " " in span and span.endswith(".")]


def _pool_error_classes() -> list[str]:
    return sorted(
        name
        for name, value in vars(kvplan.errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == kvplan.errors.__name__
    )


def test_every_pool_error_class_has_a_section_with_messages():
    classes = _pool_error_classes()
    assert {"PoolCapacityError", "PoolBudgetError", "PoolFrozenError"} <= set(classes)
    sections = re.split(r"^### ", DOC.read_text(), flags=re.M)
    for name in classes:
        own = [s for s in sections if s.startswith(f"`{name}`")]
        assert own, f"docs/errors.md has no '### `{name}`' section"
        assert re.search(r"^\| `[^`]+`", own[0], re.M), f"the {name} section has no table row quoting a message"


@pytest.mark.skipif(not SPEC.is_file(), reason=f"the spec is not checked out at {SPEC}")
def test_every_spec_section_6_message_is_quoted():
    messages = _spec_messages(SPEC.read_text())
    # guards the parser: the section lists 10 miss-plan and 9 materialize texts
    assert len(messages) >= 15, messages
    assert "miss_src, miss_dst, and miss_count must be provided together." in messages
    spans = _doc_spans()
    missing = [m for m in messages if not any(span.startswith(_normalized(m)) for span in spans)]
    assert not missing, f"docs/errors.md does not quote these kernels.md §6 messages: {missing}"


def test_message_matching_is_not_vacuous():
    # a text the doc does not contain must be reported missing, or the check above proves nothing
    spans = _doc_spans()
    assert not any(span.startswith("miss_src must be int32 and miss_dst must be int64.") for span in spans)
    assert any(span.startswith(_normalized("miss_count must be int32.")) for span in spans)
