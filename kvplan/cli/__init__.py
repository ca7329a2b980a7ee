"""Command line: `kvplan demo` (engine-loop demo), `kvplan plan` (memory sizing), `kvplan bench` (GPU benchmarks).

Each subcommand lives in its own module and is imported only when chosen, so `--help` stays fast and no Triton kernel
module is imported before `select_backend()` has decided whether the interpreter is needed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_COMMANDS = {
    "demo": ("kvplan.cli.demo", "simulate an engine worker's decode loop through one PlanBufferPool"),
    "plan": ("kvplan.cli.memory", "print the bytes each pool buffer reserves for given engine maxima"),
    "bench": ("kvplan.cli.bench", "run the benchmarks and report their goals (swap_in, materialize need a GPU)"),
}


def select_backend() -> str:
    """Use the GPU when there is one; otherwise run Triton kernels under the interpreter on the CPU.

    Must run before any kernel module is imported: Triton reads TRITON_INTERPRET when a kernel is decorated.
    """
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    try:  # Triton's interpreter runs every kernel on numpy arrays (a kvplan dependency, but a bare Triton lacks it)
        import numpy  # noqa: F401
    except ImportError:
        raise ValueError(
            "Triton's interpreter (used without a CUDA GPU) needs numpy, which is not installed: pip install numpy"
        ) from None
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (``(default: 1,2,4)`` for a tuple), unless the text already says it
    or there is none to say (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "(default" in text or "%(default)" in text or text == argparse.SUPPRESS:
            return text
        if default is None or default is False or default is argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """argparse's refusals as one line, like every other refusal of the CLI: ``kvplan demo: --top-k: expected positive
    integers, got '0'`` (and ``kvplan demo --help`` named for the options), exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `plan --growth exact` is not `--growth-factor exact`
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvplan",
        description="Step-scoped buffer runtime and Triton kernels for HiSparse swap-in and fused KV materialization.",
        formatter_class=_HelpFormatter,
    )
    from kvplan import __version__

    parser.add_argument("--version", action="version", version=f"kvplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}  # type: ignore[attr-defined]
    for name, (module, help_text) in _COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        importlib.import_module(module).add_arguments(cmd)
        parser.commands[name] = cmd  # type: ignore[attr-defined]
    return parser


def _refusals() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "these arguments cannot run here": argument errors (kvplan's ValueError/TypeError, sizes
    past int64), the pool's refusals, memory the shapes asked for and files that cannot be written."""
    from kvplan.errors import PoolBudgetError, PoolCapacityError, PoolFrozenError

    refusals = (ValueError, TypeError, OverflowError, MemoryError, OSError)
    refusals += (PoolBudgetError, PoolCapacityError, PoolFrozenError)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "OutOfMemoryError"):
        refusals += (torch.OutOfMemoryError,)
    return refusals


def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch appends C++ frames below it), or its type."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run one command; the error boundary of the CLI: a refusal is one line on stderr and exit status 2, an
    interrupt exit status 130, never a traceback. Anything else (a kvplan bug) propagates with its traceback."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the command that was given them: `kvplan demo: unrecognized arguments: --x`
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(_COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"kvplan {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not isinstance(exc, _refusals()):
            raise
        print(f"kvplan {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
