"""The error docs hold what the code raises: docs/errors.md quotes every pool error class and every message engines
match on, and those messages (docs/kernels.md §6) are the texts kvplan's validators actually raise.

Engines match these texts with anchored regexes, so a message the docs do not quote is an error they cannot look
up, and a documented message kvplan does not raise is one they wait for in vain. Placeholders are compared loosely:
docs/kernels.md writes ``{steps*top_k}`` where docs/errors.md writes ``{S*K}``.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_validate import MAT_RULES, PLAN_RULES, mat_args, single_plan, spec_plan

import kvplan.errors
from kvplan.validate import check_materialize, check_miss_plan, check_spec_miss_plan

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
KERNELS_DOC = ROOT / "docs" / "kernels.md"

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def _normalized(text: str) -> str:
    return _PLACEHOLDER.sub("{}", text)


def _doc_spans() -> list[str]:
    """Every backticked span of errors.md, placeholders normalized."""
    return [_normalized(span) for span in _CODE_SPAN.findall(DOC.read_text())]


def _section_6_messages(text: str) -> list[str]:
    """The backticked messages of docs/kernels.md §6: spans that are sentences (a space, a final period)."""
    section = re.search(r"^## 6\.[^\n]*\n(.*?)(?=^## )", text, re.S | re.M)
    assert section is not None, "docs/kernels.md has no '## 6.' section followed by another '## ' section"
    return [span for span in _CODE_SPAN.findall(section.group(1)) if " " in span and span.endswith(".")]


def _template(message: str) -> re.Pattern[str]:
    """A documented message as a regex: placeholders match any text; the message is the whole text or is followed by
    one space and a hint (the rule of docs/kernels.md §6)."""
    parts = _PLACEHOLDER.split(message)
    return re.compile(".+?".join(re.escape(part) for part in parts) + r"(?: .*)?", re.S)


def _raised_messages() -> list[str]:
    """What the validators raise for each rule of tests/test_validate.py broken alone: the speculative and the
    single-step plan check, and the materialize check."""
    raised = []
    for make, check in ((spec_plan, check_spec_miss_plan), (single_plan, check_miss_plan)):
        for name, breaks, _ in PLAN_RULES:
            args = make()
            breaks(args)
            try:
                check(**args)
            except ValueError as error:
                raised.append(str(error))
            else:
                raise AssertionError(f"{check.__name__} passed with rule {name!r} broken")
    for name, breaks, _ in MAT_RULES:
        args = mat_args()
        breaks(args)
        try:
            check_materialize(**args)
        except ValueError as error:
            raised.append(str(error))
        else:
            raise AssertionError(f"check_materialize passed with rule {name!r} broken")
    return raised


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


def test_section_6_lists_the_engine_matched_messages():
    messages = _section_6_messages(KERNELS_DOC.read_text())
    # guards the parser: the section lists 10 miss-plan and 9 materialize texts
    assert len(messages) == 19, messages
    assert "miss_src, miss_dst, and miss_count must be provided together." in messages
    assert len(set(messages)) == len(messages), "a message is listed twice"


def test_every_section_6_message_is_quoted_in_errors_md():
    messages = _section_6_messages(KERNELS_DOC.read_text())
    spans = _doc_spans()
    missing = [m for m in messages if not any(span.startswith(_normalized(m)) for span in spans)]
    assert not missing, f"docs/errors.md does not quote these docs/kernels.md §6 messages: {missing}"


def test_every_section_6_message_is_raised_by_kvplan():
    raised = _raised_messages()
    messages = _section_6_messages(KERNELS_DOC.read_text())
    never = [m for m in messages if not any(_template(m).fullmatch(text) for text in raised)]
    assert not never, f"kvplan's validators raise none of these docs/kernels.md §6 messages: {never}"


def test_message_matching_is_not_vacuous():
    # a text the doc does not contain must be reported missing, or the checks above prove nothing
    spans = _doc_spans()
    assert not any(span.startswith("miss_src must be int32 and miss_dst must be int64.") for span in spans)
    assert any(span.startswith(_normalized("miss_count must be int32.")) for span in spans)
    raised = _raised_messages()
    assert not any(_template("miss_src must be int32 and miss_dst must be int64.").fullmatch(t) for t in raised)
    assert not any(_template("miss_count must be int32").fullmatch(t) for t in raised)  # a hint needs its space
    capacity = _template("speculative miss_src/miss_dst must have shape [batch, >= steps * top_k] (capacity {n}).")
    assert any(capacity.fullmatch(t) for t in raised)
    assert not any(capacity.fullmatch(t.replace("speculative ", "")) for t in raised)
    # the placeholder stands for text inside the message, never for a missing part of it
    assert not _template("Invalid {what} shape: got {shape}.").fullmatch("Invalid eps shape.")
