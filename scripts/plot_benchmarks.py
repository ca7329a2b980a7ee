"""Plot the H200 benchmark JSON (from bench_materialize.py and bench_swap_in.py) as PNGs for docs/benchmarks.md.

python scripts/plot_benchmarks.py --results docs/results --out docs/img
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
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kernel in sorted({r["kernel"] for r in data["swap_in"]}):
        rows = [r for r in data["swap_in"] if r["kernel"] == kernel]
        batches = [r["batch"] for r in rows]
        left.plot(batches, [r["us_per_call"] for r in rows], "o-", label=f"{kernel}: kvplan")
        ideal = [r["unique_miss_bytes"] / (r["ceiling_gbps"] * 1e9) * 1e6 for r in rows]
        left.plot(batches, ideal, "--", label=f"{kernel}: miss bytes / pinned copy ceiling")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("batch")
    left.set_ylabel("µs per call")
    left.set_title("Swap-in (K=2048, HOT=4096, 576 B rows)")
    left.legend(fontsize=7)
    patterns = {"engine-like plan": data["copy_planned"], **data["copy_access_patterns"]}
    right.barh(list(patterns), [p["gbps"] for p in patterns.values()])
    right.axvline(data["ceiling_gbps"], color="k", lw=1, label=f"pinned copy_ ceiling {data['ceiling_gbps']:.1f} GB/s")
    right.set_xlabel("GB/s")
    right.set_title("copy_planned: 50k x 576 B rows, 4.6 GB host cache")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "swap_in_h200.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="docs/results")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    results, out = pathlib.Path(args.results), pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_materialize(json.loads((results / "bench_materialize.json").read_text()), out)
    plot_swap_in(json.loads((results / "bench_swap_in.json").read_text()), out)
    print(f"plots written to {out}")


if __name__ == "__main__":
    main()
