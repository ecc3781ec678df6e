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
from benchmarks.gemm import make_case
from megatron_mok import grouped_gemm as gg

OPS = ("fc1", "fc2", "dgrad_swiglu", "dgrad_fc1", "wgrad_fc1", "wgrad_fc2", "torch_fc1")


def op_fn(case, op: str):
    s = case["sched"]
    offsets, num_rows = s.expert_offsets, s.num_rows
    x, d_out, w1, w2 = case["x"], case["d_out"], case["w1"], case["w2"]
    act, h = gg.fc1_swiglu(x, w1, offsets, num_rows)
    d_h = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows)
    return {
        "fc1": lambda: gg.fc1_swiglu(x, w1, offsets, num_rows, save_h=False),
        "fc2": lambda: gg.rows_matmul(act, w2, offsets, num_rows),
        "dgrad_swiglu": lambda: gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows),
        "dgrad_fc1": lambda: gg.rows_matmul(d_h, w1, offsets, num_rows, w_transposed=True),
        "wgrad_fc1": lambda: gg.wgrad(d_h, x, offsets),
        "wgrad_fc2": lambda: gg.wgrad(d_out, act, offsets),
        "torch_fc1": lambda: torch._grouped_mm(x, w1.transpose(1, 2),
                                               offs=offsets[1:]),
    }[op]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3")
    p.add_argument("--op", default="fc1", choices=OPS)
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
