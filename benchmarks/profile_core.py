"""Run one grouped-GEMM core op a few times on a benchmark shape, for a profiler.

    python -m benchmarks.profile_core --shape deepseek-v3 --op fc1 [--tokens 8192] [--iters 3]

ops: fc1 (fc1 + SwiGLU), fc2, dgrad_swiglu, dgrad_fc1, wgrad_fc1, wgrad_fc2, torch_fc1
(the `torch._grouped_mm` fc1 for comparison). Under Nsight Compute, profile the kernel
named `grouped_gemm_kernel` (or the CUTLASS one for torch_fc1); scripts/profile_core.sh
does that and falls back to torch.profiler kernel times when ncu is missing. The set-up
launches the core too, so only the last call runs between cudaProfilerStart/Stop: profile
with `ncu --profile-from-start off`.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import shapes as S
from benchmarks.gemm import make_case, op_fns



# CLI name -> (benchmarks.gemm op, which of its callables: 1 = ours, 2 = torch's grouped_mm)
OP_SOURCES = {"fc1": ("fc1_swiglu", 1), "fc2": ("fc2", 1),
              "dgrad_swiglu": ("dgrad_fc2_swiglu", 1), "dgrad_fc1": ("dgrad_fc1", 1),
              "wgrad_fc1": ("wgrad_fc1", 1), "wgrad_fc2": ("wgrad_fc2", 1),
              "torch_fc1": ("fc1_swiglu", 2)}


def op_fn(case, op: str):
    name, which = OP_SOURCES[op]
    return op_fns(case)[name][which]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3")
    p.add_argument("--op", default="fc1", choices=list(OP_SOURCES))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--torch-profiler", action="store_true",
                   help="print kernel times from torch.profiler instead (no ncu)")
    args = p.parse_args(argv)
    local = S.ep8_proxy(S.get_shape(args.shape))
    case = make_case(local, args.tokens, "balanced", torch.device("cuda"))
    fn = op_fn(case, args.op)
    fn()
    torch.cuda.synchronize()
    if args.torch_profiler:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    else:
        for _ in range(args.iters - 1):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()  # ncu --profile-from-start off sees this call only
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
