"""Weight gradients into Megatron's fp32 main_grad, three ways (gradient-accumulation
fusion, megatron_mok/grad_accumulation.py):

    python -m benchmarks.main_grad [--shapes a,b] [--tokens 8192] [--iters 20]

  unfused   bf16 wgrad (dW2, dW1), then one main_grad[e].add_(dw[e]) per expert and
            weight: what Megatron's DDP hook does with the returned gradients
  foreach   fp32 wgrad, then one multi-tensor add (the fallback for unevenly spaced
            main_grads)
  fused     the wgrad adds into the main_grads in its epilogue (TMA reduce-add), laid out
            as Megatron's grad buffer holds a TEGroupedMLP (back to back, backwards) or a
            SequentialMLP (fc1 and fc2 interleaved, backwards)

Per shape (ep8 proxy, balanced routing) with CUDA events, L2 flushed, median. The floor
is the main_grad read-modify-write (8 bytes per weight element) next to the wgrad FLOPs at
the dense peak measured in the same run. All ways must leave the same main_grads (fp32
sums of the same products; unfused rounds the gradient to bf16 first: relative L2 only).
Results: benchmarks/results/<date>-<gpu>-main-grad.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.gemm import make_case
from benchmarks.layer import FLUSH_BYTES, REPO, Timer, measure_dense_peak, rel_l2, run_metadata
from megatron_mok.kernels import grouped_gemm as gg
from megatron_mok.grad_accumulation import ExpertGradAccumulator

HBM_TBPS = 4.8  # H200 HBM3e


def main_grads(layout: str, E: int, shape1, shape2, device):
    """fp32 main_grads of w1 and w2 as Megatron's grad buffer lays out the module."""
    n1, n2 = shape1.numel(), shape2.numel()
    flat = torch.zeros(E * (n1 + n2), device=device)
    if layout == "te":  # weight0..E-1 of fc1, then of fc2; the buffer holds them backwards
        starts2 = [(E - 1 - e) * n2 for e in range(E)]
        starts1 = [E * n2 + (E - 1 - e) * n1 for e in range(E)]
    else:  # sequential: fc1, fc2 of expert 0, then of expert 1, ...; backwards
        starts2 = [(E - 1 - e) * (n1 + n2) for e in range(E)]
        starts1 = [s + n2 for s in starts2]
    fc1 = [flat[s:s + n1].view(shape1) for s in starts1]
    fc2 = [flat[s:s + n2].view(shape2) for s in starts2]
    return flat, ExpertGradAccumulator(fc1), ExpertGradAccumulator(fc2)


def ways(case, acc1, acc2):
    s = case["sched"]
    offsets = s.expert_offsets
    d_out, act, d_h, x = case["d_out"], case["act"], case["d_h"], case["x"]

    def unfused():
        for a, b, acc in ((d_out, act, acc2), (d_h, x, acc1)):
            dw = gg.wgrad(a, b, offsets)
            for buf, g in zip(acc.buffers, dw.unbind(0)):
                buf.add_(g)

    def foreach():
        for a, b, acc in ((d_out, act, acc2), (d_h, x, acc1)):
            acc.add_(gg.wgrad(a, b, offsets, out_dtype=torch.float32))

    def fused():
        for a, b, acc in ((d_out, act, acc2), (d_h, x, acc1)):
            planes, reverse = acc.fused_target
            gg.wgrad(a, b, offsets, accumulate_into=planes, reverse_experts=reverse)

    return {"unfused": unfused, "foreach": foreach, "fused": fused}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layouts", default="te,sequential")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device, args)
    meta["peak_tflops"] = peak = measure_dense_peak(device)
    meta["benchmark"] = "main-grad"
    timer = Timer(device, FLUSH_BYTES)
    records = []
    print(f"dense BF16 peak {peak:.0f} TFLOP/s")
    print(f"{'shape':14} {'layout':10} {'way':8} {'ms':>8} {'floor ms':>9} {'rel L2':>8}")
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        case = make_case(local, args.tokens, "balanced", device)
        E, H, I = local.num_local_experts, local.hidden, local.inter
        gen = torch.Generator(device=device).manual_seed(1)
        rows = case["x"].shape[0]
        real = (case["sched"].peer_rank >= 0).unsqueeze(1)
        case["act"] = (torch.randn(rows, I, generator=gen, device=device) * real).bfloat16()
        case["d_h"] = (torch.randn(rows, 2 * I, generator=gen, device=device) * real).bfloat16()
        weights = E * 3 * I * H  # elements of w1 and w2
        flops = 2 * case["routes"] * 3 * I * H  # dW1 and dW2: each route meets one expert
        floor_ms = max(flops / peak / 1e9, weights * 8 / HBM_TBPS / 1e9)
        for layout in args.layouts.split(","):
            flat, acc1, acc2 = main_grads(layout, E, torch.Size((2 * I, H)),
                                          torch.Size((H, I)), device)
            assert acc1.fused_target is not None and acc2.fused_target is not None
            fns = ways(case, acc1, acc2)
            ends = {}
            for way, fn in fns.items():  # one pass each from zeros: the sums to compare
                flat.zero_()
                fn()
                ends[way] = flat.clone()
            for way, fn in fns.items():
                ms = statistics.median(timer.measure(lambda: None, lambda _: fn(),
                                                     args.warmup, args.iters))
                err = rel_l2(ends[way], ends["fused"])
                rec = dict(shape=name, T=args.tokens, layout=layout, way=way, ms=ms,
                           floor_ms=floor_ms, weight_elements=weights, flops=flops,
                           E_loc=E, H=H, I=I, K=local.topk, rel_l2_vs_fused=err,
                           bitwise_vs_fused=bool(torch.equal(ends[way], ends["fused"])))
                records.append(rec)
                print(f"{name:14} {layout:10} {way:8} {ms:8.3f} {floor_ms:9.3f} {err:8.1e}",
                      flush=True)
            del flat, acc1, acc2, fns, ends
            torch.cuda.empty_cache()
        del case
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date']}-{meta['gpu_short']}-main-grad.json"
    path.write_text(json.dumps({"benchmark": "main-grad", "meta": meta, "records": records},
                               indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
