"""Summarise `scripts/train_compare.sh` logs: loss curves and tokens/s of `mok` vs
`alltoall`, whether two `mok` runs gave identical losses, and how far a run with the
expert weight gradients fused into main_grad (`mokfused`) strays from `mok`.

    python -m benchmarks.train_report LOG... [--out DIR]

Log names: train_<config>_<run>.log, run in {mok, alltoall, mok2, mokfused, mokfp8, mokfp82,
mokmfp8, alltoallfp8} (the last two: Megatron's --fp8-format e4m3 --fp8-recipe blockwise). Tokens/s is the
median over steps after the first 5 (warm-up); a config named `<name>-ep<N>` ran on N GPUs
and also gets tokens/s per GPU. Writes <date>-<gpu>-train-ep1.json (…-train-ep<N>.json when
every config is an EP-N run; <gpu> from MOK_GPU_NAME, else the visible GPU, else "gpu"),
with the tree's commit and dirty flag (benchmarks.provenance).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
from pathlib import Path

STEP = re.compile(r"\[megatron_mok\] step (\d+)/\d+ \| lm loss ([0-9.eE+-]+) \| ([0-9.]+) ms "
                  r"\| ([0-9.]+) tokens/s(?: \| ([0-9.]+) TFLOP/s/GPU)?(?: \| peak ([0-9.]+) GiB)?")


def parse(path: Path) -> dict:
    """A run's per-step loss, ms and tokens/s; on a GPU also Megatron's model TFLOP/s per
    GPU and the rank's peak allocated memory (GiB) where the step line has them."""
    steps = list(STEP.finditer(path.read_text(errors="replace")))
    run = {"loss": [float(m[2]) for m in steps], "ms": [float(m[3]) for m in steps],
           "tokens_per_s": [float(m[4]) for m in steps]}
    if steps and steps[-1][5]:
        run["tflops_per_gpu"] = [float(m[5]) for m in steps if m[5]]
    if steps and steps[-1][6]:
        run["peak_mem_gib"] = max(float(m[6]) for m in steps if m[6])
    return run


def num_gpus(cfg: str) -> int:
    """GPUs of a config's run: N for `<name>-ep<N>` (one process per GPU), else 1."""
    m = re.search(r"-ep(\d+)$", cfg)
    return int(m[1]) if m else 1


def tail_median(values):
    """Median over the steps after the first 5 (warm-up), all of them for shorter runs."""
    tail = values[5:] or values
    return statistics.median(tail) if tail else None


