"""Loss curves of a training comparison (`benchmarks.train_report`'s JSON), side by side.

    python -m benchmarks.plot_train RESULTS.json [--out SVG] [--smooth N]

One panel per config, one curve per run (mok, alltoall, mok2, mokfp8, ...), the loss
against the step; --smooth N adds each curve's running mean over N steps (the raw loss of
a small batch is noisy). Writes a self-contained SVG (no plotting package needed) to
benchmarks/plots/<stem>.svg unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
PLOTS_DIR = REPO / "benchmarks" / "plots"
# One colour per kind of run (a repeat, "...2", is its run's colour, dashed).
RUN_COLORS = {"mok": "#1f77b4", "alltoall": "#d62728", "mokfused": "#2ca02c",
              "mokfp8": "#ff7f0e", "mokmfp8": "#9467bd", "alltoallfp8": "#8c564b"}
OTHER_COLOR = "#7f7f7f"
PANEL_W, PANEL_H, MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 520, 320, 64, 150, 36, 44


def running_mean(values: list, n: int) -> list:
    """Mean of the last min(n, i + 1) values at each step i."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(n, i + 1))
    return out


def nice_ticks(lo: float, hi: float, count: int = 5) -> list:
    """About `count` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * step:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _panel(cfg: str, runs: dict, x0: float, smooth: int) -> list:
    curves = {name: r["loss"] for name, r in sorted(runs.items()) if r.get("loss")}
    if not curves:
        return []
    steps = max(len(v) for v in curves.values())
    lo = min(min(v) for v in curves.values())
    hi = max(max(v) for v in curves.values())
    pad = 0.03 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad
    left, top = x0 + MARGIN_L, MARGIN_T
    width = PANEL_W - MARGIN_L - MARGIN_R
    height = PANEL_H - MARGIN_T - MARGIN_B

    def px(step: int) -> float:
        return left + width * (step / max(steps - 1, 1))

    def py(loss: float) -> float:
        return top + height * (1.0 - (loss - lo) / (hi - lo))

    out = [f'<text x="{left + width / 2:.1f}" y="20" text-anchor="middle" '
           f'font-size="14">{cfg}</text>',
           f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" '
           f'stroke="#444"/>']
    for t in nice_ticks(lo, hi):
        y = py(t)
        out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" '
                   f'font-size="11">{t:g}</text>')
    for t in nice_ticks(1, steps):
        x = px(int(t) - 1)
        out.append(f'<text x="{x:.1f}" y="{top + height + 16}" text-anchor="middle" '
                   f'font-size="11">{int(t)}</text>')
    out.append(f'<text x="{left + width / 2:.1f}" y="{top + height + 34}" '
               f'text-anchor="middle" font-size="12">step</text>')
    out.append(f'<text x="{x0 + 14}" y="{top + height / 2:.1f}" font-size="12" '
               f'transform="rotate(-90 {x0 + 14} {top + height / 2:.1f})" '
               f'text-anchor="middle">lm loss</text>')
    for i, (name, losses) in enumerate(curves.items()):
        color = RUN_COLORS.get(name[:-1] if name.endswith("2") else name, OTHER_COLOR)
        shown = running_mean(losses, smooth) if smooth > 1 else losses
        points = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in enumerate(shown))
        dash = ' stroke-dasharray="5,3"' if name.endswith("2") else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" '
                   f'stroke-width="1.4"{dash}><title>{name}</title></polyline>')
        ly = top + 14 + 18 * i
        out.append(f'<line x1="{left + width + 12}" y1="{ly - 4}" x2="{left + width + 36}" '
                   f'y2="{ly - 4}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + width + 42}" y="{ly}" font-size="12">{name} '
                   f'({losses[-1]:.3f})</text>')
    return out


def render(results: dict, smooth: int = 1) -> str:
    """The SVG text of every config's panel, side by side."""
    configs = results.get("configs") or {}
    parts = []
    for i, (cfg, entry) in enumerate(sorted(configs.items())):
        parts += _panel(cfg, entry.get("runs") or {}, i * PANEL_W, smooth)
    width = PANEL_W * max(len(configs), 1)
    caption = f'tree {results.get("source_commit", "?")[:12]}' + \
        (f", running mean over {smooth} steps (legend: last raw loss)" if smooth > 1 else "")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{PANEL_H + 18}" font-family="sans-serif">'
            f'<rect width="100%" height="100%" fill="white"/>' + "".join(parts) +
            f'<text x="8" y="{PANEL_H + 12}" font-size="10" fill="#666">{caption}</text></svg>')


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--out", default=None)
    p.add_argument("--smooth", type=int, default=1)
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    out = Path(args.out) if args.out else PLOTS_DIR / (Path(args.results).stem + ".svg")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, args.smooth))
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
