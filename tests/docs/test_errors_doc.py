"""The error docs hold what the code raises. docs/kernels.md §6 lists the messages engines match on, and those are the
texts kvplan's validators actually raise; docs/errors.md is a guide with one section per error class of
``kvplan/errors.py``, and every message it quotes is one the code can raise (the section of a class: one that class is
raised with).

Engines match the §6 texts with anchored regexes, so a documented message kvplan does not raise is one they wait for
in vain. Placeholders are compared loosely: a doc writes ``{steps*top_k}`` or ``{name}`` where the code has an
f-string field.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from helpers.validate_rules import MAT_RULES, PLAN_RULES, mat_args, single_plan, spec_plan

import kvplan.errors
from kvplan.validate import check_materialize, check_miss_plan, check_spec_miss_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
KERNELS_DOC = ROOT / "docs" / "kernels.md"

_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_SPAN = re.compile(r"`([^`]+)`")  # a markdown code span may wrap onto the next line (read as one space)


def _spans(text: str) -> list[str]:
    """Every backticked span of a markdown text, line breaks inside it read as one space."""
    return [" ".join(span.split()) for span in _SPAN.findall(text)]


def _is_python(span: str) -> bool:
    try:
        ast.parse(span)
    except SyntaxError:
        return False
    return True


def _quoted_messages(text: str) -> list[str]:
    """The messages a text quotes: backticked spans with a space that are not Python (``reserve(batch=64, top_k=1)``
    is code, ``{call} cannot grow the pool: {reason}.`` a message)."""
    return [span for span in _spans(text) if " " in span and not _is_python(span)]


def _message_pattern(message: str) -> re.Pattern[str]:
    """A quoted message as a regex over code templates: each placeholder matches any text (an f-string field or the
    literal text it stands for); the message is the template's start (a doc may quote the first part only)."""
    return re.compile(".*?".join(re.escape(part) for part in _PLACEHOLDER.split(message)), re.S)


def _template_of(node: ast.AST) -> str:
    """A string literal or f-string as text, each replacement field as ``{}``."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def _strings(tree: ast.AST) -> list[str]:
    """Every string literal and f-string of a module but its docstrings and comments (text a doc quotes must be text
    the code can put in an error, not text describing it)."""
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [
        _template_of(node)
        for node in ast.walk(tree)
        if id(node) not in docstrings
        and (isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)))
    ]


def _code() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted((ROOT / "kvplan").rglob("*.py"))]


def _code_strings() -> list[str]:
    return [s for _, tree in _code() for s in _strings(tree)]


def _raised_with(class_name: str) -> list[str]:
    """The string templates inside every ``raise ClassName(...)`` of kvplan."""
    out = []
    for _, tree in _code():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name == class_name:
                    out += _strings(node.exc)
    return out


def _sections() -> dict[str, str]:
    """errors.md's ``### `Name` `` sections: the first backticked name of the heading -> the section's text."""
    out = {}
    for section in re.split(r"^### ", DOC.read_text(), flags=re.M)[1:]:
        heading, _, body = section.partition("\n")
        out[_spans(heading)[0]] = body
    return out


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
    """What the validators raise for each rule of tests/helpers/validate_rules.py broken alone: the speculative and the
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


def test_every_error_class_has_a_section_quoting_what_it_is_raised_with():
    classes = _pool_error_classes()
    assert {
        "PoolCapacityError", "PoolBudgetError", "PoolFrozenError", "CheckMismatchError", "TokensDroppedError"
    } <= set(classes)  # fmt: skip
    sections = _sections()
    for name in classes:
        assert name in sections, f"docs/errors.md has no '### `{name}`' section"
        quoted = _quoted_messages(sections[name])
        assert quoted, f"the {name} section quotes no message"
        raised = _raised_with(name)
        for message in quoted:
            pattern = _message_pattern(message)
            assert any(pattern.match(text) for text in raised), f"{name} is never raised with {message!r}"
    assert "ValueError" in sections and _quoted_messages(sections["ValueError"]), "no section on argument errors"


def test_sections_name_real_error_classes():
    known = set(_pool_error_classes()) | {n for n, v in vars(builtins).items() if isinstance(v, type)}
    assert not set(_sections()) - known, f"docs/errors.md has sections on unknown classes: {set(_sections()) - known}"


def test_every_message_quoted_in_errors_md_is_in_the_code():
    strings = _code_strings()
    quoted = _quoted_messages(DOC.read_text())
    assert len(quoted) >= 8, quoted  # guards the parser
    for message in quoted:
        assert len("".join(_PLACEHOLDER.split(message)).strip()) >= 12, f"{message!r} is too short to identify"
        pattern = _message_pattern(message)
        assert any(pattern.match(s) for s in strings), f"docs/errors.md quotes {message!r}, which kvplan never raises"


def test_errors_md_points_to_the_engine_matched_texts():
    assert "[docs/kernels.md §6](" in DOC.read_text(), "docs/errors.md does not link the texts engines match on"


def test_section_6_lists_the_engine_matched_messages():
    messages = _section_6_messages(KERNELS_DOC.read_text())
    # guards the parser: the section lists 10 miss-plan and 9 materialize texts
    assert len(messages) == 19, messages
    assert "miss_src, miss_dst, and miss_count must be provided together." in messages
    assert len(set(messages)) == len(messages), "a message is listed twice"


def test_every_section_6_message_is_raised_by_kvplan():
    raised = _raised_messages()
    messages = _section_6_messages(KERNELS_DOC.read_text())
    never = [m for m in messages if not any(_template(m).fullmatch(text) for text in raised)]
    assert not never, f"kvplan's validators raise none of these docs/kernels.md §6 messages: {never}"


def test_message_matching_is_not_vacuous():
    # a text the code does not hold must be reported, or the checks above prove nothing
    strings = _code_strings()
    assert not any(_message_pattern("{call} cannot shrink the pool: {reason}.").match(s) for s in strings)
    assert any(_message_pattern("{call} cannot grow the pool: {reason}.").match(s) for s in strings)
    assert not any(_message_pattern("the pool grew since the swap-in").match(s) for s in strings)  # not a start
    assert not _message_pattern("{name} must lie inside its storage").match("kvplan refreshes the plan's storage")
    # docstrings are not messages: this text is only in a docstring of kvplan/pool.py
    assert not any(_message_pattern("Grow whatever is too small for this step").match(s) for s in strings)
    assert not _quoted_messages("`pool.reserve(batch=64, top_k=1)` and `[batch, steps, top_k]`")
    differs = _message_pattern("checked mode: the {call}'s {name} differs")
    assert any(differs.match(s) for s in _raised_with("CheckMismatchError"))
    assert not any(differs.match(s) for s in _raised_with("TokensDroppedError"))
    raised = _raised_messages()
    assert not any(_template("miss_src must be int32 and miss_dst must be int64.").fullmatch(t) for t in raised)
    assert not any(_template("miss_count must be int32").fullmatch(t) for t in raised)  # a hint needs its space
    capacity = _template("speculative miss_src/miss_dst must have shape [batch, >= steps * top_k] (capacity {n}).")
    assert any(capacity.fullmatch(t) for t in raised)
    assert not any(capacity.fullmatch(t.replace("speculative ", "")) for t in raised)
    # the placeholder stands for text inside the message, never for a missing part of it
    assert not _template("Invalid {what} shape: got {shape}.").fullmatch("Invalid eps shape.")