def summarise(runs: dict, peak_tflops: float | None = None) -> dict:
    """Per config: mok vs alltoall (loss, tokens/s, TFLOP/s and MFU against peak_tflops,
    peak memory), identical repeats, the fused-main_grad and FP8 runs against mok."""
    out = {}
    for cfg, by_run in sorted(runs.items()):
        entry = {"runs": by_run}
        mok, a2a, mok2 = (by_run.get(k) for k in ("mok", "alltoall", "mok2"))

        def tput(r):
            return tail_median(r["tokens_per_s"])

        if mok and a2a and mok["loss"] and a2a["loss"]:
            n = min(len(mok["loss"]), len(a2a["loss"]))
            entry["steps"] = n
            entry["max_abs_loss_diff_vs_alltoall"] = max(
                abs(a - b) for a, b in zip(mok["loss"][:n], a2a["loss"][:n]))
            entry["final_loss"] = {"mok": mok["loss"][n - 1], "alltoall": a2a["loss"][n - 1]}
            entry["tokens_per_s"] = {"mok": tput(mok), "alltoall": tput(a2a)}
            if entry["tokens_per_s"]["alltoall"]:
                entry["speedup"] = entry["tokens_per_s"]["mok"] / entry["tokens_per_s"]["alltoall"]
            gpus = num_gpus(cfg)
            entry["gpus"] = gpus
            entry["tokens_per_s_per_gpu"] = {k: (v / gpus if v else v)
                                             for k, v in entry["tokens_per_s"].items()}
            if mok.get("tflops_per_gpu") and a2a.get("tflops_per_gpu"):
                entry["tflops_per_gpu"] = {k: tail_median(r["tflops_per_gpu"])
                                           for k, r in (("mok", mok), ("alltoall", a2a))}
                if peak_tflops:
                    entry["mfu"] = {k: v / peak_tflops for k, v in entry["tflops_per_gpu"].items()}
            if "peak_mem_gib" in mok and "peak_mem_gib" in a2a:
                entry["peak_mem_gib"] = {"mok": mok["peak_mem_gib"],
                                         "alltoall": a2a["peak_mem_gib"]}
        if mok and mok2 and mok["loss"]:
            entry["mok_runs_identical"] = mok["loss"] == mok2["loss"]
        fused = by_run.get("mokfused")
        if mok and fused and mok["loss"] and fused["loss"]:
            n = min(len(mok["loss"]), len(fused["loss"]))
            # fp32 gradient sums instead of bf16 gradients: close, not identical.
            entry["max_abs_loss_diff_fused_vs_mok"] = max(
                abs(a - b) for a, b in zip(mok["loss"][:n], fused["loss"][:n]))
            entry["tokens_per_s_fused"] = tput(fused)
        fp8, fp82 = by_run.get("mokfp8"), by_run.get("mokfp82")
        if mok and fp8 and mok["loss"] and fp8["loss"]:
            n = min(len(mok["loss"]), len(fp8["loss"]))
            # The bar: the FP8 run's final loss within 1 % of the BF16 run's (the
            # mean of the last 10 steps as well: one step's loss is noisy).
            tail = min(10, n)
            bf16_tail = statistics.mean(mok["loss"][n - tail:n])
            fp8_tail = statistics.mean(fp8["loss"][n - tail:n])
            entry["fp8"] = {
                "steps": n, "final_loss": {"bf16": mok["loss"][n - 1], "fp8": fp8["loss"][n - 1]},
                "final_loss_rel_diff": fp8["loss"][n - 1] / mok["loss"][n - 1] - 1.0,
                "last10_mean_rel_diff": fp8_tail / bf16_tail - 1.0,
                "tokens_per_s": {"bf16": tput(mok), "fp8": tput(fp8)},
            }
            if fp82 and fp82["loss"]:
                # over the steps both runs logged (a run cut by its time limit logs fewer)
                same = min(len(fp8["loss"]), len(fp82["loss"]))
                entry["fp8"]["runs_identical"] = fp8["loss"][:same] == fp82["loss"][:same]
                entry["fp8"]["runs_identical_steps"] = same
            else:
                entry["fp8"]["runs_identical"] = None
            if n >= 50:  # a longer window: per-step losses on mock data are noisy
                entry["fp8"]["last50_mean_rel_diff"] = (
                    statistics.mean(fp8["loss"][n - 50:n]) / statistics.mean(mok["loss"][n - 50:n])
                    - 1.0)
        # Megatron's FP8 for the whole model (TE): mok's FP8 layer vs alltoall + TEGroupedMLP
        # in FP8, as the BF16 pair above.
        mfp8, afp8 = by_run.get("mokmfp8"), by_run.get("alltoallfp8")
        if mfp8 and afp8 and mfp8["loss"] and afp8["loss"]:
            n = min(len(mfp8["loss"]), len(afp8["loss"]))
            fp8_pair = {"steps": n,
                        "final_loss": {"mok": mfp8["loss"][n - 1], "alltoall": afp8["loss"][n - 1]},
                        "tokens_per_s": {"mok": tput(mfp8), "alltoall": tput(afp8)}}
            if fp8_pair["tokens_per_s"]["alltoall"]:
                fp8_pair["speedup"] = fp8_pair["tokens_per_s"]["mok"] / fp8_pair["tokens_per_s"]["alltoall"]
            for k, r in (("mok", mfp8), ("alltoall", afp8)):
                if "peak_mem_gib" in r:
                    fp8_pair.setdefault("peak_mem_gib", {})[k] = r["peak_mem_gib"]
            entry["megatron_fp8"] = fp8_pair
        out[cfg] = entry
    return out


def gpu_tag() -> str:
    """'h100', 'h200', ... of the machine the logs came from (MOK_GPU_NAME, else the
    visible GPU), 'gpu' when neither says."""
    name = os.environ.get("MOK_GPU_NAME")
    if not name:
        try:
            import torch
            name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        except Exception:  # noqa: BLE001 - a report must not fail for a name
            name = None
    if not name:
        return "gpu"
    from benchmarks.layer import gpu_short_name
    return gpu_short_name(name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's measured dense BF16 peak: MFU = model TFLOP/s / this")
    args = p.parse_args(argv)
    runs: dict = {}
    for log in args.logs:
        m = re.match(r"train_(.+)_(mokfp82|mokfp8|mokmfp8|alltoallfp8|mok2|mokfused|mok|"
                     r"alltoall)\.log$",
                     os.path.basename(log))
        if m:
            runs.setdefault(m[1], {})[m[2]] = parse(Path(log))
    summary = summarise(runs, args.peak_tflops)
    for cfg, e in summary.items():
        print(cfg, {k: v for k, v in e.items() if k != "runs"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = {num_gpus(cfg) for cfg in summary} or {1}
    ep = gpus.pop() if len(gpus) == 1 else 1
    path = out / f"{datetime.date.today().isoformat()}-{gpu_tag()}-train-ep{ep}.json"
    from benchmarks.provenance import source_state
    commit, dirty, _ = source_state()
    path.write_text(json.dumps({"benchmark": "train-ep1",
                                "source_commit": os.environ.get("MOK_SOURCE_COMMIT") or commit,
                                "git_dirty": dirty, "peak_tflops": args.peak_tflops,
                                "impl": os.environ.get("IMPL", "local"),
                                "configs": summary}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
