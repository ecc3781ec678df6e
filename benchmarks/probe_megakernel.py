"""Where the forward megakernel's compute CTAs spend their cycles, per mode.

    python -m benchmarks.probe_megakernel [--shapes deepseek-v3,qwen3-30b-a3b]
        [--modes direct:lines,direct:tma,comm:8,comm:8w4] [--minibatch 2048] [--tokens 8192]
        [--out DIR]

For each shape and mode, one launch with the in-kernel cycle probes on
(megakernel.new_probe / probe_summary): per fc1 and fc2 task, the mainloop cycles per K
step (against the 1 024 cycles a 128 x 256 x 64 BF16 step takes at the SM's dense peak)
and the epilogue cycles per task, plus the consumers' waits for task ids and the
producers' dependency waits, as shares of the consumer's cycles. Direct mode and comm
mode run the same tiles, so the phase that differs is what direct mode loses to
(docs/perf-notes.md, megakernel fwd v9). Writes <date>-<gpu>-megakernel-probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.layer import REPO, run_metadata
from benchmarks.megakernel import make_case
from megatron_mok.kernels import megakernel
from megatron_mok import knobs

# One 128 x 256 x 64 K step of a CTA tile at Hopper's dense BF16 rate (4 096 FLOP/clk/SM).
IDEAL_CYCLES_PER_K_STEP = 128 * 256 * 64 * 2 / 4096


def parse_mode(text: str) -> tuple[str, str]:
    kind, _, arg = text.partition(":")
    if kind not in ("direct", "comm") or not arg:
        raise argparse.ArgumentTypeError(
            f"mode {text!r}: want direct:<gather> or comm:<SMs>[w<mover warps>]")
    return kind, arg


def probe_once(ws, sched, x, w1, w2, mode: tuple[str, str], minibatch: int) -> dict:
    kind, arg = mode
    comm = 0
    if kind == "direct":
        knobs.set_env("MOK_MEGAKERNEL_GATHER", arg)
    else:  # "8" or "8w4": 8 comm SMs with 4 row-mover warps each
        comm_text, _, warps = arg.partition("w")
        comm = int(comm_text)
        knobs.set_env("MOK_MOVER_WARPS", warps or "1")

    def run(probe=None):
        megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False, num_comm_sms=comm,
                               minibatch_rows=minibatch, direct=kind == "direct", probe=probe)

    try:
        for _ in range(2):
            run()
        probe = megakernel.new_probe(x.device)
        run(probe)
        torch.cuda.synchronize()
    finally:
        knobs.set_env("MOK_MEGAKERNEL_GATHER", None)
        knobs.set_env("MOK_MOVER_WARPS", None)
    return megakernel.probe_summary(probe)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--modes", default="direct:lines,direct:tma,comm:8,comm:8w4")
    ap.add_argument("--minibatch", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--routing", default="balanced", choices=S.ROUTINGS)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.warmup, args.iters, args.seed = 1, 1, 0  # recorded by run_metadata; one probed run per mode
    modes = [parse_mode(m) for m in args.modes.split(",")]
    device = torch.device("cuda")
    meta = run_metadata(device, args)
    records = []
    print(f"{'shape':14s} {'mode':12s} {'fc1 cyc/K':>9s} {'eff':>5s} {'fc1 epi':>8s} "
          f"{'fc2 cyc/K':>9s} {'eff':>5s} {'fc2 epi':>8s} {'queue':>6s} {'dep':>6s}")
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        ws, sched, x, w1, w2 = make_case(local, args.tokens, args.routing, device)
        for mode in modes:
            summary = probe_once(ws, sched, x, w1, w2, mode, args.minibatch)
            consumer = max(summary["consumer_cycles"], 1)
            rec = {"shape": name, "tokens": args.tokens, "routing": args.routing,
                   "mode": ":".join(mode), "minibatch": args.minibatch, **summary,
                   "queue_wait_share": summary["queue_wait_cycles"] / consumer,
                   "dependency_wait_share": summary["dependency_wait_cycles"] / consumer}
            for kind in ("fc1", "fc2"):
                per_k = summary[kind]["cycles_per_k_step"]
                rec[kind]["mainloop_efficiency"] = IDEAL_CYCLES_PER_K_STEP / per_k if per_k else 0.0
            records.append(rec)
            print(f"{name:14s} {rec['mode']:12s} "
                  f"{rec['fc1']['cycles_per_k_step']:9.0f} "
                  f"{rec['fc1']['mainloop_efficiency']:5.2f} "
                  f"{rec['fc1']['epilogue_cycles_per_task']:8.0f} "
                  f"{rec['fc2']['cycles_per_k_step']:9.0f} "
                  f"{rec['fc2']['mainloop_efficiency']:5.2f} "
                  f"{rec['fc2']['epilogue_cycles_per_task']:8.0f} "
                  f"{rec['queue_wait_share']:6.3f} {rec['dependency_wait_share']:6.3f}")
        del ws, sched, x, w1, w2
        torch.cuda.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{meta['date']}-{meta['gpu_short']}-megakernel-probe.json"
    path.write_text(json.dumps({"meta": meta, "ideal_cycles_per_k_step": IDEAL_CYCLES_PER_K_STEP,
                                "results": records}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
