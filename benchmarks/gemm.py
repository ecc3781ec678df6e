"""Grouped-GEMM core benchmark: our Hopper kernels (megatron_mok.kernels.grouped_gemm) vs the
`torch._grouped_mm` path that GPU backend v1 used, side by side on the same row table.

    python -m benchmarks.gemm [--shapes a,b] [--tokens 8192] [--routing balanced]
        [--warmup 10] [--iters 30] [--out benchmarks/results]

Per shape (ep8 proxy, see benchmarks/shapes.py) the routed rows are laid out as the MoE
schedule does (experts in order, each padded to 128 rows; padding rows zero), and each
stage is timed with CUDA events, L2 flushed before every iteration, median:

  fwd    mok: fc1+SwiGLU (epilogue), fc2        torch: grouped_mm fc1, SwiGLU, grouped_mm fc2
  dgrad  mok: fc2 dgrad+SwiGLU bwd, fc1 dgrad   torch: grouped_mm, SwiGLU bwd, grouped_mm
  wgrad  mok: dW2, dW1 (tokens as K)            torch: grouped_mm 2d-2d on transposed views

FLOPs count the useful rows only (padding excluded). The dense BF16 peak (8192^3 torch.mm)
is measured in the same run. Outputs of the two paths are compared (relative L2).
With --ops every GEMM is also timed alone (ours, `torch._grouped_mm` without the SwiGLU
kernels, and one dense cuBLAS GEMM of the same total size as a ceiling for the shape).
Results: benchmarks/results/<date>-<gpu>-gemm-core.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.layer import (FLUSH_BYTES, REPO, Timer, measure_dense_peak, rel_l2,
                              run_metadata)
from megatron_mok import activations, knobs
from megatron_mok.kernels import grouped_gemm as gg
from megatron_mok.schedule import build_row_table


def swiglu(h):  # the torch baseline's SwiGLU, rounded to h's dtype as the core's epilogue does
    return activations.swiglu(h).to(h.dtype)


def swiglu_bwd(h, d_act):
    return activations.swiglu_backward(h, d_act).to(h.dtype)


STAGES = ("fwd", "dgrad", "wgrad")


def row_table(local: S.LocalShape, num_tokens: int, routing: str, device):
    idx, _ = S.make_routing(routing, num_tokens, local.num_local_experts, local.topk, seed=0,
                            device=device)
    routes = num_tokens * local.topk
    capacity = -(-(routes + local.num_local_experts * 127) // 128) * 128
    sched = build_row_table(idx.unsqueeze(0).int(), 0, local.num_local_experts, capacity,
                            local.num_local_experts)
    return sched, capacity, routes


def make_case(local: S.LocalShape, num_tokens: int, routing: str, device):
    sched, capacity, routes = row_table(local, num_tokens, routing, device)
    H, I, E = local.hidden, local.inter, local.num_local_experts
    real = (sched.peer_rank >= 0).unsqueeze(1)
    gen = torch.Generator(device=device).manual_seed(0)

    def rows(cols):
        return (torch.randn(capacity, cols, generator=gen, device=device) * real).bfloat16()

    def weight(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5).bfloat16()

    return dict(sched=sched, routes=routes, x=rows(H), d_out=rows(H), w1=weight(E, 2 * I, H),
                w2=weight(E, H, I))


def stage_fns(c):
    s = c["sched"]
    offs, offsets, num_rows = s.expert_offsets[1:], s.expert_offsets, s.num_rows
    x, d_out, w1, w2 = c["x"], c["d_out"], c["w1"], c["w2"]
    act_m, h_m = gg.fc1_swiglu(x, w1, offsets, num_rows)
    h_t = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
    act_t = swiglu(h_t)
    d_h_t = swiglu_bwd(h_t, torch._grouped_mm(d_out, w2, offs=offs))
    return {
        "fwd": {
            "mok": lambda: gg.rows_matmul(gg.fc1_swiglu(x, w1, offsets, num_rows, save_h=False)[0],
                                          w2, offsets, num_rows),
            "torch": lambda: torch._grouped_mm(
                swiglu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)), w2.transpose(1, 2),
                offs=offs),
        },
        "dgrad": {
            "mok": lambda: gg.rows_matmul(gg.dgrad_swiglu(d_out, w2, h_m, offsets, num_rows), w1,
                                          offsets, num_rows, w_transposed=True),
            "torch": lambda: torch._grouped_mm(
                swiglu_bwd(h_t, torch._grouped_mm(d_out, w2, offs=offs)), w1, offs=offs),
        },
        "wgrad": {
            "mok": lambda: (gg.wgrad(d_out, act_m, offsets), gg.wgrad(d_h_t, x, offsets)),
            "torch": lambda: (torch._grouped_mm(d_out.t(), act_t, offs=offs),
                              torch._grouped_mm(d_h_t.t(), x, offs=offs)),
        },
    }


def op_fns(c):
    """op -> (GEMM dims (M, N, K) with M = useful rows or the weight's rows, ours, torch's
    grouped_mm alone, one dense torch.mm of the same total size over all rows)."""
    s = c["sched"]
    offs, offsets, num_rows = s.expert_offsets[1:], s.expert_offsets, s.num_rows
    x, d_out, w1, w2 = c["x"], c["d_out"], c["w1"], c["w2"]
    act, h = gg.fc1_swiglu(x, w1, offsets, num_rows)
    d_h = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows)
    R, E = c["routes"], w1.shape[0]
    H, I = x.shape[1], act.shape[1]
    w1_all, w2_all = w1.reshape(E * 2 * I, H)[:2 * I], w2.reshape(E * H, I)[:H]
    return {
        "fc1_swiglu": ((R, 2 * I, H), lambda: gg.fc1_swiglu(x, w1, offsets, num_rows, save_h=False),
                       lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                       lambda: torch.mm(x, w1_all.t())),
        "fc2": ((R, H, I), lambda: gg.rows_matmul(act, w2, offsets, num_rows),
                lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=offs),
                lambda: torch.mm(act, w2_all.t())),
        "dgrad_fc2_swiglu": ((R, I, H), lambda: gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows),
                             lambda: torch._grouped_mm(d_out, w2, offs=offs),
                             lambda: torch.mm(d_out, w2_all)),
        "dgrad_fc1": ((R, H, 2 * I),
                      lambda: gg.rows_matmul(d_h, w1, offsets, num_rows, w_transposed=True),
                      lambda: torch._grouped_mm(d_h, w1, offs=offs),
                      lambda: torch.mm(d_h, w1_all)),
        "wgrad_fc2": ((H, I, R), lambda: gg.wgrad(d_out, act, offsets),
                      lambda: torch._grouped_mm(d_out.t(), act, offs=offs),
                      lambda: torch.mm(d_out.t(), act)),
        "wgrad_fc1": ((2 * I, H, R), lambda: gg.wgrad(d_h, x, offsets),
                      lambda: torch._grouped_mm(d_h.t(), x, offs=offs),
                      lambda: torch.mm(d_h.t(), x)),
    }


def time_ops(case, name, args, timer, peak, records) -> None:
    rows_all = case["x"].shape[0]  # the dense GEMM runs over every row, padding included
    for op, (dims, *fns) in op_fns(case).items():
        flops = 2.0 * dims[0] * dims[1] * dims[2]
        dense_flops = flops * rows_all / case["routes"]
        ms = [statistics.median(timer.measure(lambda: None, lambda _: fn(), args.warmup,
                                              args.iters)) for fn in fns]
        rec = dict(shape=name, T=args.tokens, routing=args.routing, op=op, gemm_mnk=dims,
                   flops=flops, mok_ms=ms[0], torch_ms=ms[1], dense_ms=ms[2])
        for impl, t, f in zip(("mok", "torch", "dense"), ms, (flops, flops, dense_flops)):
            rec[f"{impl}_frac_peak"] = f / t / 1e9 / peak
        records.append(rec)
        print(f"  {op:17} mok {ms[0]:7.3f} ms {rec['mok_frac_peak']:5.2f}  torch {ms[1]:7.3f} "
              f"{rec['torch_frac_peak']:5.2f}  dense {ms[2]:7.3f} {rec['dense_frac_peak']:5.2f}",
              flush=True)


def stage_flops(local: S.LocalShape, routes: int) -> float:
    """Every stage does fc1 (2I) + fc2 (I) worth of GEMM work."""
    return 2.0 * routes * local.hidden * 3 * local.inter


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="deepseek-v3,dsv4-pro,qwen3-30b-a3b,qwen3.5-like,"
                                       "gpt-oss-120b,mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="balanced")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", default=None, choices=("1", "2"),
                   help="MOK_GEMM_CLUSTER for our kernels (default: the environment's, else 1)")
    p.add_argument("--scheduler", default=None, choices=("counter", "static"),
                   help="MOK_GEMM_SCHEDULER for our kernels (default: the environment's, "
                        "else counter)")
    p.add_argument("--ops", action="store_true",
                   help="also time every GEMM alone, with torch's and a dense cuBLAS one")
    args = p.parse_args(argv)
    if args.cluster:
        knobs.set_env("MOK_GEMM_CLUSTER", args.cluster)
    if args.scheduler:
        knobs.set_env("MOK_GEMM_SCHEDULER", args.scheduler)
    device = torch.device("cuda")
    meta = run_metadata(device, args)
    meta["peak_tflops"] = peak = measure_dense_peak(device)
    meta["benchmark"] = "gemm-core"
    meta["gemm_cluster"] = os.environ.get("MOK_GEMM_CLUSTER", "1")
    meta["gemm_scheduler"] = ("static" if meta["gemm_cluster"] == "2"
                              else os.environ.get("MOK_GEMM_SCHEDULER", "counter"))
    timer = Timer(device, FLUSH_BYTES)
    records, op_records = [], []
    print(f"dense BF16 peak {peak:.0f} TFLOP/s")
    print(f"{'shape':14} {'stage':6} {'mok ms':>8} {'torch ms':>9} {'mok TF/s':>9} "
          f"{'of peak':>8} {'speedup':>8} {'rel L2':>8}")
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        case = make_case(local, args.tokens, args.routing, device)
        fns = stage_fns(case)
        for stage in STAGES:
            out_m, out_t = fns[stage]["mok"](), fns[stage]["torch"]()
            if isinstance(out_m, torch.Tensor):
                out_m, out_t = (out_m,), (out_t,)
            used = int(case["sched"].num_rows.item())  # rows past it are not computed
            err = max(rel_l2(a[:used].float() if stage != "wgrad" else a.float(),
                             b[:used].float() if stage != "wgrad" else b.float())
                      for a, b in zip(out_m, out_t))
            del out_m, out_t
            ms = {impl: statistics.median(timer.measure(lambda: None, lambda _: fn(),
                                                        args.warmup, args.iters))
                  for impl, fn in fns[stage].items()}
            flops = stage_flops(local, case["routes"])
            rec = dict(shape=name, T=args.tokens, routing=args.routing, stage=stage,
                       E_loc=local.num_local_experts, H=local.hidden, I=local.inter,
                       K=local.topk, routes=case["routes"], flops=flops,
                       mok_ms=ms["mok"], torch_ms=ms["torch"],
                       mok_tflops=flops / ms["mok"] / 1e9, torch_tflops=flops / ms["torch"] / 1e9,
                       speedup=ms["torch"] / ms["mok"], rel_l2_vs_torch=err)
            rec["mok_frac_peak"] = rec["mok_tflops"] / peak
            rec["torch_frac_peak"] = rec["torch_tflops"] / peak
            records.append(rec)
            print(f"{name:14} {stage:6} {ms['mok']:8.3f} {ms['torch']:9.3f} "
                  f"{rec['mok_tflops']:9.0f} {rec['mok_frac_peak']:8.2f} "
                  f"{rec['speedup']:7.2f}x {err:8.1e}", flush=True)
        if args.ops:
            time_ops(case, name, args, timer, peak, op_records)
        del case, fns
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if meta["gemm_cluster"] == "1" else f"-cluster{meta['gemm_cluster']}"
    if meta["gemm_cluster"] == "1" and meta["gemm_scheduler"] == "static":
        suffix += "-static"
    path = out / f"{meta['date']}-{meta['gpu_short']}-gemm-core{suffix}.json"
    result = {"benchmark": "gemm-core", "meta": meta, "records": records}
    if args.ops:
        result["op_records"] = op_records
    path.write_text(json.dumps(result, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
