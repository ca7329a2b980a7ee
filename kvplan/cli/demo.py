"""`kvplan demo`: an engine worker's decode loop through one PlanBufferPool, with every step checked on a CPU.

Requests arrive and finish, speculative steps switch between 1 and several, top_k changes and contexts grow; each step
calls ``ensure_capacity``, runs the swap-in through the pool, replays the plan for shared-index layers and materializes
draft KV. Every checked step also runs an end-to-end sparse-attention step (``kvplan.testing.sparse_attention``, its own
requests and pool): attention over the rows the swap-in served must equal attention over the host rows bit for bit. Ends
with the pool's stats, the overflow count (scratch rows sized by ``kvplan.sizing.scratch_rows``: 0) and a growth
timeline; ``--plot FILE`` draws reserved bytes and capacities over the steps, one panel per unit.

On a CPU the kernels run under Triton's interpreter, one program after another: there the demo runs fewer steps and the
sparse-attention check fewer requests by default (``DEVICE_DEFAULTS``); every step is still checked."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvplan.cli._args import check_device, check_int, integer, positive_int_list
from kvplan.workspace import HOT_MAX

GROWTH_POLICIES = ("exact", "geometric", "bucketed")  # every policy of kvplan.config.PoolConfig
TAIL_MIN = 4  # the simulated worker's tail slots: max(4, the most --spec-steps)
# Defaults that depend on where the kernels run: --steps and --attention-batch (the latter at most --max-batch). On a
# CPU, Triton's interpreter runs every program of every launch in turn, and the swap-ins are nearly all of the demo's
# time: the loop's (one per step, one program set per batch row) and the sparse-attention check's (as many). 24 steps
# still grow every pool buffer and switch batch, steps and top_k; 2 requests still take the check from short rows to
# long ones on both swap-in paths. Together about 45% of the interpreted work of 40 steps with 4 requests.
DEVICE_DEFAULTS = {"cuda": {"steps": 40, "attention_batch": 4}, "cpu": {"steps": 24, "attention_batch": 2}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    gpu, cpu = DEVICE_DEFAULTS["cuda"], DEVICE_DEFAULTS["cpu"]
    parser.add_argument(
        "--steps",
        type=integer,
        default=None,
        help=f"decode steps to simulate (default: {gpu['steps']} on a GPU, {cpu['steps']} on a CPU, where Triton's "
        "interpreter runs the kernels)",
    )
    parser.add_argument("--seed", type=integer, default=0, help="random seed of the schedule and the data")
    parser.add_argument("--max-batch", type=integer, default=6, help="most requests running at once")
    parser.add_argument("--hot", type=integer, default=16, help="hot-buffer slots per request, HOT (>= every --top-k)")
    parser.add_argument("--max-len", type=integer, default=160, help="longest context in tokens")
    parser.add_argument(
        "--top-k",
        type=positive_int_list,
        default=(4, 8),
        help="top_k values to switch between, comma separated",
    )
    parser.add_argument(
        "--spec-steps",
        type=positive_int_list,
        default=(1, 2, 4),
        help="speculative steps to switch between; 1 runs the single-step swap-in",
    )
    parser.add_argument(
        "--scratch",
        type=integer,
        default=None,
        metavar="ROWS",
        help="scratch rows per request, where speculative misses beyond the hot slots go (default: "
        "kvplan.sizing.scratch_rows(--hot, the largest --spec-steps, the largest --top-k) = max(0, S x K - HOT), so no "
        "swap-in overflows; with fewer, misses past them come back as -1, counted as overflow)",
    )
    parser.add_argument(
        "--attention-batch",
        type=integer,
        default=None,
        metavar="N",
        help="requests of the end-to-end sparse-attention check run beside every checked step (default: "
        f"{gpu['attention_batch']} on a GPU, {cpu['attention_batch']} on a CPU, at most --max-batch)",
    )
    parser.add_argument(
        "--growth",
        choices=GROWTH_POLICIES,
        default="geometric",
        help="pool growth policy; bucketed rounds the batch up to the CUDA-graph batch sizes the demo pads to "
        "(powers of two up to the padded --max-batch)",
    )
    parser.add_argument(
        "--check",
        choices=("auto", "on", "off"),
        default="auto",
        help="compare every step with the PyTorch reference (auto: on without a GPU, off on a GPU)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="write a plot of reserved bytes and capacities per step to FILE (PNG, or the format its suffix names)",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="print the pool's Prometheus exposition at the end (needs prometheus_client: kvplan[metrics])",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")


def run(args: argparse.Namespace) -> int:
    from kvplan.cli import select_backend

    backend = select_backend()  # before any kernel import: sets TRITON_INTERPRET=1 without a GPU
    import torch

    # Everything that can be refused is refused before the run (kvplan.cli.main prints it, exit status 2):
    # the device, the plot file, the shapes (LoopConfig), the memory they take (DecodeLoop).
    device = check_device("--device", args.device, backend)
    if device.type != "cpu":
        return _run(args, device)
    # On a CPU everything runs on one thread: Triton's interpreter does, and the demo's tensors are a few KiB, too small
    # for torch's intra-op threads to gain anything. With a second thread, an op that opens a parallel region spins
    # waiting for it whenever another process holds the other core (2 cores: seconds per run, CPU time burnt).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, device) -> int:
    import torch

    from kvplan.testing.simulation import DecodeLoop, LoopConfig, MismatchError
    from kvplan.testing.sparse_attention import AttentionCheckConfig, SparseAttentionCheck

    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # kernels are imported on first launch, after this
    check = args.check == "on" or (args.check == "auto" and device.type == "cpu")
    plot = None if args.plot is None else _check_plot(args.plot)
    if args.metrics:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            print("kvplan demo: --metrics needs prometheus_client: pip install 'kvplan[metrics]'", file=sys.stderr)
            return 2
    defaults = DEVICE_DEFAULTS.get(device.type, DEVICE_DEFAULTS["cuda"])
    given = {name for name in defaults if getattr(args, name) is not None}  # the rest take the device's default
    args = argparse.Namespace(**{**vars(args), "steps": defaults["steps"] if args.steps is None else args.steps})
    _check_shapes(args)
    if args.attention_batch is None:
        args.attention_batch = min(args.max_batch, defaults["attention_batch"])
    config = LoopConfig(
        steps=args.steps,
        seed=args.seed,
        max_batch=args.max_batch,
        num_reqs=args.max_batch + 2,
        hot=args.hot,
        max_len=args.max_len,
        top_k_choices=args.top_k,
        spec_steps_choices=args.spec_steps,
        tail=max(TAIL_MIN, max(args.spec_steps)),
        scratch=args.scratch,  # None: kvplan.sizing.scratch_rows at the largest steps x top_k
        growth=args.growth,
    )
    _check_memory(args, config, device, check)
    if args.hot > HOT_MAX:  # (after the memory check, as before; the flag, not HotBufferState.allocate's argument)
        raise ValueError(f"--hot: expected an integer <= {HOT_MAX} (int16 hot-slot numbers), got {args.hot}")
    if config.can_overflow:  # only --scratch below the rule
        print(f"kvplan demo: warning: {_overflow_warning(config)}", file=sys.stderr)
    loop = DecodeLoop(config, device, check=check)
    growth = args.growth
    if args.growth == "bucketed":
        growth += f" (batch buckets {','.join(map(str, loop.pool.config.batch_buckets))})"
    attention = None
    if check:  # requests starting short (hot slots from prefill) and growing long (served by the swap-in)
        context = max(2, args.hot // 2)
        attention = SparseAttentionCheck(
            AttentionCheckConfig(
                batch=args.attention_batch,
                hot=args.hot,
                tail=config.tail,
                scratch=config.scratch_rows,
                top_k=min(max(args.top_k), args.hot),
                spec_steps=max(args.spec_steps),
                context=context,
                max_len=context + args.steps + config.tail + 1,
                seed=args.seed,
            ),
            device,
        )
    where = "Triton interpreter on the CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"kvplan demo: {config.steps} decode steps on {device} ({where}), growth {growth}; "
        f"{'every step checked against the PyTorch reference' if check else 'reference check off'}"
    )
    print(_shapes_line(config))
    if attention is not None:
        n = args.attention_batch
        print(f"end-to-end check: a sparse-attention step on {n} request{'s' * (n != 1)} after every decode step")
    taken = [name for name in defaults if name not in given and (name != "attention_batch" or check)]
    if device.type == "cpu" and taken:
        gpu = dict(DEVICE_DEFAULTS["cuda"])
        gpu["attention_batch"] = min(args.max_batch, gpu["attention_batch"])
        print(
            "CPU defaults (Triton's interpreter runs every kernel program in turn): "
            + ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in taken)
            + "; on a GPU "
            + ", ".join(f"--{n.replace('_', '-')} {gpu[n]}" for n in taken)
        )
    records, attended = [], []
    started = time.perf_counter()
    try:
        for record in _progress(loop.run(), config.steps):
            records.append(record)
            if attention is not None:
                result = attention.step(spec_steps=min(record.num_steps, config.tail))
                attended.append(result)
                if not result.ok:
                    print(f"kvplan demo: SPARSE ATTENTION MISMATCH at step {record.step}: {result}", file=sys.stderr)
                    return 1
    except MismatchError as exc:
        print(f"kvplan demo: MISMATCH at step {len(records)}: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    stats = loop.pool.stats()
    _report(records, stats, elapsed)
    if check:
        try:
            counts = loop.counters_match()
        except MismatchError as exc:
            print(f"kvplan demo: MISMATCH after {len(records)} steps: {exc}", file=sys.stderr)
            return 1
        print(
            f"checked: all {len(records)} steps equal the reference (outputs, cache state, plan, device rows, "
            f"replayed layers; KV within tolerance); device counters equal the reference's: {counts}"
        )
        dense = sum(r.dense_checked for r in attended)
        print(
            f"sparse attention: all {len(attended)} steps exact (attention over the swap-in's device rows equals "
            f"attention over the host rows bit for bit; {sum(r.misses_copied for r in attended)} rows copied, "
            f"{sum(r.overflowed for r in attended)} overflowed); {dense} outputs whose top-k covered the whole context "
            f"equal dense attention within {max((r.dense_max_error for r in attended), default=0.0):.1e}"
        )
    if not _report_overflow(config, stats, attended):
        return 1
    if plot is not None:
        _plot(records, *plot)
    if args.metrics:
        from prometheus_client import CollectorRegistry, generate_latest

        from kvplan.metrics import PoolCollector

        registry = CollectorRegistry()
        registry.register(PoolCollector(loop.pool))
        print(generate_latest(registry).decode(), end="")
    return 0


def _check_shapes(args: argparse.Namespace) -> None:
    """The shapes, refused before the run with the flags as typed, what each expects and what was given."""
    check_int("--steps", args.steps, 1, meaning="decode steps to simulate")
    check_int("--seed", args.seed, 0, 1 << 64, meaning="a torch.Generator seed")
    check_int("--max-batch", args.max_batch, 1, meaning="requests running at once")
    check_int("--hot", args.hot, 1, meaning="hot-buffer slots per request")
    check_int("--max-len", args.max_len, 1, meaning="the longest context in tokens")
    if args.scratch is not None:
        check_int("--scratch", args.scratch, 0, meaning="scratch rows per request")
    if args.attention_batch is not None:
        check_int("--attention-batch", args.attention_batch, 1, meaning="requests of the sparse-attention check")
    if max(args.top_k) > args.hot:
        raise ValueError(
            f"--top-k: expected values <= --hot ({args.hot}: a request's top-k is resolved into its hot slots), "
            f"got {','.join(map(str, args.top_k))}"
        )
    steps = max(args.spec_steps)
    if args.max_len < 2 * steps + 3:
        raise ValueError(
            f"--max-len: expected >= 2 x {steps} + 3 = {2 * steps + 3} for --spec-steps up to {steps} (room for a "
            f"request to grow by its drafts), got {args.max_len}"
        )


#: what the reference check's sparse-attention requests hold per request and token at most (host rows as float32 and
#: bf16, indexer keys, host-row tables and their permutation): about 250 bytes
_ATTENTION_BYTES_PER_TOKEN = 256


def _check_memory(args: argparse.Namespace, config, device, check: bool) -> None:
    """Refuse shapes whose tables outgrow the machine before anything is allocated, naming the flags that size them
    (DecodeLoop checks the same for its own tables, in LoopConfig's terms)."""
    import os

    import torch

    from kvplan.testing.simulation import footprint

    c = config
    need = footprint(c)
    places = {"host": need["host_caches"], "device": need["state"] + need["device_buffers"]}
    capacity = {}
    if device.type == "cuda":
        capacity["device"] = torch.cuda.get_device_properties(device).total_memory
    else:
        places = {"host": sum(places.values())}
    try:
        capacity["host"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: nothing to compare with
        pass
    given_scratch = "" if args.scratch is None else f", --scratch {args.scratch}"
    lower = "--max-batch, --max-len or --hot" if args.scratch is None else "--max-batch, --max-len, --hot or --scratch"
    for where, nbytes in places.items():
        if where in capacity and nbytes > capacity[where]:
            raise ValueError(
                f"--max-batch {args.max_batch}, --max-len {args.max_len}, --hot {args.hot}{given_scratch}: expected "
                f"tables that fit this machine's {_gib(capacity[where])} of {where} memory, got {_gib(nbytes)}; lower "
                f"{lower}"
            )
    rows = c.num_reqs * (c.hot + c.tail + c.scratch_rows)
    if rows >= 1 << 31:
        raise ValueError(
            f"--max-batch {args.max_batch}, --hot {args.hot}{given_scratch}: expected at most 2**31 - 1 device rows "
            f"((--max-batch + 2) x (--hot + {c.tail} tail + {c.scratch_rows} scratch), int32 row numbers), got {rows}"
        )
    if check and "host" in capacity:
        tokens = max(2, args.hot // 2) + args.steps + c.tail + 1  # the check's requests grow one token a step
        requests = args.attention_batch
        rows = requests * (c.hot + c.tail + c.scratch_rows)  # its device rows: 32 bf16 values each
        nbytes = places["host"] + requests * tokens * _ATTENTION_BYTES_PER_TOKEN + rows * 64
        if nbytes > capacity["host"]:
            raise ValueError(
                f"--steps {args.steps}: the reference check's requests grow one token a step; expected tables that "
                f"fit this machine's {_gib(capacity['host'])} of host memory, got about {_gib(nbytes)}; lower --steps "
                "or pass --check off"
            )


def _gib(nbytes: int) -> str:
    from decimal import Decimal

    return f"{Decimal(nbytes) / (1 << 30):.3g} GiB"


def _rule(config) -> str:
    """``kvplan.sizing.scratch_rows(HOT, S, K)`` at the config's largest steps and top_k."""
    return f"kvplan.sizing.scratch_rows({config.hot}, {max(config.spec_steps_choices)}, {max(config.top_k_choices)})"


def _shapes_line(config) -> str:
    c = config
    if c.can_overflow:
        scratch = f"--scratch; {_rule(c)} = {c.scratch_rule}: swap-ins can overflow"
    else:
        scratch = f"= {_rule(c)}: no swap-in can overflow"
    return (
        f"shapes: batch 1 to {c.max_batch} (launched padded to {','.join(map(str, c.batch_buckets))}), spec steps "
        f"{','.join(map(str, c.spec_steps_choices))}, top_k {','.join(map(str, c.top_k_choices))}, hot {c.hot}, tail "
        f"{c.tail}; scratch {c.scratch_rows} rows per request ({scratch})"
    )


def _overflow_warning(config) -> str:
    """One line: --scratch below the rule, what that does and how many rows the rule needs."""
    c = config
    steps, top_k = max(c.spec_steps_choices), max(c.top_k_choices)
    return (
        f"--scratch {c.scratch} is below the {c.scratch_rule} scratch rows per request with which no speculative "
        f"swap-in overflows ({_rule(c)}: --spec-steps up to {steps} x --top-k up to {top_k} - --hot {c.hot}); misses "
        "past them come back as -1, counted as overflow"
    )


def _report_overflow(config, stats, attended) -> bool:
    """The overflow line of the summary; False (the demo fails) when something overflowed although the scratch rows
    meet kvplan.sizing.scratch_rows, which says nothing can."""
    loop_overflow = stats.as_dict()["counters.overflow"]
    checked = sum(r.overflowed for r in attended)
    total = loop_overflow + checked
    where = f"decode loop: counters.overflow = {loop_overflow}"
    if attended:
        where += f"; sparse-attention check: {checked}"
    c = config
    if c.can_overflow:
        sized = f"{c.scratch_rows} scratch rows per request (--scratch), below the {c.scratch_rule} of {_rule(c)}"
    else:
        sized = f"{c.scratch_rows} scratch rows per request = {_rule(c)}, so none can"
    print(f"overflow: {total} speculative misses dropped ({where}); {sized}")
    if not c.can_overflow and total:
        print(
            f"kvplan demo: OVERFLOW: {total} misses dropped with {c.scratch_rows} scratch rows per request, which "
            f"{_rule(c)} says none can",
            file=sys.stderr,
        )
        return False
    return True


def _progress(records, total):
    try:
        from rich.progress import Progress
    except ImportError:  # the plain progress runs outside this handler: an error in a step is not chained to it
        Progress = None
    if Progress is None:
        # a terminal: one line rewritten in place; a file or pipe: a line every tenth of the run (and the last)
        live = sys.stderr.isatty()
        every = max(1, total // 10)
        try:
            for i, record in enumerate(records, 1):
                if live:
                    print(f"\rstep {i}/{total}", end="", file=sys.stderr, flush=True)
                elif i % every == 0 or i == total:
                    print(f"step {i}/{total}", file=sys.stderr, flush=True)
                yield record
        finally:
            if live:  # end the rewritten line, also when the run stops early
                print(file=sys.stderr)
        return
    with Progress(transient=False) as progress:
        task = progress.add_task("decode steps", total=total)
        for record in records:
            progress.advance(task)
            yield record


def _report(records, stats, elapsed: float) -> None:
    from kvplan.cli._output import human_bytes, print_table

    flat = stats.as_dict()
    buffers = [b.name for b in stats.buffers]
    rows = []
    for name in buffers:
        group = name
        capacity = ", ".join(
            f"{k.split('.')[-1]}={v}"
            for k, v in flat.items()
            if k.startswith(f"{group}.capacity.") and not k.endswith(".elements")
        )
        rows.append(
            [
                name,
                human_bytes(flat[f"{group}.reserved_bytes.current"]),
                human_bytes(flat[f"{group}.reserved_bytes.peak"]),
                capacity,
                flat[f"{group}.grow_events"],
            ]
        )
    rows.append(
        [
            "total",
            human_bytes(flat["total.reserved_bytes.current"]),
            human_bytes(flat["total.reserved_bytes.peak"]),
            f"generation={flat['generation']}",
            flat["total.grow_events"],
        ]
    )
    print_table(
        f"pool stats after {len(records)} steps ({elapsed:.1f} s)",
        ["buffer", "reserved", "peak", "capacity", "grows"],
        rows,
    )
    causes = {k.rsplit(".", 1)[-1]: v for k, v in flat.items() if k.startswith("total.grow_causes.")}
    counters = {k.rsplit(".", 1)[-1]: v for k, v in flat.items() if k.startswith("counters.")}
    print("growth causes: " + ", ".join(f"{k}={v}" for k, v in causes.items()))
    print("device counters: " + ", ".join(f"{k}={v}" for k, v in counters.items()))
    timeline = [
        [
            r.step,
            r.batch,
            r.padded_batch,
            r.num_steps,
            r.top_k,
            r.total_ctx,
            r.generation,
            human_bytes(sum(r.reserved_bytes.values())),
        ]
        for r in records
        if r.grew
    ]
    print_table(
        "growth timeline (steps where ensure_capacity grew)",
        ["step", "batch", "padded", "S", "top_k", "ctx", "gen", "reserved"],
        timeline,
    )


def _check_plot(path: str) -> tuple[str, str]:
    """``--plot``: matplotlib present, a format it writes, the file writable (checked before the run). Returns the
    path and the format: the plot goes to exactly ``path``, as PNG when it has no suffix."""
    from kvplan.cli._args import check_output_file

    if not path:
        raise ValueError("--plot: expected a file name, got ''")
    if os.path.isdir(path):
        raise ValueError(f"--plot {path}: is a folder; give a file name")
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'kvplan[ui]')") from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = os.path.splitext(path)[1][1:].lower() or "png"  # "pool" or "pool.": a PNG, at that very path
    if suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write .{suffix} files; use one of {', '.join(formats)}")
    check_output_file("--plot", path)
    return path, suffix


#: line styles of the reserved-bytes panel, one per group of buffers with the same series
_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 2)), "P")]


