"""Forward megakernel benchmark: the routed expert pass (pull -> fc1 + SwiGLU -> fc2 ->
push) as one megakernel launch vs the v1 launch chain on the same grouped-GEMM core
(pull, fc1, fc2, push) and vs the `torch._grouped_mm` chain, on the ep8-proxy shapes. The
megakernel runs in direct mode (no comm CTAs: fc1 gathers, fc2 scatters; its slots are
checked bit-equal to the chain's) and with comm CTAs (swept; y rows checked).

    python -m benchmarks.megakernel [--shapes a,b] [--tokens 8192] [--routing balanced]
        [--comm-sms 2,4,8,16,24] [--minibatch 1024,4096] [--gather lines,tma]
        [--mover-warps 1,4] [--iters 20] [--out DIR]

Same tiles in both core paths, so the difference is launch gaps, tails and the overlap
of the copies with the GEMMs. Every (comm SMs, minibatch, mover warps) point of the sweep
is timed;
the megakernel's output rows are checked bit-equal to the launch chain's. Times are
CUDA-event medians with an L2 flush before each iteration; FLOPs count routed rows only
(no shared expert); the dense BF16 peak is measured in the same run.
Results: <out>/<date>-<gpu>-megakernel-fwd.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.layer import REPO, Timer, measure_dense_peak, run_metadata
from megatron_mok import functional as mok
from megatron_mok.kernels import launch_chain, megakernel
from megatron_mok.config import MoKConfig
from megatron_mok import knobs


def make_case(local: S.LocalShape, num_tokens: int, routing: str, device):
    config = MoKConfig(backend="kernel")
    gen = torch.Generator(device=device).manual_seed(0)
    H, I, E = local.hidden, local.inter, local.num_local_experts
    x = (torch.randn(num_tokens, H, generator=gen, device=device)).bfloat16()
    w1 = (torch.randn(E, 2 * I, H, generator=gen, device=device) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen, device=device) * I ** -0.5).bfloat16()
    idx, _ = S.make_routing(routing, num_tokens, E, local.topk, seed=0, device=device)
    ws = mok.get_workspace(config, None, device=device, num_local_tokens=num_tokens,
                           hidden_size=H, topk=local.topk, num_local_experts=E)
    sched = mok.build_schedule(ws, config, idx.int())
    ws.arena.view("x").copy_(x)  # the launch chain pulls from the arena
    return ws, sched, x, w1, w2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(S.SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--comm-sms", default="2,4,8,16,24", help="comm-CTA sweep ('' to skip)")
    ap.add_argument("--minibatch", default="1024,4096")
    ap.add_argument("--gather", default="tma,lines",
                    help="direct-mode gathers to time (MOK_MEGAKERNEL_GATHER; "
                         "'+inplace': no slots)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mover-warps", default="1",
                    help="row movers per comm CTA to time (MOK_MOVER_WARPS: 1, 2, 4, 8)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--spread", type=int, default=1, help="time spread mode (1) or not (0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    timer = Timer(device)
    peak = measure_dense_peak(device)
    meta = run_metadata(device, args)
    records = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{meta['date']}-{meta['gpu_short']}-megakernel-fwd.json"
    print(f"peak {peak:.0f} TFLOP/s")
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        ws, sched, x, w1, w2 = make_case(local, args.tokens, args.routing, device)
        flops = S.forward_flops(args.tokens, local.hidden, local.inter, local.topk)
        floor = S.gemm_floor_ms(flops, peak)
        rows = int(sched.num_rows.item())

        def chain(core):
            knobs.set_env("MOK_GEMM_CORE", core)
            try:
                return launch_chain.expert_launches(ws, sched, w1, w2, local.hidden, False)
            finally:
                knobs.set_env("MOK_GEMM_CORE", None)

        def record(path_name, ms, **extra):
            rec = {"shape": name, "tokens": args.tokens, "routing": args.routing,
                   "path": path_name, "ms": ms, "floor_ms": floor,
                   "tflops": flops / (ms * 1e-3) / 1e12, "of_peak": floor / ms, **extra}
            records.append(rec)
            print(f"{name:14s} {path_name:22s} {ms:8.3f} ms  {rec['tflops']:6.0f} TFLOP/s  "
                  f"{rec['of_peak']:.3f} of peak  {extra or ''}")
            return rec

        base = {}
        for core in ("mok", "torch"):
            times = timer.measure(lambda: None, lambda _: chain(core), args.warmup, args.iters)
            base[core] = record(f"launches-{core}", statistics.median(times))
        ref_y = chain("mok")[3][:rows]
        ref_slots = ws.arena.view("slots").clone()
        best = None
        for mb in [int(v) for v in args.minibatch.split(",")]:
            for gather in args.gather.split(","):  # env read per launch
                # "lines+inplace": no scatter into the slots (y rows only, for
                # ops.combine_rows).
                mode, _, option = gather.partition("+")
                knobs.set_env("MOK_MEGAKERNEL_GATHER", mode)
                scatter = option != "inplace"

                def direct(_):
                    return megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False,
                                                  num_comm_sms=0, minibatch_rows=mb, direct=True,
                                                  scatter=scatter)
                ws.arena.view("slots").zero_()
                out = direct(None)
                same = bool(torch.equal(ws.arena.view("slots"), ref_slots) if scatter
                            else torch.equal(out[3][:rows], ref_y))
                times = timer.measure(lambda: None, direct, args.warmup, args.iters)
                rec = record("megakernel-direct", statistics.median(times), comm_sms=0,
                             minibatch=mb, gather=gather, bit_equal=same)
                if best is None or rec["ms"] < best["ms"]:
                    best = rec
            knobs.set_env("MOK_MEGAKERNEL_GATHER", None)
        # Spread mode (no comm CTAs; every CTA's producer warps pull), y rows in place.
        for mb in [int(v) for v in args.minibatch.split(",")] if args.spread else []:
            def spread(_):
                return megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False,
                                              num_comm_sms=0, minibatch_rows=mb,
                                              direct=False, scatter=False)
            same = bool(torch.equal(spread(None)[3][:rows], ref_y))
            times = timer.measure(lambda: None, spread, args.warmup, args.iters)
            rec = record("megakernel-spread", statistics.median(times), comm_sms=0,
                         minibatch=mb, bit_equal=same)
            if best is None or rec["ms"] < best["ms"]:
                best = rec
        comm_points = [(mb, comm, warps) for mb in [int(v) for v in args.minibatch.split(",")]
                       for comm in [int(v) for v in args.comm_sms.split(",") if v]
                       for warps in [int(v) for v in args.mover_warps.split(",")]]
        for mb, comm, warps in comm_points:
            knobs.set_env("MOK_MOVER_WARPS", str(warps))  # read again by set_env

            def fused(_):
                return megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False,
                                              num_comm_sms=comm, minibatch_rows=mb,
                                              direct=False)
            y_rows = fused(None)[3][:rows]
            same = bool(torch.equal(y_rows, ref_y))
            times = timer.measure(lambda: None, fused, args.warmup, args.iters)
            rec = record("megakernel-comm", statistics.median(times), comm_sms=comm,
                         minibatch=mb, mover_warps=warps, bit_equal=same)
            if best is None or rec["ms"] < best["ms"]:
                best = rec
        knobs.set_env("MOK_MOVER_WARPS", None)
        print(f"{name:14s} best {best['path']} {best['ms']:.3f} ms (comm {best['comm_sms']}, "
              f"minibatch {best['minibatch']}): {base['mok']['ms'] / best['ms']:.2f}x the core "
              f"launch chain, {base['torch']['ms'] / best['ms']:.2f}x the torch chain")
        mok.clear_workspace_cache()
        path.write_text(json.dumps({"meta": meta, "peak_tflops": peak, "results": records},
                                   indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
