"""Fill the autotune cache (megatron_mok.kernels.autotune) for the ep8-proxy shapes on this GPU:
time every forward plan (launch chain, direct megakernel x minibatch, comm megakernel x
comm SMs x minibatch) and store the fastest per (GPU, shape, the shape's expert variant:
GPT-OSS's GLU and biases are timed in their own epilogues); with --backward also every
backward dgrad plan (launch chain, backward megakernel x minibatch).

    python -m benchmarks.autotune [--shapes a,b] [--tokens 4096,8192] [--iters 5]
        [--backward] [--out DIR]

The cache goes to $MOK_AUTOTUNE_CACHE (default ~/.cache/megatron_mok/autotune.json); the
timings also to <out>/<date>-<gpu>-autotune.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import shapes as S
from benchmarks.layer import REPO, run_metadata
from benchmarks.megakernel import make_case
from megatron_mok.config import MoKConfig
from megatron_mok.kernels import autotune, tuning
from megatron_mok.functional import clear_workspace_cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(S.SHAPES))
    ap.add_argument("--tokens", default="4096,8192", help="T values, comma-separated")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backward", action="store_true", help="also tune the backward")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    meta = run_metadata(device, args)
    results = {}
    for name in args.shapes.split(","):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            local = S.ep8_proxy(S.get_shape(name))
            if S.fc1_rows_per_inter(local.activation) == 1:
                print(f"{name:14s} non-gated experts run the launch chain only: nothing to tune")
                continue
            ws, sched, x, w1, w2 = make_case(local, tokens, args.routing, device)
            # The shape's own epilogues (GPT-OSS's clamped GLU, its biases): their plans are
            # cached under that variant's key, which the layer with them looks up.
            config = MoKConfig(backend="kernel", activation=S.activation_of(local.activation),
                               expert_bias=local.expert_bias)
            biases = {}
            if local.expert_bias:
                gen = torch.Generator(device=device).manual_seed(args.seed + 2)
                for key_, w in (("b1", w1), ("b2", w2)):
                    noise = torch.randn(*w.shape[:2], generator=gen, device=device)
                    biases[key_] = (noise * 0.02).bfloat16()
            best, timings = tuning.tune(ws, sched, x, w1, w2, warmup=args.warmup,
                                        iters=args.iters, config=config, **biases)
            key = autotune.workspace_key(ws, local.inter, config)
            results[key] = {"best": best.__dict__, "timings_ms": timings}
            fastest = min(timings.values())
            print(f"{name:14s} T={tokens:5d} best {autotune.plan_name(best):32s} {fastest:8.3f} ms "
                  f"(launches {timings['launches']:.3f} ms)")
            if args.backward:
                gen = torch.Generator(device=device).manual_seed(args.seed + 1)
                topk_w = torch.rand(tokens, local.topk, generator=gen, device=device)
                dy = torch.randn(tokens, local.hidden, generator=gen, device=device).bfloat16()
                best_b, timings_b = tuning.tune_backward(ws, sched, x, topk_w, w1, w2, dy,
                                                         warmup=args.warmup, iters=args.iters,
                                                         config=config, **biases)
                results[autotune.backward_key(ws, local.inter, config)] = {
                    "best": best_b.__dict__, "timings_ms": timings_b}
                print(f"{'':14s} {'bwd':7s} best {autotune.backward_plan_name(best_b):32s} "
                      f"{min(timings_b.values()):8.3f} ms (launches "
                      f"{timings_b['launches']:.3f} ms)")
            clear_workspace_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['date']}-{meta['gpu_short']}-autotune.json"
    path.write_text(json.dumps({"meta": meta, "cache": str(autotune.cache_file()),
                                "results": results}, indent=1))
    print(f"cache {autotune.cache_file()}; timings {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
