"""Plot forward-megakernel results (benchmarks.megakernel) against the launch chain.

    python -m benchmarks.plot_megakernel [results.json ...] [--out PNG]

Default input: the newest benchmarks/results/*-megakernel-fwd*.json. For every shape, the
best point of each megakernel mode (direct, comm, spread) in each file is drawn as a speedup over
the core launch chain timed in the same run (1.0 = as fast as the chain), next to the
torch launch chain; with several files (e.g. one per kernel version) each file is one
group of bars, labelled by its source commit. Writes benchmarks/plots/<stem>.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
PLOTS_DIR = REPO / "benchmarks" / "plots"
CHAIN = "launches-mok"
SERIES = ("launches-torch", "megakernel-direct", "megakernel-comm", "megakernel-spread")


def latest(results_dir: Path = RESULTS_DIR) -> Path:
    files = sorted(results_dir.glob("*-megakernel-fwd*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"no *-megakernel-fwd*.json under {results_dir}")
    return files[-1]


def best_speedups(results: list) -> dict:
    """{shape: {series: chain_ms / best_ms}} over the points of one run."""
    chain = {r["shape"]: r["ms"] for r in results if r["path"] == CHAIN}
    best: dict = {}
    for r in results:
        if r["path"] not in SERIES or r["shape"] not in chain or not r.get("ms"):
            continue
        if r.get("bit_equal") is False:
            continue  # a wrong answer is not a speed
        per_shape = best.setdefault(r["shape"], {})
        per_shape[r["path"]] = max(per_shape.get(r["path"], 0.0), chain[r["shape"]] / r["ms"])
    return best


def label_of(meta: dict, path: Path) -> str:
    return str(meta.get("source_commit") or meta.get("git_commit", "")[:7] or path.stem)


def plot(files: list, out_png: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    runs = []
    for path in files:
        data = json.loads(Path(path).read_text())
        runs.append((label_of(data.get("meta", {}), Path(path)), best_speedups(data["results"])))
    shapes = list(dict.fromkeys(s for _, best in runs for s in best))
    bars = [(label, series) for label, _ in runs for series in SERIES]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 4.5))
    for i, (label, series) in enumerate(bars):
        best = dict(runs)[label]
        values = [best.get(s, {}).get(series, 0.0) for s in shapes]
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(shapes))]
        name = series if len(runs) == 1 else f"{series} ({label})"
        ax.bar(xs, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=15)
    ax.set_ylabel("speedup over the core launch chain (higher is faster)")
    ax.set_title("MoE forward at EP = 1, T = 8192, H200: megakernel vs launch chains")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    files = args.files or [latest()]
    out = args.out or PLOTS_DIR / f"{files[-1].stem}.png"
    written = plot(files, out)
    if written:
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
