"""Blockwise-FP8 grouped GEMMs (megatron_mok.kernels.fp8_gemm) against the BF16 core, side by
side on the same row table, with the dense FP8 and BF16 peaks measured in the same run.

    python -m benchmarks.fp8_gemm [--shapes a,b] [--tokens 8192] [--routing balanced]
        [--warmup 10] [--iters 30] [--out benchmarks/results]

Per shape (ep8 proxy, benchmarks/shapes.py; H and I multiples of 128), timed with CUDA
events, L2 flushed before every iteration, median:

  bf16 fwd     fc1 + SwiGLU, fc2 on the BF16 core
  fp8 fwd      quantise x rows, FP8 fc1 + SwiGLU, quantise act, FP8 fc2 (the chain)
  fp8 fc1, fp8 fc2, quantise x, quantise act   each alone
  fp8 dgrad (fc2 dgrad + SwiGLU backward) without / with d_h quantised in its epilogue,
  and the separate d_h quantiser; the EP = 1 gather + quantise of token rows (alone, and
  with the bf16 rows and router weights) against the unfused per-token quantiser +
  index_select it replaced

FLOPs count the useful rows only. The dense FP8 peak is `torch._scaled_mm` on 8192^3 E4M3
operands with per-row / per-column fp32 scales (cuBLAS), the BF16 peak `torch.mm`. The FP8
output is compared with the BF16 one (relative L2: the quantisation's error, a few %).
Results: benchmarks/results/<date>-<gpu>-fp8-gemm-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.gemm import make_case
from benchmarks.layer import FLUSH_BYTES, PEAK_N, REPO, Timer, measure_dense_peak, rel_l2, run_metadata
from megatron_mok import knobs
from megatron_mok.kernels import fp8_gemm as f8
from megatron_mok.kernels import grouped_gemm as gg

DEFAULT_SHAPES = "qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,qwen3.5-like"


def measure_fp8_peak(device: torch.device, n: int = PEAK_N, warmup: int = 5,
                     iters: int = 20) -> float:
    """Dense E4M3 n^3 `torch._scaled_mm` TFLOP/s (row-wise scales, bf16 out), median."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, generator=gen, device=device).to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    timer = Timer(device, flush_bytes=0)
    times = timer.measure(lambda: None, lambda _: torch._scaled_mm(
        a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), warmup, iters)
    return 2.0 * n ** 3 / (statistics.median(times) * 1e-3) / 1e12


