"""`kvplan plan`: how many bytes each pool buffer reserves for an engine's maxima, under each growth policy.

Built on :func:`kvplan.sizing.buffer_bytes`, which allocates nothing, so operators can size ``PoolConfig.max_bytes``
and the engine's memory profiling before launch.
"""

from __future__ import annotations

import argparse
import json

from kvplan.cli._args import int_list

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="largest batch (graph-padded) the worker runs")
    parser.add_argument("--steps", type=int, default=4, help="largest number of speculative steps")
    parser.add_argument("--top-k", type=int, default=2048, help="largest sparse-attention top_k")
    parser.add_argument("--ctx", type=int, default=0, help="largest total_ctx of draft KV materialization (tokens)")
    parser.add_argument("--layers", type=int, default=5, help="draft model layers (materialize slabs)")
    parser.add_argument("--kv-heads", type=int, default=8, help="draft model KV heads")
    parser.add_argument("--head-dim", type=int, default=128, help="draft model head dim")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="materialize slab dtype")
    parser.add_argument(
        "--buckets",
        type=int_list,
        default=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        help="CUDA-graph batch sizes for the bucketed policy (comma separated)",
    )
    parser.add_argument("--growth-factor", type=float, default=2.0, help="geometric growth factor")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def plan_rows(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """policy -> buffer -> bytes (plus 'total')."""
    import torch

    from kvplan.config import MaterializeGeometry, PoolConfig
    from kvplan.sizing import buffer_bytes

    geometry = None
    if args.ctx > 0:
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
            total_ctx=args.ctx,
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
        f"total_ctx <= {args.ctx}"
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