def _changes(values) -> list[int]:
    """Indices where a series takes a new value (the first included): where a step line gets its marker."""
    return [i for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _figure(records):
    """The plot: one panel per unit, sharing the step axis, each legend outside its axes (right of it).

    1. reserved bytes per buffer (log scale): buffers whose series are equal at every step are one line, labelled
       ``k_out = v_out``; every line its own style, a marker where it changes;
    2. batch rows: capacity (miss_count's rows) and demand (the step's padded batch), the real batch as markers;
    3. miss plan entries: capacity (miss_src/miss_dst elements) and demand (padded batch x steps x top_k);
    4. tokens: the KV slabs' capacity and demand (each step's draft tokens materialized, ``total_ctx``).

    Capacity and demand are two lines in every panel, and every panel marks the steps where the pool grew.
    """
    import math

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    from kvplan.cli._output import human_bytes

    steps = [r.step for r in records]
    fig = Figure(figsize=(10, 10), layout="constrained")
    axes = fig.subplots(4, 1, sharex=True)
    reserved, rows, columns, tokens = axes
    legend = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)

    groups: dict[tuple[int, ...], list[str]] = {}
    for name in records[-1].reserved_bytes:
        groups.setdefault(tuple(r.reserved_bytes.get(name, 0) for r in records), []).append(name)
    for (series, names), (linestyle, marker) in zip(groups.items(), _STYLES * len(groups)):
        reserved.step(steps, series, where="post", linestyle=linestyle, marker=marker, markevery=_changes(series),
                      markersize=5, label=" = ".join(names))  # fmt: skip
    reserved.set_yscale("symlog" if min(min(series) for series in groups) <= 0 else "log")
    largest = max(max(series) for series in groups)
    if largest > 0:  # up to the next tick, so the largest buffer sits under a labelled line
        reserved.set_ylim(top=16 ** math.ceil(math.log(largest, 16) + 1e-9))
    reserved.yaxis.set_major_locator(LogLocator(base=16))  # 16 B, 256 B, 4 KiB, 64 KiB, 1 MiB: binary units
    reserved.yaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(int(value))))
    reserved.set_ylabel("reserved (bytes)")
    reserved.set_title("kvplan pool over the decode steps")

    def elements(record, name: str) -> int:
        return record.capacity[f"{name}.capacity.elements"]

    # Capacity and demand in units that do not depend on the step's shape (a steps or top_k change re-lays the rows
    # over the same storage, so "rows at this step's columns" would swing with the demand though nothing shrank).
    rows.step(steps, [elements(r, "miss_count") for r in records], where="post", color="C0",
              label="capacity (miss_count rows)")  # fmt: skip
    rows.step(steps, [r.padded_batch for r in records], where="post", color="C1", linestyle="--",
              label="demand: step batch, padded")  # fmt: skip
    rows.plot(steps, [r.batch for r in records], "x", color="C3", markersize=5, label="step batch, real requests")
    rows.set_ylabel("batch (rows)")

    columns.step(steps, [min(elements(r, "miss_src"), elements(r, "miss_dst")) for r in records], where="post",
                 color="C0", label="capacity (miss_src and\nmiss_dst elements)")  # fmt: skip
    columns.step(steps, [r.padded_batch * r.num_steps * r.top_k for r in records], where="post", color="C2",
                 linestyle="--", label="demand: padded batch\nx steps x top_k")  # fmt: skip
    columns.set_ylabel("miss plan (entries)")

    slabs = "k_out.capacity.ctx"
    if any(slabs in r.capacity for r in records):
        tokens.step(steps, [r.capacity.get(slabs, 0) for r in records], where="post", color="C0",
                    label="capacity (k_out/v_out)")  # fmt: skip
    tokens.step(steps, [r.total_ctx for r in records], where="post", color="C4", linestyle="--",
                label="demand: step draft\ntokens (batch x steps)")  # fmt: skip
    tokens.set_ylabel("draft KV (tokens)")
    tokens.set_xlabel("decode step")
    grew = [r.step for r in records if r.grew]
    for ax in axes:  # every panel marks the steps where ensure_capacity grew the pool
        for i, step in enumerate(grew):
            label = "growth (ensure_capacity\ngrew)" if i == 0 else None
            ax.axvline(step, color="0.4", linestyle=":", linewidth=1, label=label)
    reserved.legend(title="buffer", **legend)
    for ax in (rows, columns, tokens):
        ax.legend(**legend)
    for ax in (rows, columns, tokens):
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 4, 8, 10]))
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _plot(records, path: str, fmt: str) -> None:
    """Draw the plot and write it to ``path``; a write that fails (a full disk, ``/dev/full``) is one line and exit
    status 2 through kvplan.cli.main, never "plot written"."""
    import io

    fig = _figure(records)
    image = io.BytesIO()
    fig.savefig(image, format=fmt, dpi=110)
    try:
        with open(path, "wb") as out:
            out.write(image.getbuffer())
    except OSError as exc:
        raise ValueError(f"--plot {path}: writing the plot failed ({exc.strerror or exc})") from None
    print(f"plot written to {path}")
