"""EP MoE layer benchmark, one process per GPU: `mok` vs PyTorch + NCCL all-to-all.

    torchrun --nproc_per_node 8 -m benchmarks.layer_ep [--shapes a,b] [--tokens 4096,8192]
        [--routing balanced,skewed] [--backends mok,torch-a2a] [--pass fwd,bwd]
        [--warmup 10] [--iters 30] [--out benchmarks/results] [--device cuda]

Every rank holds E/ep experts of the full shape (docs/benchmarks.md) and T tokens
routed over all E experts (per-rank seeds). Backends:

  mok        megatron_mok.functional.fused_moe over the EP group (symmetric memory on
             GPUs; the reference backend on CPU).
  torch-a2a  "NCCL + PyTorch": routes sorted by expert, split sizes exchanged (a host
             sync, as such baselines do), rows and expert ids sent with all_to_all_single,
             grouped GEMMs on the received rows, rows sent back, fp32 weighted sum.

  megatron-alltoall  Megatron-Core's MoELayer with the `alltoall` dispatcher at EP = world
             (benchmarks.layer's MegatronBackend: TE grouped GEMM where TE imports, else
             SequentialMLP; the router is bypassed with the benchmark's routing).

  megatron-flex-deepep / megatron-flex-hybridep
             the same layer with Megatron's `flex` dispatcher on DeepEP / HybridEP, whenever
             the environment's `deep_ep` provides them (skipped with the reason otherwise). Before timing, each backend's output and gradients are checked against
megatron_mok.reference.moe_reference over the same group (relative L2 <= 1e-2). A time
is the median over iterations on a rank, then the maximum over ranks (the ranks start
each measurement at a barrier; L2 flushed before every iteration). NVLink bytes per GPU: routed rows that leave or come back
to the rank (dispatch + combine, H bf16 each), averaged over ranks, over the time.
Rank 0 writes benchmarks/results/<date>-<gpu>-layer-ep<N>.json. On CPU (`--device cpu`,
gloo, e.g. `torchrun --nproc_per_node 2 -m benchmarks.layer_ep --device cpu --shapes
tiny --tokens 64`) it is a smoke test of the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from benchmarks import layer as L
from benchmarks import shapes as S

BACKENDS = ("mok", "torch-a2a", "megatron-alltoall", "megatron-flex-deepep",
            "megatron-flex-hybridep")
# The flex backends need the user's DeepEP build (deep_ep.Buffer / deep_ep.HybridEPBuffer);
# without it they are recorded as skipped, with the reason.
FLEX_NEEDS = {"megatron-flex-deepep": "Buffer", "megatron-flex-hybridep": "HybridEPBuffer"}


def torch_a2a_moe(x, topk_idx, topk_w, w1, w2, shared_w1=None, shared_w2=None, *, group=None):
    """The unfused EP MoE layer over all_to_all_single, differentiable (no dropped routes)."""
    ep = dist.get_world_size(group)
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    experts_local = w1.shape[0]
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)                  # by global expert = by rank
    send_counts = torch.bincount(flat // experts_local, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()   # host sync
    x_recv = dist_nn.all_to_all_single(x.new_empty(sum(recv), hidden),
                                       x.index_select(0, order // topk), recv, send, group=group)
    e_recv = torch.empty(sum(recv), dtype=torch.long, device=x.device)
    dist.all_to_all_single(e_recv, flat[order] % experts_local, recv, send, group=group)
    local_order = torch.argsort(e_recv, stable=True)          # received rows by local expert
    offs = torch.bincount(e_recv, minlength=experts_local).cumsum(0).to(torch.int32)
    h = L.grouped_linear(x_recv.index_select(0, local_order), w1, offs)
    gate, up = h.chunk(2, dim=-1)
    out = L.grouped_linear(F.silu(gate) * up, w2, offs)
    out = out.index_select(0, torch.argsort(local_order))    # back to arrival order
    back = dist_nn.all_to_all_single(out.new_empty(num_tokens * topk, hidden), out, send, recv,
                                     group=group)
    slots = back.index_select(0, torch.argsort(order)).view(num_tokens, topk, hidden)
    y = (slots.float() * topk_w.float().unsqueeze(-1)).sum(dim=1)
    if shared_w1 is not None:
        sg, su = (x @ shared_w1.t()).chunk(2, dim=-1)
        y = y + ((F.silu(sg) * su) @ shared_w2.t()).float()
    return y.to(x.dtype)


class TorchA2ABackend(L.Backend):
    name = "torch-a2a"

    def __init__(self, weights, device, group):
        super().__init__(weights)
        self.group = group
        self.info = {"grouped_gemm": L.grouped_mm_impl(device, weights.w1.dtype),
                     "collective": dist.get_backend(group)}

    def run(self, inp):
        return torch_a2a_moe(inp["x"], inp["topk_idx"], inp["topk_w"], *self.weights.tensors(),
                             group=self.group)


class MokEPBackend(L.MokBackend):
    def __init__(self, weights, device, group, mok_backend="auto"):
        super().__init__(weights, device, mok_backend)
        self.group = group

    def run(self, inp):
        return self.fused_moe(inp["x"], inp["topk_idx"], inp["topk_w"], *self.weights.tensors(),
                              group=self.group, config=self.config)


class ReferenceEP(L.Backend):
    name = "reference"

    def __init__(self, weights, group):
        super().__init__(weights)
        self.group = group

    def run(self, inp):
        from megatron_mok.reference import moe_reference
        return moe_reference(inp["x"], inp["topk_idx"], inp["topk_w"], *self.weights.tensors(),
                             group=self.group)


def ep_check(backend, case, weights, group) -> dict:
    """Forward output and every gradient vs the EP reference (same group, same inputs)."""
    def run(b):
        inp = b.prepare(case)
        leaves = b.leaves(inp)
        for t in leaves:
            t.grad = None
        with torch.enable_grad():
            y = b.run(inp)
            torch.autograd.backward(y, case.dy)
        grads = {k: v.detach().clone() for k, v in b.grads(inp).items() if v is not None}
        for t in leaves:
            t.grad = None
        return y.detach(), grads

    y, grads = run(backend)
    y_ref, ref = run(ReferenceEP(weights, group))
    keys = [k for k in ref if k in grads]
    errs = torch.tensor([L.rel_l2(y, y_ref)] + [L.rel_l2(grads[k], ref[k]) for k in keys],
                        dtype=torch.float64, device=y.device)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)  # the worst rank decides
    errs = errs.tolist()
    return {"fwd_rel_l2": errs[0], "bwd_rel_l2_max": max(errs[1:]),
            "bwd_rel_l2": dict(zip(keys, errs[1:])), "finite": all(e == e for e in errs)}


def make_ep_backend(name, local, weights, device, group, args):
    if name == "mok":
        return MokEPBackend(weights, device, group, args.mok_backend)
    if name == "torch-a2a":
        return TorchA2ABackend(weights, device, group)
    if name == "megatron-alltoall":
        return L.MegatronBackend(local, weights, device, seed=args.seed,
                                 ep_size=dist.get_world_size(group))
    if name in FLEX_NEEDS:
        return L.MegatronBackend(local, weights, device, seed=args.seed,
                                 ep_size=dist.get_world_size(group),
                                 flex_backend=name.rsplit("-", 1)[1])
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


def unavailable(name: str) -> str:
    """Why backend `name` cannot run here ("" if it can)."""
    if name not in FLEX_NEEDS:
        return ""
    try:
        import deep_ep
    except Exception as err:  # not installed, or built for another torch
        return f"deep_ep not importable ({type(err).__name__}: {err})"
    if not hasattr(deep_ep, FLEX_NEEDS[name]):
        return f"deep_ep has no {FLEX_NEEDS[name]}"
    return ""


def crossing_bytes(case, experts_local: int, rank: int) -> int:
    """Bytes of routed rows that leave this rank and come back (bf16 rows of H)."""
    remote = int((case.topk_idx.long() // experts_local != rank).sum())
    return 2 * remote * case.x.shape[1] * case.x.element_size()


def max_over_ranks(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def mean_over_ranks(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, group=group)
    return float(t.item()) / dist.get_world_size(group)


def run(args, group, device) -> list:
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    meta = L.run_metadata(device, args)
    meta.update(benchmark="layer-ep", ep=ep, collective=dist.get_backend(group))
    peak = -max_over_ranks(-L.measure_dense_peak(device), group)  # the slowest GPU's
    meta["peak_tflops"] = peak
    timer = L.Timer(device, L.FLUSH_BYTES if device.type == "cuda" else 0)
    records = []
    for shape_name in args.shapes.split(","):
        shape = S.get_shape(shape_name)
        if shape.num_experts % ep:
            raise ValueError(f"{shape_name}: E={shape.num_experts} not divisible by EP={ep}")
        local = S.LocalShape(shape.name, shape.hidden, shape.inter, shape.num_experts // ep,
                             shape.topk, shape.shared_inter)
        weights = L.make_weights(local, device, seed=args.seed + 101 * rank)
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            for routing in args.routing.split(","):
                idx, w = S.make_routing(routing, num_tokens, shape.num_experts, shape.topk,
                                        seed=args.seed + 2 + 1009 * rank, device=device,
                                        ep_size=ep)
                gen = torch.Generator(device=device).manual_seed(args.seed + 3 + 7919 * rank)
                x = torch.randn(num_tokens, local.hidden, generator=gen, device=device,
                                dtype=torch.bfloat16)
                dy = torch.randn(num_tokens, local.hidden, generator=gen, device=device,
                                 dtype=torch.bfloat16)
                case = L.CaseInputs(x, idx.int(), w, dy)
                moved = mean_over_ranks(crossing_bytes(case, local.num_local_experts, rank),
                                        group)
                for name in args.backends.split(","):
                    reason = unavailable(name)  # the same on every rank
                    if reason:
                        for which in args.passes.split(","):
                            records.append(L.make_record(
                                meta, shape, local, num_tokens, routing, name, which, peak,
                                info={"skipped": reason}, error=f"skipped: {reason}"))
                        if rank == 0:
                            print(f"{shape_name:14} {name}: skipped, {reason}", flush=True)
                        continue
                    backend = make_ep_backend(name, local, weights, device, group, args)
                    check = ep_check(backend, case, weights, group)
                    for which in args.passes.split(","):
                        timed = L.time_forward if which == "fwd" else L.time_backward
                        dist.barrier(group)  # ranks start together; collectives keep them so
                        times, host_ms, _ = timed(timer, backend, case, args.warmup, args.iters)
                        ms = max_over_ranks(statistics.median(times), group)
                        # the slowest rank's host time (it includes waiting for peers)
                        host_ms = None if host_ms is None else max_over_ranks(host_ms, group)
                        rec = L.make_record(meta, shape, local, num_tokens, routing, name,
                                            which, peak, times=[ms], check=check,
                                            info=backend.info, warmup=args.warmup,
                                            host_ms=host_ms)
                        rec.update(ep=ep, iters=len(times), nvlink_bytes_per_gpu=moved,
                                   nvlink_gbps_per_gpu=moved / (ms * 1e-3) / 1e9)
                        records.append(rec)
                        if rank == 0:
                            print(f"{shape_name:14} T={num_tokens:<6} {routing:9} {which:3} "
                                  f"{name:10} {ms:9.3f} ms  {rec['frac_peak']:.2f} of peak  "
                                  f"{rec['nvlink_gbps_per_gpu']:7.1f} GB/s/GPU  "
                                  f"check {'ok' if rec['correct'] else 'FAIL'} "
                                  f"{rec['rel_l2']:.1e}", flush=True)
                    backend.close()
    for r in records:  # speedup[b] = b's time / this time, for every other timed backend
        same = [b for b in records if b["ms"] and b["backend"] != r["backend"] and
                all(b[k] == r[k] for k in ("shape", "T", "routing", "pass"))]
        r["speedup"] = {b["backend"]: b["ms"] / r["ms"] for b in same} if r["ms"] else {}
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{meta['date']}-{meta['gpu_short']}-layer-ep{ep}.json"
        path.write_text(json.dumps({"benchmark": "layer-ep", "meta": meta, "records": records},
                                   indent=1))
        print(f"results: {path}")
    return records


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(S.SHAPES))
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--pass", dest="passes", default="fwd,bwd")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(L.REPO / "benchmarks" / "results"))
    p.add_argument("--mok-backend", default="auto", choices=("auto", "reference", "kernel"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        run(args, dist.group.WORLD, device)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
