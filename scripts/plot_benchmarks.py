"""Plot the H200 benchmark JSON (from bench_materialize.py and bench_swap_in.py) as PNGs for docs/benchmarks.md.

python scripts/plot_benchmarks.py --results results --out docs/img
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_materialize(data: dict, out: pathlib.Path) -> None:
    rows = data["rows"]
    tokens = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, [r["triton_gbs"] for r in rows], "o-", label="kvplan Triton kernel")
    ax.plot(tokens, [r["mb"] * 1e-3 / (r["compiled_us"] * 1e-6) for r in rows], "s--", label="torch.compile(reference)")
    ax.plot(tokens, [r["mb"] * 1e-3 / (r["reference_us"] * 1e-6) for r in rows], "x:", label="eager PyTorch reference")
    ax.axhline(data["copy_gbs"], color="k", lw=1, label=f"device copy ceiling {data['copy_gbs']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T (Lyr=5, H=8, D=128, bf16)")
    ax.set_ylabel("GB/s (read + written)")
    ax.set_title("Fused KV materialize on the H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "materialize_h200.png", dpi=110)


def plot_swap_in(data: dict, out: pathlib.Path) -> None:
    """One panel per workload (A, B, C of kvplan.benchmarks.swap_in): kvplan, SGLang's CUDA kernels (where measured)
    and the link's ideal, µs per call by batch."""
    workloads = sorted({r["workload"] for r in data["runs"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    styles = {"spec": "C0", "single": "C1", "spec+3 replays": "C2"}
    for ax, workload in zip(axes[0], workloads):
        for call, color in styles.items():
            rows = sorted(
                (r for r in data["runs"] if r["workload"] == workload and r["call"] == call), key=lambda r: r["batch"]
            )
            if not rows:
                continue
            batches = [r["batch"] for r in rows]
            ax.plot(batches, [r["us_per_call"] for r in rows], "o-", color=color, label=f"{call}: kvplan")
            sglang = [r["sglang_us"] for r in rows]
            if all(us == us for us in sglang):  # (no SGLang figure for workload C: NaN)
                ax.plot(batches, sglang, "s--", color=color, alpha=0.6, label=f"{call}: SGLang CUDA")
            ideal = [r["miss_bytes"] / (r["ceiling_gbps"] * 1e3) for r in rows]
            ax.plot(batches, ideal, ":", color=color, alpha=0.8, label=f"{call}: bytes / pinned copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("µs per call (CUDA graph)")
        ax.set_title(f"Swap-in, workload {workload} (K=2048, HOT=4096, 576 B rows)", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "swap_in_h200.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    results, out = pathlib.Path(args.results), pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_materialize(json.loads((results / "bench_materialize.json").read_text()), out)
    plot_swap_in(json.loads((results / "bench_swap_in.json").read_text()), out)
    print(f"plots written to {out}")


if __name__ == "__main__":
    main()
