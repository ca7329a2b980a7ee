"""Soak: thousands of decode steps of the engine loop through one PlanBufferPool, checked against the reference.

Drives ``kvplan.testing.simulation.DecodeLoop`` (the loop ``kvplan demo`` runs): requests arrive and finish, contexts
grow until a request ends, the batch changes, speculative steps (2-4 drafts) and single-step calls mix, top_k changes,
plans are replayed into shared-index layers and draft KV is materialized into the pool's slabs. Every
``--check-every``-th step and the last one are compared with ``kvplan.reference`` (outputs, cache state, plan,
device rows, replayed layers, KV, and the step's change of the device counters).

Memory: after ``--warmup`` steps the pool reserves the loop's maxima and is frozen (a later growth would raise
``PoolFrozenError``, as under CUDA graphs). From then on ``torch.cuda.memory_allocated`` / ``memory_reserved`` are
sampled every ``--sample-every`` steps and must stay flat: allocated within ``--allocated-tolerance`` bytes,
reserved within ``--reserved-tolerance`` bytes of its first post-warm-up sample.

    python scripts/soak.py                     # GPU: 10,000 steps at HiSparse-like shapes
    python scripts/soak.py --steps 2000        # shorter
    python scripts/soak.py --smoke             # a few steps on the CPU under Triton's interpreter (CI)

Prints a table of the samples and a summary; writes JSON (``--out``). Exit status 0 when every checked step
matched and memory was flat, 1 otherwise, 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="decode steps (default 10000; --smoke: 6)")
    p.add_argument("--check-every", type=int, default=None, help="check every N-th step (default 100; --smoke: 2)")
    p.add_argument("--warmup", type=int, default=None, help="steps before reserve+freeze (default steps/20)")
    p.add_argument("--sample-every", type=int, default=None, help="memory sample period (default 100; --smoke: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--allocated-tolerance", type=int, default=1 << 20, help="bytes (default 1 MiB)")
    p.add_argument("--reserved-tolerance", type=int, default=64 << 20, help="bytes (default 64 MiB)")
    p.add_argument("--out", default="soak.json", help="JSON results (default soak.json)")
    p.add_argument("--smoke", action="store_true", help="a few small steps on the CPU under Triton's interpreter")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 6 if args.smoke else 10_000
    if args.check_every is None:
        args.check_every = 2 if args.smoke else 100
    if args.sample_every is None:
        args.sample_every = 2 if args.smoke else 100
    if args.warmup is None:
        args.warmup = 2 if args.smoke else max(1, args.steps // 20)
    if args.device is None:
        args.device = "cpu" if args.smoke else "cuda"
    for name in ("steps", "check_every", "sample_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    return args


def loop_config(args: argparse.Namespace):
    import torch

    from kvplan.testing.simulation import LoopConfig

    if args.smoke:  # interpreter-sized: the loop's defaults, a few steps
        return LoopConfig(steps=args.steps, seed=args.seed)
    # HiSparse-like: 576-byte rows, two layers replaying the anchor's plan, contexts to 4096 tokens, top_k 32 or 128,
    # 1, 2 or 4 draft steps; a DFlash-like draft (5 layers, 8 heads, head_dim 128, bf16) materialized each step
    return LoopConfig(
        steps=args.steps,
        seed=args.seed,
        max_batch=16,
        num_reqs=24,
        hot=256,
        tail=8,
        scratch=None,  # kvplan.sizing.scratch_rows at the largest steps x top_k: nothing overflows
        max_len=4096,
        top_k_choices=(32, 128),  # few (steps, top_k) pairs: each is a Triton compilation on the first use
        spec_steps_choices=(1, 2, 4),
        item_bytes=576,
        shared_layers=2,
        n_layers=5,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype=torch.bfloat16,
    )


def memory(device) -> dict[str, int | None]:
    import torch

    sample: dict[str, int | None] = {"allocated": None, "reserved": None}
    if device.type == "cuda":
        sample = {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
    try:
        with open("/proc/self/statm") as f:
            sample["host_rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        sample["host_rss"] = None
    return sample


def run(args: argparse.Namespace) -> dict:
    import attrs
    import torch

    from kvplan.testing.simulation import DecodeLoop, MismatchError

    device = torch.device(args.device)
    config = loop_config(args)
    loop = DecodeLoop(config, device)
    padded = 1 << max(config.max_batch - 1, 0).bit_length()
    maxima = dict(
        batch=padded,
        num_steps=max(config.spec_steps_choices),
        top_k=max(config.top_k_choices),
        total_ctx=config.max_batch * max(config.spec_steps_choices),
    )
    samples, checked, mismatch = [], [], None
    kinds = {"single": 0, "spec": 0}
    batches, top_ks, grows_after_freeze = set(), set(), 0
    started = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            loop.pool.reserve(**maxima)  # what an engine reserves before CUDA-graph capture
            loop.pool.freeze()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        check = step % args.check_every == args.check_every - 1 or step == args.steps - 1
        try:
            record = loop.step(step, check=check)
        except MismatchError as exc:
            mismatch = f"step {step}: {exc}"
            break
        if check:
            checked.append(step)
        if (step + 1) % 1000 == 0:
            print(f"soak: step {step + 1}/{args.steps} ({time.perf_counter() - started:.0f} s)", flush=True)
        kinds["spec" if record.num_steps > 1 else "single"] += 1
        batches.add(record.batch)
        top_ks.add(record.top_k)
        grows_after_freeze += int(record.grew and step >= args.warmup)
        if step >= args.warmup and ((step - args.warmup) % args.sample_every == 0 or step == args.steps - 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(
                dict(step=step, batch=record.batch, num_steps=record.num_steps, top_k=record.top_k, **memory(device))
            )
    elapsed = time.perf_counter() - started
    stats = loop.pool.stats().as_dict()

    def spread(key):
        values = [s[key] for s in samples if s[key] is not None]
        return (max(values) - min(values)) if values else None

    allocated_spread = spread("allocated")
    reserved = [s["reserved"] for s in samples if s["reserved"] is not None]
    reserved_growth = (max(reserved) - reserved[0]) if reserved else None
    flat = None
    if allocated_spread is not None:
        flat = allocated_spread <= args.allocated_tolerance and reserved_growth <= args.reserved_tolerance
    steps_run = sum(kinds.values())
    return dict(
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        torch=torch.__version__,
        config={k: str(v) if isinstance(v, torch.dtype) else v for k, v in attrs.asdict(config).items()},
        steps=steps_run,
        steps_requested=args.steps,
        warmup=args.warmup,
        reserved_maxima=maxima,
        checked_steps=len(checked),
        last_checked_step=checked[-1] if checked else None,
        mismatch=mismatch,
        single_step_calls=kinds["single"],
        speculative_calls=kinds["spec"],
        batch_sizes=sorted(batches),
        top_ks=sorted(top_ks),
        grows_after_freeze=grows_after_freeze,
        pool_generation=stats["generation"],
        pool_grow_events=stats["total.grow_events"],
        counters={k.removeprefix("counters."): v for k, v in stats.items() if k.startswith("counters.")},
        elapsed_s=round(elapsed, 2),
        steps_per_s=round(steps_run / elapsed, 1) if elapsed > 0 else None,
        allocated_spread_bytes=allocated_spread,
        reserved_growth_bytes=reserved_growth,
        allocated_tolerance=args.allocated_tolerance,
        reserved_tolerance=args.reserved_tolerance,
        memory_flat=flat,
        samples=samples,
    )


def report(result: dict) -> None:
    from kvplan.cli._output import human_bytes, print_table

    def size(n):
        return "n/a" if n is None else human_bytes(n)

    rows = [
        [
            s["step"],
            s["batch"],
            s["num_steps"],
            s["top_k"],
            size(s["allocated"]),
            size(s["reserved"]),
            size(s["host_rss"]),
        ]
        for s in result["samples"]
    ]
    print_table(
        f"soak on {result['device_name']}: memory after warm-up (reserve + freeze at step {result['warmup']})",
        ["step", "batch", "S", "top_k", "allocated", "reserved", "host RSS"],
        rows,
    )
    summary = [
        [
            "steps",
            f"{result['steps']} of {result['steps_requested']} ({result['elapsed_s']} s, "
            f"{result['steps_per_s']} steps/s)",
        ],
        ["calls", f"{result['single_step_calls']} single-step, {result['speculative_calls']} speculative"],
        ["batch sizes / top_k", f"{result['batch_sizes']} / {result['top_ks']}"],
        ["checked against the reference", f"{result['checked_steps']} steps (last: {result['last_checked_step']})"],
        ["mismatch", result["mismatch"] or "none"],
        [
            "pool",
            f"generation {result['pool_generation']}, {result['pool_grow_events']} grow events, "
            f"{result['grows_after_freeze']} after the freeze",
        ],
        ["device counters", ", ".join(f"{k}={v}" for k, v in result["counters"].items())],
        ["allocated spread after warm-up", size(result["allocated_spread_bytes"])],
        ["reserved growth after warm-up", size(result["reserved_growth_bytes"])],
        ["memory flat", {True: "yes", False: "NO", None: "n/a (no CUDA device)"}[result["memory_flat"]]],
    ]
    print_table("soak summary", ["", ""], summary)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke or args.device.startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (on the first launch)
    import torch

    from kvplan.cli._args import check_output_file

    try:
        check_output_file("--out", args.out)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device} needs a CUDA GPU, none is visible (use --smoke on a CPU)")
    except (ValueError, RuntimeError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    result = run(args)
    report(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"results written to {args.out}")
    ok = result["mismatch"] is None and result["memory_flat"] is not False and result["grows_after_freeze"] == 0
    if not ok:
        print("soak: FAILED" + (f" ({result['mismatch']})" if result["mismatch"] else ""), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
