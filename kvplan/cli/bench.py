"""`kvplan bench`: run the benchmarks of kvplan.benchmarks, print their tables and goals (JSON files go to --out-dir).

Each benchmark is a module of the installed package, called in this process through its ``main(argv)``: nothing is
looked up in a source checkout. ``--strict`` exits 1 unless every goal was judged and met: a missed goal, a goal not
evaluated (a CPU, ``--smoke``) and a benchmark skipped (no GPU) all fail it. What was skipped is always said.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvplan.benchmarks import MODULES, missed, status

BENCHMARKS = tuple(MODULES)
DEFAULT_OUT_DIR = "out"  # beside the repository's other run outputs (ignored by its .gitignore as /out/)
NEEDS_GPU = ("swap_in", "materialize", "eager")
DEFAULT = ("swap_in", "materialize", "eager")  # the GPU benchmarks; pool joins them on a CPU and with --smoke
# --smoke: what each benchmark runs instead (materialize has no CPU mode and is skipped).
SMOKE_ARGS = {
    "swap_in": ["--smoke", "--batches", "1", "--workloads", "B"],
    "pool": ["--smoke"],
    "eager": ["--smoke", "--calls", "2"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: {' '.join(DEFAULT)}, and pool too without a "
        "CUDA GPU or with --smoke)",
    )
    parser.add_argument(
        "--out-dir",
        default=DEFAULT_OUT_DIR,
        help="folder for the JSON results, bench_{name}.json each (created when missing; its path is printed)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit status 1 unless every goal was judged and met: a missed goal, a goal not evaluated (--smoke, a "
        "CPU, a shape not measured) and a benchmark skipped (it needs a CUDA GPU) each fail it (each benchmark prints "
        "its goals and writes them to its JSON under 'goals'). Without --strict these still exit 0, and the summary "
        "says what was skipped",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU to check that the benchmarks run: swap_in under the Triton interpreter at "
        "batch 1, eager with 2 calls, pool with 200 calls (materialize has no smoke mode and is skipped); no goal is "
        "evaluated",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from kvplan.cli._args import check_output_dir

    unknown = [name for name in args.which if name not in MODULES]
    if unknown:
        expected = ", ".join(BENCHMARKS)
        print(f"kvplan bench: unknown benchmark {unknown[0]!r}; expected one of {expected}", file=sys.stderr)
        return 2
    out_dir = check_output_dir("--out-dir", args.out_dir)  # before any benchmark runs
    all_goals: list[tuple[str, dict]] = []
    written = []
    skipped: dict[str, str] = {}  # benchmark -> why it did not run
    for name in args.which or default_benchmarks(args.smoke, torch.cuda.is_available()):
        if args.smoke and name not in SMOKE_ARGS:
            skipped[name] = "it has no --smoke mode (it needs a CUDA GPU)"
        elif name in NEEDS_GPU and not args.smoke and not torch.cuda.is_available():
            skipped[name] = "it needs a CUDA GPU (none is visible)"
        if name in skipped:
            print(f"kvplan bench: skipping {name}: {skipped[name]}", file=sys.stderr)
            continue
        out = out_dir / f"bench_{name}.json"
        argv = ["--out", str(out), *(SMOKE_ARGS[name] if args.smoke else [])]
        code = importlib.import_module(MODULES[name]).main(argv)
        if code:  # the benchmark's own refusal (it printed why)
            return int(code)
        all_goals += [(name, g) for g in json.loads(out.read_text()).get("goals", [])]
        written.append(out)
    if written:
        print(f"kvplan bench: results in {out_dir.resolve()}: {', '.join(p.name for p in written)}")
    code = verdict(all_goals, args.strict, skipped)
    if not written:  # every benchmark asked for was skipped: a run that measured nothing fails
        print("kvplan bench: nothing ran (each benchmark asked for was skipped, said above): exit status 1; run "
              "on a CUDA GPU, or name one that runs here (pool, or --smoke)", file=sys.stderr)  # fmt: skip
        return 1
    return code


def default_benchmarks(smoke: bool, gpu: bool) -> list[str]:
    """What ``kvplan bench`` runs without names: the GPU benchmarks, and pool too on a CPU or with ``--smoke`` (so a
    run without a GPU measures something)."""
    return [*DEFAULT, "pool"] if smoke or not gpu else list(DEFAULT)


def verdict(goals: list[tuple[str, dict]], strict: bool, skipped: dict[str, str] | None = None) -> int:
    """Print one summary line: the goals met, missed and not evaluated, and the benchmarks skipped (or that nothing
    was measured). Under ``strict``, 1 unless every goal was judged and met (each failure named on stderr), else 0.

    ``goals`` are ``(benchmark, {"goal", "measured", "met"})``, ``met is None`` when not evaluated; ``skipped`` maps
    a benchmark that did not run to why."""
    skipped = skipped or {}
    counts = {s: sum(status(g) == s for _, g in goals) for s in ("met", "MISSED", "not evaluated")}
    line = f"kvplan bench: {counts['met']} goals met, {counts['MISSED']} missed, {counts['not evaluated']} "
    line += "not evaluated"
    if skipped:
        line += f"; skipped {', '.join(skipped)} (no goal of theirs judged)"
    if not goals:
        line = "kvplan bench: nothing measured" + (f": skipped {', '.join(skipped)}" if skipped else "")
    print(line)
    if not strict:
        return 0
    failures = [f"{name}: goal missed: {g['goal']} (measured {g['measured']})" for name, g in goals if missed([g])]
    failures += [
        f"{name}: goal not evaluated: {g['goal']} ({g.get('note', 'not evaluated')})"
        for name, g in goals
        if g["met"] is None
    ]
    failures += [f"{name}: skipped: {why}" for name, why in skipped.items()]
    if not goals and not skipped:
        failures.append("no benchmark ran")
    for failure in failures:
        print(f"kvplan bench: --strict: {failure}", file=sys.stderr)
    return 1 if failures else 0
