"""Where the `mok` layer's time goes at EP = 1: GPU kernel time per category, per pass.

    python -m benchmarks.breakdown [--shapes a,b] [--tokens 8192] [--iters 5] [--out DIR]

For each shape (ep8-proxy, balanced routing) the layer's forward (autograd on) and its
backward (each after an unprofiled forward) run `iters` times under torch.profiler; every
CUDA kernel is put in a category (expert GEMMs of the core, the megakernels, row moves,
combines, the shared expert's torch GEMMs, the schedule and other small ops) and its
time summed per pass. The pass's wall time (CUDA events, the same iterations) minus the
summed kernel time is the GPU left idle between launches. A second, unprofiled loop
times the pass and the CPU time to issue it (host_ms): a pass whose host time reaches
its GPU time is host-bound. The non-GEMM share is the most that fusing a pass into one
launch can win at EP = 1 (docs/megakernel.md, "Plan for the backward megakernel":
measure first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import layer as L
from benchmarks import shapes as S

REPO = Path(__file__).resolve().parents[1]

# (category, substrings of the kernel name), first match wins; "other" catches the rest.
CATEGORIES = (
    ("megakernel", ("moe_forward_kernel", "moe_backward_kernel", "megakernel")),
    ("expert gemm (core)", ("grouped_gemm_kernel",)),
    ("fp8 gemm (core)", ("grouped_fp8_kernel",)),
    ("fp8 quantise", ("quantize_fp8", "quantise_fp8", "fp8_rows", "fp8_blocks")),
    ("row moves", ("pull_rows", "push_rows", "gather_from_peers")),
    ("combine", ("combine",)),
    ("ep barrier", ("ep_barrier",)),
    ("torch gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("schedule / index", ("index", "scatter", "sort", "cumsum", "histc", "bincount",
                          "radix", "arange", "nonzero")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_times(prof) -> dict:
    """{category: ms} and {kernel name: ms} of the CUDA kernels in a profile."""
    by_cat, by_name = defaultdict(float), defaultdict(float)
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.device_time / 1e3  # us -> ms
        by_cat[category(evt.name)] += ms
        by_name[evt.name] += ms
    return dict(by_cat), dict(by_name)


def profile_pass(run, iters: int, prepare=None) -> dict:
    """Wall time (CUDA events) and kernel time per category of `run(prepare())` per
    iteration; `prepare` (e.g. the forward a backward needs) runs outside the profile."""
    prepare = prepare or (lambda: None)
    run(prepare())  # warm-up (workspace, autotune cache, lazy init)
    torch.cuda.synchronize()
    by_cat, by_name, wall = defaultdict(float), defaultdict(float), 0.0
    for _ in range(iters):
        arg = prepare()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start.record()
            run(arg)
            end.record()
            torch.cuda.synchronize()
        wall += start.elapsed_time(end)
        cats, names = kernel_times(prof)
        for k, v in cats.items():
            by_cat[k] += v
        for k, v in names.items():
            by_name[k] += v
    by_cat = {k: v / iters for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    busy = sum(by_cat.values())
    wall /= iters
    # Without the profiler (it slows the host): the pass's GPU wall time and the CPU time
    # to issue it. host_ms close to or above wall_unprofiled_ms: the pass is host-bound.
    host, wall_plain = 0.0, 0.0
    for _ in range(iters):
        arg = prepare()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        run(arg)
        host += time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        wall_plain += start.elapsed_time(end)
    return {"wall_ms": wall, "kernel_ms": busy, "idle_ms": max(wall - busy, 0.0),
            "wall_unprofiled_ms": wall_plain / iters, "host_ms": 1e3 * host / iters,
            "by_category_ms": by_cat, "top_kernels_ms": {k: v / iters for k, v in top}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(S.SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--routing", default="balanced", choices=S.ROUTINGS)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="mok", choices=("mok", *L.FP8_BACKENDS))
    ap.add_argument("--top", type=int, default=0, help="also print the N longest kernels")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.mok_backend = "auto"
    args.warmup = 1
    if not torch.cuda.is_available():
        print("benchmarks.breakdown needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    meta = L.run_metadata(device, args)
    records = []
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        weights = L.make_weights(local, device, seed=args.seed)
        case = L.make_case(local, args.tokens, args.routing, device, seed=args.seed)
        backend = L.make_backend(args.backend, local, weights, device, args)
        inp = backend.prepare(case)

        def forward():
            with torch.enable_grad():
                return backend.run(inp)

        fwd = profile_pass(lambda _: forward(), args.iters)

        def fresh_forward():
            for t in backend.leaves(inp):  # no gradient-accumulation kernels
                t.grad = None
            return forward()

        bwd = profile_pass(lambda y: torch.autograd.backward(y, case.dy), args.iters,
                           prepare=fresh_forward)
        for pass_name, rec in (("fwd", fwd), ("bwd", bwd)):
            gemm = sum(v for k, v in rec["by_category_ms"].items()
                       if k in ("megakernel", "expert gemm (core)", "fp8 gemm (core)",
                                "torch gemm"))
            rec["non_gemm_share"] = 1.0 - gemm / rec["wall_ms"] if rec["wall_ms"] else 0.0
            cats = ", ".join(f"{k} {v:.3f}" for k, v in rec["by_category_ms"].items()
                             if v > 0.005)
            print(f"{name:14s} {pass_name}  unprofiled {rec['wall_unprofiled_ms']:7.3f} ms, "
                  f"host {rec['host_ms']:7.3f} ms;  profiled wall {rec['wall_ms']:7.3f} ms  kernels "
                  f"{rec['kernel_ms']:7.3f}  idle {rec['idle_ms']:6.3f}  non-GEMM "
                  f"{rec['non_gemm_share']:5.1%}  | {cats}")
            for kernel, ms in list(rec["top_kernels_ms"].items())[:args.top]:
                print(f"    {ms:7.3f} ms  {kernel[:110]}")
        records.append({"shape": name, "tokens": args.tokens, "routing": args.routing,
                        "info": backend.info, "fwd": fwd, "bwd": bwd})
        backend.close()
        del weights, case, inp, backend
        torch.cuda.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.backend == "mok" else f"-{args.backend}"
    path = out_dir / f"{meta['date']}-{meta['gpu_short']}-layer-breakdown{suffix}.json"
    path.write_text(json.dumps({"meta": meta, "results": records}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
