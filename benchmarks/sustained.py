"""The clock a pass sustains: dense BF16 peak in a burst (as benchmarks.layer measures it)
against the same GEMM and the layer's passes run back to back for seconds, with the SM
clock and board power sampled by nvidia-smi meanwhile.

    python -m benchmarks.sustained [--shapes deepseek-v3,dsv4-pro] [--passes fwd,bwd]
                                   [--seconds 3] [--out DIR]

The backward is timed alone (CUDA events around autograd.backward), each after an
untimed forward, so the GPU stays as busy as in training.

A fraction of the dense peak (BENCHMARKS.md) divides by the burst peak; a pass that runs
for milliseconds, back to back, does so at the clock the board's power limit allows. This
measures both, so a target's miss can be split into what the clock takes and what the
kernel leaves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks import layer as L
from benchmarks import shapes as S

REPO = Path(__file__).resolve().parents[1]


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms while active; mark() starts a
    new segment."""

    def __init__(self):
        self.segments: dict[str, list[tuple[float, float]]] = {}
        self.current = None
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if self.current is not None and len(parts) == 2:
                try:
                    self.segments[self.current].append((float(parts[0]), float(parts[1])))
                except ValueError:
                    pass

    def mark(self, name):
        self.current = name
        if name is not None:
            self.segments.setdefault(name, [])

    def summary(self, name):
        samples = self.segments.get(name, [])
        half = samples[len(samples) // 2:] or samples  # after the clock settles
        if not half:
            return {"sm_mhz": None, "power_w": None, "samples": 0}
        return {"sm_mhz": statistics.median(s[0] for s in half),
                "power_w": statistics.median(s[1] for s in half), "samples": len(half)}

    def close(self):
        self.proc.terminate()


def run_for(fn, seconds: float, prepare=lambda: None) -> list[float]:
    """ms per call of fn(prepare()) run back to back for `seconds` (CUDA events around fn
    only, no sync between)."""
    pairs, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        batch = []
        for _ in range(10):
            state = prepare()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(state)
            e.record()
            del state
            batch.append((s, e))
        batch[-1][1].synchronize()  # keep the host no more than a batch ahead
        pairs += batch
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="deepseek-v3,dsv4-pro")
    ap.add_argument("--passes", default="fwd")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    sampler = Sampler()
    time.sleep(0.5)
    n = L.PEAK_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    flops = 2.0 * n ** 3
    results = {"meta": L.run_metadata(device, argparse.Namespace(
        shapes=args.shapes, tokens=args.tokens, seed=0, warmup=0, iters=0)), "dense": {},
        "layer": []}
    sampler.mark("burst")
    burst = L.measure_dense_peak(device)
    sampler.mark(None)
    time.sleep(1.0)  # let the clock recover
    sampler.mark("dense")
    times = run_for(lambda _: torch.mm(a, b, out=c), args.seconds)
    sampler.mark(None)
    late = times[len(times) // 2:]
    sustained = flops / (statistics.median(late) * 1e-3) / 1e12
    results["dense"] = {"burst_tflops": burst, "sustained_tflops": sustained,
                        "sustained_over_burst": sustained / burst,
                        "burst_clock": sampler.summary("burst"),
                        "sustained_clock": sampler.summary("dense")}
    print(f"dense {n}^3: burst {burst:.0f} TFLOP/s, sustained {sustained:.0f} "
          f"({sustained / burst:.2f}); clock {results['dense']['sustained_clock']}", flush=True)
    margs = argparse.Namespace(mok_backend="kernel", seed=0)
    for name in args.shapes.split(","):
        local = S.ep8_proxy(S.get_shape(name))
        weights = L.make_weights(local, device)
        case = L.make_case(local, args.tokens, "balanced", device)
        for backend_name in ("mok", "torch-unfused"):
            backend = L.make_backend(backend_name, local, weights, device, margs)
            inp = backend.prepare(case)
            for which in args.passes.split(","):
                def clear():
                    for t in backend.leaves(inp):
                        t.grad = None
                if which == "fwd":
                    prepare, fn = clear, lambda _: backend.run(inp)
                else:  # the backward alone, after an untimed forward
                    prepare = lambda: (clear(), backend.run(inp))[1]
                    fn = lambda y: torch.autograd.backward(y, case.dy)
                with torch.enable_grad():
                    for _ in range(3):
                        fn(prepare())
                    torch.cuda.synchronize()
                    time.sleep(1.0)
                    tag = f"{name}/{backend_name}/{which}"
                    sampler.mark(tag)
                    times = run_for(fn, args.seconds, prepare)
                    sampler.mark(None)
                clear()
                late = times[len(times) // 2:]
                ms = statistics.median(late)
                flop = S.pass_flops(local, args.tokens, which)
                rec = {"shape": name, "backend": backend_name, "pass": which, "ms": ms,
                       "clock": sampler.summary(tag)}
                rec.update(tflops=flop / (ms * 1e-3) / 1e12)
                rec.update(of_burst_peak=rec["tflops"] / burst,
                           of_sustained_peak=rec["tflops"] / sustained)
                results["layer"].append(rec)
                print(json.dumps(rec), flush=True)
            del backend, inp
            torch.cuda.empty_cache()
    sampler.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{results['meta']['date']}-{results['meta']['gpu_short']}-sustained.json"
    path.write_text(json.dumps(results, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
