"""Does the `mok` layer wait for the GPU anywhere? Per shape, the layer's forward and
backward (MokBackend, as benchmarks.layer times them) run once under
torch.cuda.set_sync_debug_mode("error"); a synchronising call raises there and its
Python frames are printed. Then N back-to-back passes without any sync are timed on the
host and on the GPU: a pass with no sync lets the host run ahead, so the GPU's time per
pass approaches its kernel time; a hidden sync shows up as GPU idle time per pass.

    python -m benchmarks.host_sync [--shapes a,b] [--tokens 8192] [--iters 10]
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from benchmarks import layer as L


def first_sync(fn) -> str:
    """'' when fn() runs without a host sync, else the frames that synced."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return ""
    except RuntimeError as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if "megatron_mok" in f.filename or "benchmarks" in f.filename]
        return f"{err}".splitlines()[0] + "\n" + "".join(
            f"      {f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.line}\n"
            for f in frames[-6:])
    finally:
        torch.cuda.set_sync_debug_mode(0)


def back_to_back(fn, iters: int) -> tuple[float, float]:
    """(host ms per pass to issue, GPU ms per pass) over iters passes with no sync between."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / iters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,qwen3.5-like")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    for name in args.shapes.split(","):
        case, backend, inp = L.mok_on_shape(name, args.tokens, device)

        def forward():
            with torch.enable_grad():
                return backend.run(inp)

        def step():
            for t in backend.leaves(inp):
                t.grad = None
            torch.autograd.backward(forward(), case.dy)

        step()  # workspace, autotune cache, lazy init
        print(f"{name}: forward sync: {first_sync(forward) or 'none'}")
        print(f"{name}: forward + backward sync: {first_sync(step) or 'none'}")
        for label, fn in (("forward", forward), ("forward + backward", step)):
            host, gpu = back_to_back(fn, args.iters)
            print(f"{name}: {label:18s} back to back: host {host:7.3f} ms/pass, "
                  f"GPU {gpu:7.3f} ms/pass", flush=True)
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
