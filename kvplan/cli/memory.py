"""`kvplan plan`: how many bytes each pool buffer reserves for an engine's maxima, under each growth policy, and (with
``--hot``) the rows and bytes of the engine's own HiSparse device buffer, scratch rows included. The command keeps the
name users type; the module is ``memory`` because it sizes memory (a "plan" in kvplan is a ``MissPlan``).

Built on :func:`kvplan.sizing.buffer_bytes` and :func:`kvplan.sizing.scratch_rows`, which allocate nothing, so
operators can size ``PoolConfig.max_bytes``, the device buffer and the engine's memory profiling before launch.
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
        default=0,
        metavar="TOKENS",
        help="most draft tokens whose KV one step materializes (the T of the draft model's k_out/v_out slabs "
        "[layers, T, kv-heads, head-dim], e.g. batch x draft steps; not the sequence context) (default: 0, no slabs)",
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
    parser.add_argument(
        "--hot",
        type=integer,
        default=None,
        metavar="SLOTS",
        help="hot slots per request (HotBufferState HOT): also print the engine's device buffer, rows and bytes",
    )
    parser.add_argument(
        "--tail", type=integer, default=None, metavar="SLOTS", help="tail slots per request (default: --steps)"
    )
    parser.add_argument(
        "--item-bytes",
        type=integer,
        default=None,
        metavar="BYTES",
        help="bytes of one device-buffer row (one token's KV as the engine stores it); without it rows only",
    )
    parser.add_argument(
        "--num-reqs", type=integer, default=None, metavar="R", help="request slots of the state (default: --batch)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot be sized, naming the flag as typed, what it expects and what was given; resolves
    ``--buckets`` into a tuple."""
    check_int("--batch", args.batch, 0, meaning="the largest batch")
    check_int("--steps", args.steps, 1, meaning="the most speculative steps")
    check_int("--top-k", args.top_k, 0, meaning="the largest top_k")
    check_int("--total-ctx", args.total_ctx, 0, meaning="draft tokens materialized per step; 0: no slabs")
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
        if any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"--buckets: expected increasing CUDA-graph batch sizes (e.g. {_BUCKETS}), got {text!r}")
        args.buckets = buckets
    _check_device_buffer(args)


