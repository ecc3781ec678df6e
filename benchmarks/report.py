"""Plot a layer-benchmark results file and regenerate the README's performance table.

    python -m benchmarks.report [results.json ...] [--readme README.md] [--no-readme] [--no-plot]

Default input: the newest benchmarks/results/*-layer-ep1*.json (else the newest *.json).
Several files (e.g. one run per group of shapes, to stay under a time limit) are merged:
each case keeps the baselines of its own run, and a case present twice is taken from the
file named last. Writes benchmarks/plots/<same stem>.png (mok's speedup over each baseline per shape,
forward and backward; needs matplotlib, skipped with a message otherwise) and rewrites
the table between `<!-- perf-table:start -->` and `<!-- perf-table:end -->` in the
README, adding the markers under the "## Status" section's "Performance numbers appear
here..." paragraph when they are missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
PLOTS_DIR = REPO / "benchmarks" / "plots"
README = REPO / "README.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
SUBJECT = "mok"
BASELINES = ("sonicmoe", "megatron-te", "torch-unfused", "megatron-alltoall")  # EP=1 (benchmarks.layer)
# Column order for whatever baselines a results file holds (benchmarks.layer_ep adds the
# all-to-all and flex ones); a baseline with no timing at all (skipped) gets no column.
BASELINE_ORDER = ("sonicmoe", "megatron-te", "torch-unfused", "torch-a2a", "megatron-alltoall", "megatron-flex-deepep",
                  "megatron-flex-hybridep")
EP_START, EP_END = "<!-- perf-table-ep:start -->", "<!-- perf-table-ep:end -->"


def baselines_of(records: list) -> list:
    timed = {r["backend"] for r in records if r.get("ms") and r.get("backend") != SUBJECT}
    return ([b for b in BASELINE_ORDER if b in timed]
            + sorted(timed.difference(BASELINE_ORDER)))
PASS_ORDER = {"fwd": 0, "bwd": 1}
ROUTING_ORDER = {"balanced": 0, "skewed": 1, "adversarial": 2}


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------

def latest_results(results_dir: Path = RESULTS_DIR) -> Path:
    files = [p for p in results_dir.glob("*.json") if p.is_file()]
    preferred = [p for p in files if "layer-ep1" in p.name]
    pool = preferred or files
    if not pool:
        raise FileNotFoundError(f"no results in {results_dir}; run python -m benchmarks.layer")
    return max(pool, key=lambda p: (p.stat().st_mtime, p.name))


def load_results(path: Path) -> tuple[dict, list]:
    doc = json.loads(Path(path).read_text())
    if isinstance(doc, list):  # a bare list of records
        return {}, doc
    return doc.get("meta", {}), doc.get("records", [])


def provenance_problem(path: Path) -> Optional[str]:
    """Why a results file may not feed the README (None when it may): it must come from a
    committed tree, i.e. name a real commit and say git_dirty: false."""
    meta, _ = load_results(path)
    commit = meta.get("git_commit")
    if meta.get("git_dirty") is not False:
        return f"{path.name}: git_dirty is {meta.get('git_dirty')!r}, not false"
    if not commit or len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        return f"{path.name}: git_commit {commit!r} is not a commit id"
    return None


def merge_results(paths: list) -> tuple[dict, list]:
    """Records of several files, later files replacing the same case of earlier ones; the
    first file's metadata (the GPUs and peaks of all of them are checked to match). A
    record replacing one of the same backend keeps the earlier one's speed-ups over
    baselines its own run did not time: every ratio stays one measured within one run."""
    meta: dict = {}
    merged: dict = {}
    gpus, peaks = set(), []
    for path in paths:
        m, records = load_results(path)
        meta = meta or m
        gpus.add(m.get("gpu"))
        if m.get("peak_tflops"):
            peaks.append(m["peak_tflops"])
        for r in records:
            key = (r["shape"], r["T"], r["routing"], r["pass"], r["backend"])
            if key in merged and r.get("ms"):
                r = {**r, "speedup": {**(merged[key].get("speedup") or {}),
                                      **(r.get("speedup") or {})}}
            merged[key] = r
    if len(gpus) > 1:
        print(f"warning: merging results from different GPUs: {sorted(map(str, gpus))}")
    if len(peaks) > 1:
        meta = {**meta, "peak_tflops_range": [min(peaks), max(peaks)]}
    return meta, list(merged.values())


def _shape_order(records: list) -> dict:
    order: dict = {}
    for r in records:
        order.setdefault(r["shape"], len(order))
    return order


def _case_key(r: dict, shape_order: dict):
    return (shape_order.get(r["shape"], 99), r["T"], ROUTING_ORDER.get(r["routing"], 9),
            r["routing"], PASS_ORDER.get(r["pass"], 9))


def group_cases(records: list) -> list[tuple[tuple, dict]]:
    """[((shape, T, routing, pass), {backend: record})] in run order."""
    order = _shape_order(records)
    cases: dict = {}
    for r in records:
        key = (r["shape"], r["T"], r["routing"], r["pass"])
        cases.setdefault(key, {})[r["backend"]] = r
    return sorted(cases.items(),
                  key=lambda kv: _case_key(next(iter(kv[1].values())), order))


# ----------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------

def _ms(r: Optional[dict]) -> str:
    if r is None:
        return "–"
    if r.get("ms") is None:
        return "error" if r.get("error") else "–"
    return f"{r['ms']:.3f}"


def _num(value, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _mib(value) -> str:
    return "–" if value is None else f"{value / 2 ** 20:.0f}"


def _tflops(value) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"


def _speedup(r: Optional[dict], base: str) -> str:
    if r is None or r.get("ms") is None:
        return "–"
    s = (r.get("speedup") or {}).get(base)
    return "–" if s is None else f"{s:.2f}×"


def _check(backends: dict) -> str:
    failed = [b for b, r in backends.items() if r.get("correct") is False]
    unchecked = [b for b, r in backends.items() if r.get("correct") is None and r.get("ms")]
    if failed:
        return "FAIL " + ", ".join(failed)
    if unchecked:
        return "unchecked " + ", ".join(unchecked)
    return "ok"


def markdown_table(meta: dict, records: list, source: Optional[str] = None) -> str:
    """The README table: one row per (shape, T, routing, pass), mok vs the baselines."""
    lines = []
    gpu = meta.get("gpu") or (records[0].get("gpu") if records else None) or "?"
    commit = (meta.get("git_commit") or (records[0].get("git_commit") if records else None)
              or "?")[:10]
    dirty = "+dirty" if meta.get("git_dirty") else ""
    if meta.get("source_commit"):  # the device copy's git metadata can lag the tree that ran
        commit, dirty = meta["source_commit"][:10], ""
    peak = meta.get("peak_tflops") or (records[0].get("peak_tflops") if records else None)
    mok_backend = next((r["info"].get("mok_backend") for r in records
                        if r.get("backend") == SUBJECT and r.get("info")), None)
    ep = meta.get("ep") or 1
    scope = ("EP=1 layer, ep8-proxy shapes (E_loc = E/8; mixtral E_loc = E)" if ep == 1 else
             f"EP={ep} layer, one process per GPU, full shapes (E/{ep} experts per rank; time = "
             f"slowest rank; TFLOP/s and NVLink GB/s per GPU)")
    head = (f"{scope}, BF16, on {gpu}, "
            f"{meta.get('date', '?')}, commit `{commit}{dirty}`, torch {meta.get('torch', '?')} "
            f"(CUDA {meta.get('cuda', '?')})")
    if meta.get("peak_tflops_range"):
        lo, hi = meta["peak_tflops_range"]
        head += f"; dense BF16 peak {_tflops(lo)}–{_tflops(hi)} TFLOP/s measured in each run"
    elif peak:
        head += f"; dense BF16 peak {_tflops(peak)} TFLOP/s measured in the same run"
    if mok_backend:
        head += f"; mok backend `{mok_backend}`"
    head += (". Median of CUDA-event timings with L2 flushed, the CPU running ahead; forward "
             "includes schedule building, backward is the backward call only; ×b = b's time "
             "/ mok's time, both timed in the same run; host ms = CPU time of one layer call.")
    if source:
        head += f" Source: `{source}` (`python -m benchmarks.report` regenerates this table)."
    lines.append(head)
    lines.append("")
    baselines = baselines_of(records)
    nvlink = any(r.get("nvlink_gbps_per_gpu") is not None for r in records)
    host = any(r.get("host_ms") is not None for r in records if r.get("backend") == SUBJECT)
    cols = ["shape", "T", "routing", "pass", "mok ms", "TFLOP/s", "of peak", "time / floor"]
    if host:
        cols.append("mok host ms")
    if nvlink:
        cols.append("NVLink GB/s")
    for b in baselines:
        cols += [f"{b} ms", f"× {b}"]
    cols.append("check")
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" for _ in cols) + "|")
    for (shape, t, routing, which), backends in group_cases(records):
        m = backends.get(SUBJECT)
        row = [shape, str(t), routing, which, _ms(m),
               _tflops(m and m.get("tflops")), _num(m and m.get("frac_peak"), ".2f"),
               _num(m and m.get("time_over_floor"), ".2f")]
        if host:
            row.append(_num(m and m.get("host_ms"), ".3f"))
        if nvlink:
            row.append(_num(m and m.get("ms") and m.get("nvlink_gbps_per_gpu"), ".0f"))
        for b in baselines:
            row += [_ms(backends.get(b)), _speedup(m, b)]
        row.append(_check(backends))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def console_table(records: list) -> str:
    """Every record, one line each (the benchmark's final table)."""
    baselines = baselines_of(records)
    cols = ["shape", "T", "routing", "pass", "backend", "ms", "TFLOP/s", "peak", "/floor",
            "host ms", "saved MiB", *(f"x{b}" for b in baselines), "check"]
    rows = []
    for _, backends in group_cases(records):
        for name in sorted(backends, key=lambda b: (b != SUBJECT, b)):
            r = backends[name]
            if r.get("correct") is True:
                check = f"ok {r['rel_l2']:.1e}"
            elif r.get("correct") is False:
                check = f"FAIL {r['rel_l2']:.1e}"
            else:
                check = "-"
            if r.get("error"):
                check = (check + " | " if check != "-" else "") + r["error"][:60]
            rows.append([r["shape"], str(r["T"]), r["routing"], r["pass"], name,
                         _ms(r), _tflops(r.get("tflops")),
                         _num(r.get("frac_peak"), ".2f"), _num(r.get("time_over_floor"), ".2f"),
                         _num(r.get("host_ms"), ".3f"), _mib(r.get("saved_bytes")),
                         *(_speedup(r, b).replace("×", "x") for b in baselines), check])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------
# README
# ----------------------------------------------------------------------------------------

def insert_markers(text: str, start: str = START, end_marker: str = END) -> str:
    """Put empty markers under the Status section's "Performance numbers appear here"
    paragraph (else at the end of the Status section, else at the end of the file); the EP
    table's markers go right after the EP=1 table's when those exist."""
    if start in text and end_marker in text:
        return text
    if start != START and END in text:
        i = text.index(END) + len(END)
        return text[:i] + f"\n\n{start}\n{end_marker}" + text[i:]
    START_, END_ = start, end_marker
    block = f"{START_}\n{END_}\n"
    lines = text.splitlines(keepends=True)
    status = next((i for i, l in enumerate(lines) if l.strip().lower() == "## status"), None)
    if status is not None:
        end = next((i for i in range(status + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        para = next((i for i in range(status + 1, end)
                     if lines[i].lstrip().startswith("Performance numbers appear here")), None)
        if para is not None:
            j = para
            while j < end and lines[j].strip():
                j += 1  # first blank line after the paragraph
            if j > 0 and not lines[j - 1].endswith("\n"):
                lines[j - 1] += "\n"
            return "".join(lines[:j]) + "\n" + block + "".join(lines[j:])
        k = end
        while k > status + 1 and not lines[k - 1].strip():
            k -= 1
        return "".join(lines[:k]) + "\n" + block + "".join(lines[k:])
    sep = "" if text.endswith("\n") else "\n"
    return text + sep + "\n" + block


def update_readme(readme: Path, table: str, ep: int = 1) -> None:
    """Rewrite the table between the markers (the EP=1 table's, or the EP tables')."""
    start_m, end_m = (START, END) if ep == 1 else (EP_START, EP_END)
    text = insert_markers(readme.read_text(), start_m, end_m)
    start = text.index(start_m) + len(start_m)
    end = text.index(end_m, start)
    readme.write_text(text[:start] + "\n" + table.rstrip("\n") + "\n" + text[end:])


# ----------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------

def plot_speedups(records: list, out_png: Path, title: str = "") -> Optional[Path]:
    """Bars of mok's speedup over each baseline per (shape, T, routing), fwd and bwd."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:
        print(f"matplotlib not importable ({type(err).__name__}); no plot written")
        return None
    cases = group_cases(records)
    passes = [p for p in ("fwd", "bwd") if any(k[3] == p for k, _ in cases)]
    if not any(b.get(SUBJECT, {}).get("ms") for _, b in cases) or not passes or not baselines_of(records):
        print(f"no {SUBJECT} timings in the results; no plot written")
        return None
    routings = {k[2] for k, _ in cases}
    tokens = {k[1] for k, _ in cases}
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8.0, 1.2 * len(cases) / len(passes)),
                                                      4.2 * len(passes)), squeeze=False)
    baselines = baselines_of(records)
    width = 0.8 / max(1, len(baselines))
    for ax, which in zip(axes[:, 0], passes):
        rows = [(k, b) for k, b in cases if k[3] == which]
        labels = []
        for shape, t, routing, _ in (k for k, _ in rows):
            label = shape
            if len(tokens) > 1:
                label += f"\nT={t}"
            if len(routings) > 1:
                label += f"\n{routing}"
            labels.append(label)
        xs = range(len(rows))
        for j, base in enumerate(baselines):
            vals = [(b.get(SUBJECT) or {}).get("speedup", {}).get(base) for _, b in rows]
            heights = [v if v is not None else 0.0 for v in vals]
            bars = ax.bar([x + (j - (len(baselines) - 1) / 2) * width for x in xs], heights,
                          width, label=f"vs {base}")
            for bar, v in zip(bars, vals):
                if v is not None:
                    ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel(f"{which} speedup (×)")
        ax.set_title(f"{SUBJECT} {which}: speedup over each baseline")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=130)
    plt.close(fig)
    return out_png


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="*", help="results JSON file(s) (default: the newest)")
    p.add_argument("--readme", default=str(README))
    p.add_argument("--plots", default=str(PLOTS_DIR))
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)

    paths = [Path(p) for p in args.results] or [latest_results()]
    meta, records = merge_results(paths)
    if not records:
        print(f"{', '.join(map(str, paths))}: no records")
        return 1
    print(console_table(records))
    stem = paths[0].stem + ("-merged" if len(paths) > 1 else "")
    if not args.no_plot:
        title = f"{meta.get('gpu', '?')} {meta.get('date', '')} {', '.join(p.name for p in paths)}"
        png = plot_speedups(records, Path(args.plots) / f"{stem}.png", title)
        if png:
            print(f"plot: {png}")
    problems = [p for p in map(provenance_problem, paths) if p]
    if problems and not args.no_readme:
        print("refusing to write the README table from results of an uncommitted tree:\n  "
              + "\n  ".join(problems) + "\n(commit, rerun, or pass --no-readme)")
        return 2
    if not args.no_readme:
        table = markdown_table(meta, records,
                               source=", ".join(_display_path(p) for p in paths))
        update_readme(Path(args.readme), table, ep=meta.get("ep") or 1)
        print(f"table written to {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
