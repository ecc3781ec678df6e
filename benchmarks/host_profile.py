"""Where the host time of one `mok` layer call goes: per shape, the layer forward and the
backward (as benchmarks.layer times them, each issued on an idle GPU) run under cProfile;
prints the functions with the most own time and the count of aten ops and launches per
call (torch.profiler, CPU side), and writes both to --out as JSON.

    python -m benchmarks.host_profile [--shapes qwen3-30b-a3b] [--tokens 8192] [--calls 20]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import time

import torch

from benchmarks import layer as L


def _profile(fn, prepare, calls: int) -> tuple[float, list[dict]]:
    """(median host ms of fn(prepare()), top functions by own time per call)."""
    profiler, times = cProfile.Profile(), []
    for _ in range(calls):
        state = prepare()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        profiler.enable()
        out = fn(state)
        profiler.disable()
        times.append((time.perf_counter() - t0) * 1e3)
        del out, state
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, ncalls, own, cum, _) in stats.stats.items():
        rows.append({"function": f"{path.split('site-packages/')[-1]}:{line}({name})",
                     "calls_per_call": ncalls / calls, "own_us": own * 1e6 / calls,
                     "cum_us": cum * 1e6 / calls})
    rows.sort(key=lambda r: -r["own_us"])
    return sorted(times)[len(times) // 2], rows


def _op_counts(fn, prepare) -> dict:
    """aten ops and CUDA runtime calls issued by one fn(prepare()), by name."""
    state = prepare()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(state)
    counts = collections.Counter(e.name for e in prof.events()
                                 if e.name.startswith(("aten::", "megatron_mok::", "cuda")))
    return dict(counts.most_common())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    result = {"meta": L.run_metadata(device, argparse.Namespace(warmup=1, iters=args.calls,
                                                               seed=0)), "shapes": {}}
    for name in args.shapes.split(","):
        case, backend, inp = L.mok_on_shape(name, args.tokens, device)

        def clear():
            for t in backend.leaves(inp):
                t.grad = None
            return inp

        def forward(state):
            with torch.enable_grad():
                return backend.run(state)

        def make_y():
            clear()
            return forward(inp)

        def backward(y):
            torch.autograd.backward(y, case.dy)

        backward(make_y())  # workspace, autotune plans, lazy init
        entry = {}
        for label, fn, prepare in (("forward", forward, clear), ("backward", backward, make_y)):
            host_ms, rows = _profile(fn, prepare, args.calls)
            ops = _op_counts(fn, prepare)
            entry[label] = {"host_ms": host_ms, "top": rows[:args.top], "ops": ops}
            print(f"\n{name} {label}: host {host_ms:.3f} ms per call (median of "
                  f"{args.calls}, cProfile on); {sum(ops.values())} ops/runtime calls")
            for r in rows[:args.top]:
                print(f"  {r['own_us']:8.1f} us own {r['cum_us']:8.1f} us cum "
                      f"{r['calls_per_call']:6.1f}x  {r['function']}")
            print("  ops: " + ", ".join(f"{k} {v}" for k, v in list(ops.items())[:30]))
        result["shapes"][name] = entry
        backend.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