def _check_device_buffer(args: argparse.Namespace) -> None:
    """``--hot``, ``--tail``, ``--item-bytes``, ``--num-reqs``: the device buffer's flags, checked as the state checks
    them; ``--tail`` and ``--num-reqs`` take their defaults (``--steps``, ``--batch``)."""
    from kvplan.workspace import HOT_MAX

    if args.hot is None:
        given = [flag for flag in ("tail", "item_bytes", "num_reqs") if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')}: sizes the device buffer, which needs --hot")
        return
    check_int("--hot", args.hot, 1, HOT_MAX + 1, meaning="hot slots per request")
    if args.tail is None:
        args.tail = args.steps
    check_int("--tail", args.tail, 1, meaning="tail slots per request: the newest token and the drafts")
    if args.num_reqs is None:
        args.num_reqs = max(1, args.batch)
    check_int("--num-reqs", args.num_reqs, 1, meaning="request slots of the state")
    if args.item_bytes is not None:
        check_int("--item-bytes", args.item_bytes, 1, meaning="bytes of one device-buffer row")
    if args.hot < args.top_k:
        raise ValueError(
            f"--hot: expected at least --top-k = {args.top_k} hot slots (a request's top-k is resolved into its hot "
            f"slots: HotBufferState.allocate and every swap-in refuse hot < top_k), got {args.hot}"
        )


def device_buffer(args: argparse.Namespace) -> dict[str, int] | None:
    """The engine's device buffer for ``HotBufferState.allocate(num_reqs, hot, tail, ..., steps=, top_k=)``: rows per
    request (hot + tail + scratch), device rows and, with ``--item-bytes``, bytes; ``None`` without ``--hot``."""
    from kvplan.sizing import scratch_rows

    if args.hot is None:
        return None
    scratch = scratch_rows(args.hot, args.steps, args.top_k)
    per_request = args.hot + args.tail + scratch
    rows = args.num_reqs * per_request
    result = {
        "num_reqs": args.num_reqs,
        "hot": args.hot,
        "tail": args.tail,
        "scratch_rows": scratch,
        "rows_per_request": per_request,
        "device_rows": rows,
    }
    if args.item_bytes is not None:
        result["item_bytes"] = args.item_bytes
        result["bytes"] = rows * args.item_bytes
    return result


def _bucketed_past(args: argparse.Namespace) -> str | None:
    """The note when ``--batch`` passes the largest bucket (those batch rows grow geometrically, as the pool does)."""
    if args.batch <= args.buckets[-1]:
        return None
    return (
        f"--batch {args.batch} is above the largest bucket {args.buckets[-1]}: past it the bucketed policy grows the "
        f"batch rows geometrically (x{args.growth_factor:g}), as PoolConfig(growth='bucketed') does"
    )


def memory_rows(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """policy -> buffer -> bytes (plus 'total'). ``reserve`` is also what exact growth can reach (the same figure)."""
    import torch

    from kvplan.config import MaterializeGeometry, PoolConfig
    from kvplan.sizing import buffer_bytes

    check_arguments(args)
    geometry = None
    if args.total_ctx > 0:
        geometry = MaterializeGeometry(args.layers, args.kv_heads, args.head_dim, getattr(torch, _DTYPES[args.dtype]))
    buckets = args.buckets
    policies = {
        "reserve": (PoolConfig(growth="exact"), False),  # = exact growth's worst case: it grows to the maxima exactly
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

    result = memory_rows(args)  # the library's refusals are the CLI's exit status 2 (kvplan.cli.main)
    device = device_buffer(args)
    past = _bucketed_past(args)
    if args.json:
        print(json.dumps(result if device is None else {**result, "device_buffer": device}, indent=2))
        if past:
            print(f"kvplan plan: note: {past}", file=sys.stderr)
        return 0
    policies = list(result)
    buffers = list(result[policies[0]])
    title = (
        f"kvplan pool bytes for batch <= {args.batch}, steps <= {args.steps}, top_k <= {args.top_k}, "
        f"total_ctx <= {args.total_ctx}"
    )
    headers = {"reserve": "reserve = exact"}
    if past:
        headers["bucketed"] = f"bucketed (geometric past {args.buckets[-1]})"
    rows = [[buffer, *(human_bytes(result[p][buffer]) for p in policies)] for buffer in buffers]
    print_table(title, ["buffer", *(headers.get(p, p) for p in policies)], rows)
    print(
        "reserve = exact: what pool.reserve(...) of these maxima takes (what a frozen pool accepts), which is also the "
        "most exact growth reaches. The other columns: the most ensure_capacity can reserve under that policy while "
        "no step exceeds the maxima (kvplan.sizing.required_bytes(..., worst_case_growth=True)). The counter vector "
        "(48 B) is extra."
    )
    if past:
        print(f"note: {past}.")
    if device is not None:
        _print_device_buffer(args, device)
    from kvplan.config import MAX_TENSOR_BYTES

    too_large = [p for p in policies if any(result[p][b] > MAX_TENSOR_BYTES for b in buffers if b != "total")]
    if too_large:
        print(
            f"note: under {', '.join(too_large)} a buffer would pass {MAX_TENSOR_BYTES} B, more than a tensor can "
            "hold: a pool growing that far raises PoolBudgetError (lower --growth-factor or the maxima)."
        )
    return 0


def _print_device_buffer(args: argparse.Namespace, device: dict[str, int]) -> None:
    from kvplan.cli._output import human_bytes, print_table
    from kvplan.state import MAX_DEVICE_ROWS

    bytes_text = "give --item-bytes" if "bytes" not in device else human_bytes(device["bytes"])
    rows = [
        ["request slots (R)", device["num_reqs"]],
        ["hot slots", device["hot"]],
        ["tail slots", device["tail"]],
        [f"scratch rows = scratch_rows({args.hot}, {args.steps}, {args.top_k})", device["scratch_rows"]],
        ["rows per request", device["rows_per_request"]],
        ["device rows", device["device_rows"]],
        ["bytes" + (f" ({device['item_bytes']} B a row)" if "item_bytes" in device else ""), bytes_text],
    ]
    print_table(
        "engine device buffer (HotBufferState.device_rows)",
        ["", "value"],
        rows,
    )
    print(
        "device rows = R x (hot + tail + scratch): the rows device_buffer needs; with these scratch rows no "
        "speculative swap-in at steps x top_k overflows (kvplan.sizing.scratch_rows). Not in the pool's bytes above."
    )
    if device["device_rows"] > MAX_DEVICE_ROWS:
        print(f"note: more than {MAX_DEVICE_ROWS} device rows: HotBufferState.allocate refuses it (int32 row numbers).")
