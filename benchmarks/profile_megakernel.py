"""Run the forward megakernel a few times on a benchmark shape, for a profiler.

    python -m benchmarks.profile_megakernel --shape deepseek-v3 --mode direct [--gather lines]
        [--comm-sms 8] [--minibatch 2048] [--tokens 8192] [--iters 2]

mode: direct (EP = 1, no comm CTAs; --gather tma|lines|rows) or comm (--comm-sms CTAs move the
rows). Only the last call runs between cudaProfilerStart/Stop: profile the kernel named
`moe_forward_kernel` with `ncu --profile-from-start off` (scripts/profile_megakernel.sh).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import shapes as S
from benchmarks.megakernel import make_case
from megatron_mok.kernels import megakernel
from megatron_mok import knobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3")
    p.add_argument("--mode", default="direct", choices=("direct", "comm"))
    p.add_argument("--gather", default="lines", choices=("lines", "tma", "rows"))
    p.add_argument("--comm-sms", type=int, default=8)
    p.add_argument("--minibatch", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args(argv)
    knobs.set_env("MOK_MEGAKERNEL_GATHER", args.gather)
    local = S.ep8_proxy(S.get_shape(args.shape))
    ws, sched, x, w1, w2 = make_case(local, args.tokens, "balanced", torch.device("cuda"))

    def run():
        megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False, num_comm_sms=args.comm_sms,
                               minibatch_rows=args.minibatch, direct=args.mode == "direct")

    for _ in range(args.iters):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
