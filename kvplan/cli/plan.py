"""`kvplan plan`: how many bytes each pool buffer reserves for an engine's maxima, under each growth policy.

Built on :func:`kvplan.sizing.buffer_bytes`, which allocates nothing, so operators can size ``PoolConfig.max_bytes``
and the engine's memory profiling before launch.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvplan.cli._args import check_int, int_list, integer, number

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_BUCKETS = "1,2,4,8,16,32,64,128,256"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=integer, default=64, help="largest batch (graph-padded) the worker runs")
    parser.add_argument("--steps", type=integer, default=4, help="largest number of speculative (draft) steps")
    parser.add_argument("--top-k", type=integer, default=2048, help="largest sparse-attention top_k")
    parser.add_argument(
        "--total-ctx",
        type=integer,
        default=None,
        metavar="TOKENS",
        help="most draft tokens whose KV one step materializes (the T of the draft model's k_out/v_out slabs "
        "[layers, T, kv-heads, head-dim], e.g. batch x draft steps; not the sequence context) (default: 0, no slabs)",
    )
    parser.add_argument(
        "--ctx", type=integer, default=None, metavar="TOKENS", help="deprecated alias of --total-ctx"
    )
    parser.add_argument("--layers", type=integer, default=5, help="draft model layers (materialize slabs)")
    parser.add_argument("--kv-heads", type=integer, default=8, help="draft model KV heads")
    parser.add_argument("--head-dim", type=integer, default=128, help="draft model head dim")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="materialize slab dtype")
    parser.add_argument(
        "--buckets",
        default=_BUCKETS,
        help="CUDA-graph batch sizes for the bucketed policy (comma separated)",
    )
    parser.add_argument("--growth-factor", type=number, default=2.0, help="geometric growth factor")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot be planned, naming the flag as typed, what it expects and what was given; resolves
    ``--ctx`` (deprecated, with a note on stderr) into ``args.total_ctx`` and ``--buckets`` into a tuple."""
    ctx_flag, deprecated = "--total-ctx", args.ctx is not None
    if deprecated:
        if args.total_ctx is not None and args.total_ctx != args.ctx:
            raise ValueError(
                f"--ctx: deprecated alias of --total-ctx; expected one value, got --ctx {args.ctx} and "
                f"--total-ctx {args.total_ctx}"
            )
        if args.total_ctx is None:
            ctx_flag = "--ctx"
        args.total_ctx, args.ctx = args.ctx, None
    if args.total_ctx is None:
        args.total_ctx = 0
    check_int("--batch", args.batch, 0, meaning="the largest batch")
    check_int("--steps", args.steps, 1, meaning="the most speculative steps")
    check_int("--top-k", args.top_k, 0, meaning="the largest top_k")
    check_int(ctx_flag, args.total_ctx, 0, meaning="draft tokens materialized per step; 0: no slabs")
    check_int("--layers", args.layers, 1, meaning="draft model layers")
    check_int("--kv-heads", args.kv_heads, 1, meaning="draft model KV heads")
    check_int("--head-dim", args.head_dim, 1, meaning="draft model head dim")
    factor = args.growth_factor
    if not (factor > 1.0 and factor != float("inf")):
        raise ValueError(f"--growth-factor: expected a finite number > 1 (the geometric growth factor), got {factor:g}")
    if isinstance(args.buckets, str):
        text = args.buckets
        try:
            buckets = int_list(text)
        except argparse.ArgumentTypeError:
            buckets = None
        if not buckets or min(buckets) < 1:
            raise ValueError(
                f"--buckets: expected comma-separated CUDA-graph batch sizes >= 1 (e.g. {_BUCKETS}), got {text!r}"
            )
        args.buckets = buckets
    if deprecated:  # after the checks: a refusal stays one line
        print("kvplan plan: --ctx is deprecated, use --total-ctx (the same value)", file=sys.stderr)


def plan_rows(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """policy -> buffer -> bytes (plus 'total')."""
    import torch

    from kvplan.config import MaterializeGeometry, PoolConfig
    from kvplan.sizing import buffer_bytes

    check_arguments(args)
    geometry = None
    if args.total_ctx > 0:
        geometry = MaterializeGeometry(args.layers, args.kv_heads, args.head_dim, getattr(torch, _DTYPES[args.dtype]))
    buckets = args.buckets
    policies = {
        "reserve": (PoolConfig(growth="exact"), False),
        "exact": (PoolConfig(growth="exact"), True),
        f"geometric x{args.growth_factor:g}": (PoolConfig(growth="geometric", growth_factor=args.growth_factor), True),
        "bucketed": (PoolConfig(growth="bucketed", batch_buckets=buckets, growth_factor=args.growth_factor), True),
    }
    result = {}
    for name, (config, worst) in policies.items():
        sizes = buffer_bytes(
            config,
            geometry,
            batch=args.batch,
            num_steps=args.steps,
            top_k=args.top_k,
            total_ctx=args.total_ctx,
            worst_case_growth=worst,
        )
        result[name] = {**sizes, "total": sum(sizes.values())}
    return result


def run(args: argparse.Namespace) -> int:
    from kvplan.cli._output import human_bytes, print_table

    result = plan_rows(args)  # the library's refusals are the CLI's exit status 2 (kvplan.cli.main)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    policies = list(result)
    buffers = list(result[policies[0]])
    title = (
        f"kvplan pool bytes for batch <= {args.batch}, steps <= {args.steps}, top_k <= {args.top_k}, "
        f"total_ctx <= {args.total_ctx}"
    )
    rows = [[buffer, *(human_bytes(result[p][buffer]) for p in policies)] for buffer in buffers]
    print_table(title, ["buffer", *policies], rows)
    print(
        "reserve: what pool.reserve(...) of these maxima takes (exact, what a frozen pool accepts). Growth rows: the "
        "most ensure_capacity can reserve under that policy while no step exceeds the maxima "
        "(kvplan.sizing.required_bytes(..., worst_case_growth=True)). The counter vector (48 B) is extra."
    )
    from kvplan.pool import MAX_BUFFER_BYTES

    too_large = [p for p in policies if any(result[p][b] > MAX_BUFFER_BYTES for b in buffers if b != "total")]
    if too_large:
        print(
            f"note: under {', '.join(too_large)} a buffer would pass {MAX_BUFFER_BYTES} B, more than a tensor can "
            "hold: a pool growing that far raises PoolBudgetError (lower --growth-factor or the maxima)."
        )
    return 0
