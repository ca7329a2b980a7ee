"""Per-worker pools on a multi-GPU host: one process per GPU, each with its own PlanBufferPool and decode loop.

Engines run one worker process per GPU. Each worker here builds a pool on its own device, runs the demo's decode loop
(kvplan.testing.simulation.DecodeLoop) with its own step shapes, checks every step against the PyTorch reference, and
reports its pool stats. Every worker keeps ``cuda:0`` as its *current* device on purpose: buffers and Triton launches
must follow the tensors' device, not the current one, so a worker on ``cuda:1`` that launched on the current device
would produce wrong results (caught by the check) or touch memory on ``cuda:0`` (caught by the memory check).

    python scripts/multi_gpu_demo.py                       # one worker per visible GPU
    python scripts/multi_gpu_demo.py --workers 2           # two workers; they share GPUs round-robin if fewer
    python scripts/multi_gpu_demo.py --json out.json       # also write every worker's stats
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# NVLink multicast stays off on shared hosts (no NCCL collective is used here, but workers inherit this).
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)


def worker(rank: int, device_index: int, steps: int, results) -> None:
    """One engine worker: pool and state on ``cuda:device_index``, current device left at ``cuda:0``."""
    import torch

    from kvplan.testing.simulation import DecodeLoop, LoopConfig

    torch.cuda.set_device(0)  # deliberately not the worker's device
    device = torch.device("cuda", device_index)
    shapes = [
        dict(top_k_choices=(4, 8), spec_steps_choices=(1, 2, 4)),
        dict(top_k_choices=(8, 16), spec_steps_choices=(1, 4), hot=32),
        dict(top_k_choices=(2, 6), spec_steps_choices=(1, 3)),
        dict(top_k_choices=(16,), spec_steps_choices=(2,), hot=32),
    ][rank % 4]
    config = LoopConfig(steps=steps, seed=100 + rank, max_batch=5, num_reqs=8, max_len=192, **shapes)
    started = time.perf_counter()
    try:
        loop = DecodeLoop(config, device, check=True)
        for _ in loop.run():
            pass
        counters = loop.counters_match()
        torch.cuda.synchronize(device)
        stats = loop.pool.stats().as_dict()
        others = {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()) if i != device_index}
        buffers_on_device = all(
            t.device == device for t in (loop.pool.counters, *loop.pool.kv_out(0), loop.pool.miss_plan(1, 1, 1).src)
        )
        results.put(
            dict(
                rank=rank,
                device=str(device),
                current_device=torch.cuda.current_device(),
                steps=steps,
                seconds=round(time.perf_counter() - started, 2),
                shapes={k: list(v) if isinstance(v, tuple) else v for k, v in shapes.items()},
                equal_to_reference=True,
                buffers_on_device=buffers_on_device,
                bytes_allocated_on_other_devices=others,
                counters=counters,
                stats=stats,
            )
        )
    except Exception as exc:  # report, don't hang the parent
        results.put(dict(rank=rank, device=str(device), error=f"{type(exc).__name__}: {exc}"))


def run_workers(num_workers: int, steps: int) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("multi_gpu_demo: needs at least one CUDA GPU")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for rank in range(num_workers):
        proc = ctx.Process(target=worker, args=(rank, rank % gpus, steps, results))
        proc.start()
        procs.append(proc)
    reports = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    return sorted(reports, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: one per GPU)")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per worker (default: 30)")
    parser.add_argument("--json", default=None, help="write every worker's report to this file")
    args = parser.parse_args(argv)
    import torch

    workers = args.workers or max(1, torch.cuda.device_count())
    reports = run_workers(workers, args.steps)
    ok = True
    print(
        f"{'rank':>4} {'device':>7} {'current':>7} {'steps':>5} {'equal':>5} {'grows':>5} {'reserved':>9} "
        f"{'misses':>7} {'hits':>6} {'overflow':>8} {'other-GPU bytes':>15}"
    )
    for r in reports:
        if "error" in r:
            ok = False
            print(f"{r['rank']:>4} {r['device']:>7} ERROR {r['error']}")
            continue
        s = r["stats"]
        other = sum(r["bytes_allocated_on_other_devices"].values())
        good = r["equal_to_reference"] and r["buffers_on_device"] and other == 0
        ok &= good
        print(
            f"{r['rank']:>4} {r['device']:>7} {'cuda:' + str(r['current_device']):>7} {r['steps']:>5} "
            f"{str(good):>5} {s['total.grow_events']:>5} {s['total.reserved_bytes.current']:>9} "
            f"{s['counters.misses_copied']:>7} {s['counters.hits']:>6} {s['counters.overflow']:>8} {other:>15}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    print("all workers equal to the reference, on their own devices" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
