"""`kvplan bench`: run the GPU benchmarks from scripts/ and print their tables (JSON files go to --out-dir)."""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys

BENCHMARKS = {
    "swap_in": "bench_swap_in.py",
    "materialize": "bench_materialize.py",
    "pool": "bench_pool.py",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: swap_in materialize; pool also runs on a CPU)",
    )
    parser.add_argument("--out-dir", default=".", help="folder for the JSON results (default: current folder)")
    parser.add_argument(
        "--scripts",
        default=None,
        help="folder holding the bench_*.py scripts (default: scripts/ of the source checkout kvplan runs from)",
    )


def _scripts_dir(explicit: str | None) -> pathlib.Path:
    if explicit:
        return pathlib.Path(explicit)
    return pathlib.Path(__file__).resolve().parents[2] / "scripts"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvplan.cli._args import check_output_dir

    scripts = _scripts_dir(args.scripts)
    unknown = [name for name in args.which if name not in BENCHMARKS]
    if unknown:
        expected = ", ".join(BENCHMARKS)
        print(f"kvplan bench: unknown benchmark {unknown[0]!r}; expected one of {expected}", file=sys.stderr)
        return 2
    out_dir = check_output_dir("--out-dir", args.out_dir)  # before any benchmark runs
    for name in args.which or ["swap_in", "materialize"]:
        if name != "pool" and not torch.cuda.is_available():
            print(f"kvplan bench: skipping {name}: it needs a CUDA GPU (none is visible)", file=sys.stderr)
            continue
        script = scripts / BENCHMARKS[name]
        if not script.is_file():
            print(f"kvplan bench: {script} not found; pass --scripts DIR (run from a source checkout)", file=sys.stderr)
            return 2
        saved = sys.argv
        sys.argv = [str(script), "--out", str(out_dir / f"bench_{name}.json")]
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:  # a script's own exit code
            if exc.code not in (None, 0):
                return int(exc.code) if isinstance(exc.code, int) else 1
        finally:
            sys.argv = saved
    return 0