def fns_of(case, num_tokens: int):
    s = case["sched"]
    offsets, num_rows = s.expert_offsets, s.num_rows
    x, w1, w2, d_out = case["x"], case["w1"], case["w2"], case["d_out"]
    w1q, w2q = f8.quantize_weight(w1), f8.quantize_weight(w2)
    w2f = f8.quantize_weights(w2)
    xq, xs = f8.quantize_rows(x)
    act_bf, h = f8.fc1_swiglu(xq, xs, w1q.data, w1q.scale, offsets, num_rows, save_h=True)
    aq, as_ = f8.quantize_rows(act_bf)
    dq, ds = f8.quantize_rows(d_out)
    row_w = torch.rand(x.shape[0], device=x.device) * (s.peer_rank >= 0)
    d_h = f8.dgrad_swiglu_routed(dq, ds, row_w, w2f, h, offsets, num_rows)[0]
    gen = torch.Generator(device=x.device).manual_seed(1)
    x_tok = torch.randn(num_tokens, x.shape[1], generator=gen, device=x.device).bfloat16()
    topk_w = torch.rand(num_tokens, int(s.peer_k.max()) + 1, generator=gen, device=x.device)
    return {
        "bf16_fwd": lambda: gg.rows_matmul(
            gg.fc1_swiglu(x, w1, offsets, num_rows, save_h=False)[0], w2, offsets, num_rows),
        "fp8_fwd": lambda: f8.expert_forward(x, w1q, w2q, offsets, num_rows)[0],
        "fp8_fc1": lambda: f8.fc1_swiglu(xq, xs, w1q.data, w1q.scale, offsets, num_rows,
                                         save_h=False),
        # act quantised in fc1's epilogue (the forward's path) vs fc1 + the row quantiser
        "fp8_fc1_qact": lambda: f8.fc1_swiglu(xq, xs, w1q.data, w1q.scale, offsets, num_rows,
                                              save_h=True, quantize_act=True),
        "fp8_fc1_h": lambda: f8.fc1_swiglu(xq, xs, w1q.data, w1q.scale, offsets, num_rows,
                                           save_h=True),
        "fp8_fc2": lambda: f8.rows_matmul(aq, as_, w2q.data, w2q.scale, offsets, num_rows),
        "quant_x": lambda: f8.quantize_rows(x),
        "quant_act": lambda: f8.quantize_rows(act_bf),
        # both weights, both layouts, on the device (once per pass, or once per step)
        "quant_w": lambda: (f8.quantize_weights(w1), f8.quantize_weights(w2)),
        # the fc2 dgrad + SwiGLU backward alone, with d_h quantised in its epilogue, and
        # the separate quantiser that epilogue replaces
        "fp8_dgrad": lambda: f8.dgrad_swiglu_routed(dq, ds, row_w, w2f, h, offsets, num_rows),
        "fp8_dgrad_qdh": lambda: f8.dgrad_swiglu_routed(dq, ds, row_w, w2f, h, offsets,
                                                        num_rows, quantize_dh=True),
        "quant_dh": lambda: f8.quantize_rows(d_h),
        # x rows from the tokens at EP = 1, alone (forward) and with the bf16 rows and router
        # weights (backward's dy): in one pass, and in separate passes (the default)
        "gather_quant": lambda: f8.gather_quantize_rows_fused(x_tok, s, None, False),
        "gather_quant_rows_w": lambda: f8.gather_quantize_rows_fused(x_tok, s, topk_w, True),
        "gather_quant_unfused": lambda: f8.quantize_then_gather_rows(x_tok, s, None, False),
        "gather_quant_rows_w_unfused": lambda: f8.quantize_then_gather_rows(x_tok, s, topk_w,
                                                                            True),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--routing", default="balanced")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", default=None, choices=("1", "2"),
                   help="MOK_GEMM_CLUSTER for both cores (2: B multicast across CTA pairs)")
    p.add_argument("--promotion", default=None, choices=("serial", "overlap"),
                   help="MOK_FP8_PROMOTION (overlap: promote K tile k - 1 during tile k)")
    args = p.parse_args(argv)
    if args.cluster:
        knobs.set_env("MOK_GEMM_CLUSTER", args.cluster)
    if args.promotion:
        knobs.set_env("MOK_FP8_PROMOTION", args.promotion)
    device = torch.device("cuda")
    meta = run_metadata(device, args)
    meta["benchmark"] = "fp8-gemm"
    meta["gemm_cluster"] = os.environ.get("MOK_GEMM_CLUSTER", "1")
    meta["fp8_promotion"] = os.environ.get("MOK_FP8_PROMOTION", "serial")
    meta["peak_tflops"] = peak = measure_dense_peak(device)
    meta["fp8_peak_tflops"] = fp8_peak = measure_fp8_peak(device)
    timer = Timer(device, FLUSH_BYTES)
    print(f"dense peaks: BF16 {peak:.0f}, FP8 {fp8_peak:.0f} TFLOP/s")
    records = []
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        case = make_case(local, args.tokens, args.routing, device)
        fns = fns_of(case, args.tokens)
        used = int(case["sched"].num_rows.item())
        err = rel_l2(fns["fp8_fwd"]()[:used].float(), fns["bf16_fwd"]()[:used].float())
        R, H, I = case["routes"], local.hidden, local.inter
        flops = {"bf16_fwd": 6.0 * R * H * I, "fp8_fwd": 6.0 * R * H * I,
                 "fp8_fc1": 4.0 * R * H * I, "fp8_fc1_qact": 4.0 * R * H * I,
                 "fp8_fc1_h": 4.0 * R * H * I, "fp8_fc2": 2.0 * R * H * I,
                 "fp8_dgrad": 2.0 * R * H * I, "fp8_dgrad_qdh": 2.0 * R * H * I}
        rec = dict(shape=name, T=args.tokens, routing=args.routing, E_loc=local.num_local_experts,
                   H=H, I=I, K=local.topk, routes=R, rel_l2_fp8_vs_bf16=err)
        line = [f"{name:14}"]
        for op, fn in fns.items():
            ms = statistics.median(timer.measure(lambda: None, lambda _: fn(), args.warmup,
                                                 args.iters))
            rec[f"{op}_ms"] = ms
            if op in flops:
                ref_peak = peak if op.startswith("bf16") else fp8_peak
                rec[f"{op}_frac_peak"] = flops[op] / ms / 1e9 / ref_peak
                line.append(f"{op} {ms:.3f} ms ({rec[f'{op}_frac_peak']:.2f})")
            else:
                line.append(f"{op} {ms:.3f} ms")
        rec["fp8_fwd_speedup"] = rec["bf16_fwd_ms"] / rec["fp8_fwd_ms"]
        line.append(f"fp8/bf16 {rec['fp8_fwd_speedup']:.2f}x rel L2 {err:.1e}")
        print("  ".join(line), flush=True)
        records.append(rec)
        del case, fns
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("" if meta["gemm_cluster"] == "1" else "-cluster2") + \
        ("" if meta["fp8_promotion"] == "serial" else "-overlap")
    path = out / (f"{meta['date']}-{meta['gpu_short']}-fp8-gemm-"
                  f"{str(meta.get('git_commit'))[:7]}{suffix}.json")
    path.write_text(json.dumps({"benchmark": "fp8-gemm", "meta": meta, "records": records},
                               indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
