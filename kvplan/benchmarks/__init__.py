"""The benchmarks behind ``kvplan bench``: ``pool``, ``materialize`` and ``swap_in``, one module each.

Each module has ``main(argv: list[str] | None = None) -> int`` (``python -m kvplan.benchmarks.pool --help``; the
``scripts/bench_*.py`` files are thin wrappers around them) and ``evaluate_goals(result) -> list[dict]``: the goals it
states, judged on its JSON result, as ``{"goal", "measured", "met"}`` entries. ``met`` is ``True``/``False``, or
``None`` when the goal cannot be evaluated from that run (``--smoke`` on a CPU, a shape the goal names was not
measured); ``note`` then says why. The goals are printed and written to the JSON under ``"goals"``.

Nothing here imports torch or a kernel: ``kvplan bench --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable

#: ``kvplan bench NAME`` -> the module that runs it.
MODULES = {
    "swap_in": "kvplan.benchmarks.swap_in",
    "materialize": "kvplan.benchmarks.materialize",
    "pool": "kvplan.benchmarks.pool",
    "eager": "kvplan.benchmarks.eager",
}


def goal(text: str, measured: str | None, met: bool | None, note: str | None = None) -> dict:
    """One goal's entry; ``met=None`` (not evaluated) needs a ``note`` saying why."""
    entry = {"goal": text, "measured": measured, "met": None if met is None else bool(met)}
    if met is None:
        entry["note"] = note or "not evaluated"
    return entry


def not_evaluated(texts: Iterable[str], note: str) -> list[dict]:
    return [goal(text, None, None, note) for text in texts]


def status(entry: dict) -> str:
    return {True: "met", False: "MISSED", None: "not evaluated"}[entry["met"]]


def missed(goals: Iterable[dict]) -> list[dict]:
    """The goals measured and missed (``met is False``); those not evaluated are not among them."""
    return [g for g in goals if g.get("met") is False]


def print_goals(name: str, goals: list[dict], file=None) -> None:
    """One line per goal: ``[met] goal: measured``; a summary line. When no goal was evaluated, for one reason (a
    ``--smoke`` run, a CPU), one line says how many and why (the JSON still lists every goal)."""
    file = file or sys.stdout
    notes = {g.get("note", "") for g in goals}
    if goals and all(g["met"] is None for g in goals) and len(notes) == 1:
        print(f"{name} goals: {len(goals)} not evaluated ({notes.pop()}); each is in the JSON under 'goals'", file=file)
        return
    print(f"{name} goals:", file=file)
    for g in goals:
        detail = g["measured"] if g["met"] is not None else g.get("note", "")
        print(f"  [{status(g)}] {g['goal']}: {detail}", file=file)
    counts = {s: sum(status(g) == s for g in goals) for s in ("met", "MISSED", "not evaluated")}
    print(f"  {counts['met']} met, {counts['MISSED']} missed, {counts['not evaluated']} not evaluated", file=file)


def strict_exit(goals: list[dict], strict: bool) -> int:
    """Exit status of a benchmark's ``main``: with ``--strict``, 1 unless every goal was judged and met (a goal not
    evaluated, on a CPU or under ``--smoke``, fails it too: stderr says how many and why); else 0."""
    if not strict:
        return 0
    unjudged = [g for g in goals if g["met"] is None]
    if unjudged:
        notes = sorted({g.get("note", "not evaluated") for g in unjudged})
        print(f"--strict: {len(unjudged)} goal(s) not evaluated ({'; '.join(notes)})", file=sys.stderr)
    return 1 if missed(goals) or unjudged or not goals else 0


def finish(name: str, result: dict, evaluate: Callable[[dict], list[dict]], out: str | None, strict: bool) -> int:
    """Judge ``result`` by ``evaluate``, print the goals, write the JSON to ``out`` (when given); the exit status."""
    result["goals"] = evaluate(result)
    print_goals(name, result["goals"])
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {out}")
    return strict_exit(result["goals"], strict)
