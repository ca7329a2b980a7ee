"""Steady-state cost of PlanBufferPool: ensure_capacity + view fetch per step, against allocating the buffers fresh.

What an engine pays per step once the pool is warm: ``ensure_capacity(...)`` then ``miss_plan``, ``kv_out`` and
``workspace``. Beside it: ``torch.empty`` of the same six buffers every step (what the pool replaces). Each figure is
the median over batches of the per-call mean (``time.perf_counter_ns`` around many calls). Targets: <= 2 us per step
and >= 10x cheaper than fresh allocation (the goals, in the JSON under ``"goals"``; ``--strict`` exits 1 when one is
missed; ``--smoke`` runs few calls to check the benchmark and evaluates no goal).

    python -m kvplan.benchmarks.pool [--device cpu|cuda] [--out bench_pool.json] [--strict]
    python scripts/bench_pool.py ...   # the same
    kvplan bench pool                  # the same, JSON to --out-dir
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch

from kvplan import MaterializeGeometry, PlanBufferPool, PoolConfig
from kvplan.benchmarks import finish, goal, not_evaluated
from kvplan.workspace import swap_in_workspace_columns

TARGET_STEADY_US = 2.0
TARGET_SPEEDUP = 10.0

# DFlash-style draft geometry and HiSparse shapes (docs/kernels.md §7).
GEOMETRY = MaterializeGeometry(n_layers=5, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CASES = {
    "decode": [(32, 1, 2048, 0)],
    "speculative": [(64, 4, 2048, 8192)],
    "graph-padded": [(256, 4, 2048, 8192)],
    "mixed": [(32, 1, 2048, 0), (64, 4, 2048, 8192), (256, 4, 2048, 8192)],  # an engine cycling step shapes
}


def steady_step_ns(pool: PlanBufferPool, shapes: list[tuple[int, int, int, int]], calls: int, batches: int) -> float:
    """Median over batches of the mean ns per step (ensure_capacity + miss_plan + kv_out + workspace)."""
    ensure, miss_plan, kv_out, workspace = pool.ensure_capacity, pool.miss_plan, pool.kv_out, pool.workspace
    cycle = (shapes * (calls // len(shapes) + 1))[:calls]
    results = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for b, s, k, c in cycle:
            ensure(batch=b, num_steps=s, top_k=k, total_ctx=c)
            miss_plan(b, s, k)
            kv_out(c)
            workspace(b, s, k)
        results.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(results)


def fresh_step_ns(device: torch.device, shapes: list[tuple[int, int, int, int]], calls: int, batches: int) -> float:
    """The same six buffers allocated with ``torch.empty`` every step (and dropped at its end)."""
    g = GEOMETRY
    cycle = (shapes * (calls // len(shapes) + 1))[:calls]
    results = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for b, s, k, c in cycle:
            buffers = (
                torch.empty(b, s * k, dtype=torch.int64, device=device),
                torch.empty(b, s * k, dtype=torch.int32, device=device),
                torch.empty(b, dtype=torch.int32, device=device),
                torch.empty(b, swap_in_workspace_columns(s, k), dtype=torch.int64, device=device),
                torch.empty(g.n_layers, c, g.num_kv_heads, g.head_dim, dtype=g.dtype, device=device),
                torch.empty(g.n_layers, c, g.num_kv_heads, g.head_dim, dtype=g.dtype, device=device),
            )
            del buffers
        results.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(results)


def run_case(device: torch.device, name: str, shapes: list[tuple[int, int, int, int]], calls: int, batches: int):
    pool = PlanBufferPool(device, geometry=GEOMETRY, config=PoolConfig(growth="geometric"))
    for b, s, k, c in shapes:  # warm-up: grow once, fill the view caches
        pool.ensure_capacity(batch=b, num_steps=s, top_k=k, total_ctx=c)
    for b, s, k, c in shapes:
        pool.miss_plan(b, s, k), pool.kv_out(c), pool.workspace(b, s, k)
    generation = pool.generation
    gc.disable()
    try:
        steady = steady_step_ns(pool, shapes, calls, batches) / 1000
        fresh = fresh_step_ns(device, shapes, max(calls // 20, len(shapes)), batches) / 1000
    finally:
        gc.enable()
    assert pool.generation == generation, "steady state reallocated"
    return {
        "case": name,
        "shapes": [dict(zip(("batch", "num_steps", "top_k", "total_ctx"), s)) for s in shapes],
        "steady_us": round(steady, 3),
        "fresh_us": round(fresh, 3),
        "speedup": round(fresh / steady, 1),
        "steady_ok": steady <= TARGET_STEADY_US,
        "speedup_ok": fresh / steady >= TARGET_SPEEDUP,
        "reserved_bytes": pool.stats().reserved_bytes,
    }


def print_table(rows: list[dict], title: str, judged: bool = True) -> None:
    """The cases; the target column says ``ok``/``MISSED`` only when the run is ``judged`` (on a CUDA device)."""
    headers = ("case", "steady us/step", "fresh alloc us/step", "speedup", "target")
    cells = [
        (
            r["case"],
            f"{r['steady_us']:.3f}",
            f"{r['fresh_us']:.3f}",
            f"{r['speedup']:.1f}x",
            ("ok" if r["steady_ok"] and r["speedup_ok"] else "MISSED") if judged else "-",
        )
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for c in cells:
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h == "case" else "right")
    for c in cells:
        table.add_row(*c)
    Console().print(table)


GOALS = (
    f"steady state <= {TARGET_STEADY_US} us per step in every case",
    f"steady state >= {TARGET_SPEEDUP:.0f}x cheaper than fresh allocation in every case",
)


def judged(device: str | None) -> bool:
    """The targets are the GPU worker's (measured on the H200's host with CUDA tensors): a run on another device
    (``--device cpu``) reports its figures but judges no goal. A result without a device (older JSON) is judged."""
    return device is None or str(device).startswith("cuda")


def evaluate_goals(result: dict) -> list[dict]:
    """The two targets over every case of ``result`` (the JSON :func:`main` writes); none evaluated under --smoke or
    on a device other than CUDA."""
    cases = result.get("cases") or []
    if result.get("smoke"):
        return not_evaluated(GOALS, "--smoke: too few calls for the timings to mean anything")
    if not judged(result.get("device")):
        return not_evaluated(
            GOALS, f"the targets are a GPU worker's, judged with CUDA tensors; this run was on {result['device']}"
        )
    if not cases:
        return not_evaluated(GOALS, "no case measured")
    slowest = max(cases, key=lambda r: r["steady_us"])
    least = min(cases, key=lambda r: r["speedup"])
    return [
        goal(
            GOALS[0],
            f"slowest {slowest['steady_us']:.3f} us ({slowest['case']})",
            all(r.get("steady_ok", r["steady_us"] <= TARGET_STEADY_US) for r in cases),
        ),
        goal(
            GOALS[1],
            f"least {least['speedup']:.1f}x ({least['case']})",
            all(r.get("speedup_ok", r["speedup"] >= TARGET_SPEEDUP) for r in cases),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20000, help="steady-state steps per timed batch")
    parser.add_argument("--batches", type=int, default=15, help="timed batches (the median is reported)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="200 calls x 3 batches: checks the benchmark, no goals")
    parser.add_argument("--strict", action="store_true", help="exit status 1 unless every goal was judged and met")
    args = parser.parse_args(argv)
    if args.smoke:
        args.calls, args.batches = 200, 3
    device = torch.device(args.device)
    rows = [run_case(device, name, shapes, args.calls, args.batches) for name, shapes in CASES.items()]
    title = (
        f"PlanBufferPool steady state vs fresh allocation on {device} "
        f"(targets: <= {TARGET_STEADY_US} us/step, >= {TARGET_SPEEDUP:.0f}x)"
    )
    print_table(rows, title, judged=judged(str(device)) and not args.smoke)
    result = {
        "benchmark": "pool",
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "targets": {"steady_us": TARGET_STEADY_US, "speedup": TARGET_SPEEDUP},
        "cases": rows,
        "smoke": args.smoke,
    }
    return finish("pool", result, evaluate_goals, args.out, args.strict)


if __name__ == "__main__":
    raise SystemExit(main())
