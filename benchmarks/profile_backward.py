"""Run the mok layer's backward on a benchmark shape for a profiler: a few untimed forward +
backward steps, then one forward and the backward between cudaProfilerStart/Stop.

    MOK_BACKWARD=megakernel MOK_BACKWARD_WGRAD=fused python -m benchmarks.profile_backward \
        --shape qwen3-30b-a3b [--tokens 8192]

Profile with `ncu --profile-from-start off -k "regex:moe_backward_kernel|grouped_gemm_kernel"`
(an earlier one-off GPU check compared the DRAM bytes of the backward
megakernel with its weight gradients inside against it followed by the wgrad launches).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import layer as L
from benchmarks import shapes as S


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    local = S.ep8_proxy(S.get_shape(args.shape))
    case = L.make_case(local, args.tokens, "balanced", device)
    backend = L.MokBackend(L.make_weights(local, device), device, "kernel")
    inp = backend.prepare(case)
    with torch.enable_grad():
        for _ in range(args.warmup + 1):
            for t in backend.leaves(inp):
                t.grad = None
            y = backend.run(inp)
            torch.cuda.synchronize()
            if _ == args.warmup:
                torch.cuda.cudart().cudaProfilerStart()
            torch.autograd.backward(y, case.dy)
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
