"""Per (GPU, shape) choice of the forward and backward paths and their knobs, measured
once and cached.

The kernel backend's forward can run as v1's launch chain or as the forward megakernel
(spread, direct or comm mode, with comm SMs x minibatch knobs). Which one is fastest
depends on the shape and the GPU (docs/megakernel.md, "Measured"), so
`tune()` times the candidates on a real workspace and stores the fastest under a key of
the GPU name and the shape; `forward_plan()` (called by every kernel-backend forward)
uses a cached plan when there is one. Precedence: MOK_FORWARD in the environment, then
the cache (MoKConfig.autotune), then the default with the config's knobs (the spread
megakernel at EP = 1 where it runs, else the launch chain).

The backward likewise: `tune_backward()` times the dgrad half (the launch chain, or the
backward megakernel x minibatch; EP = 1) and `backward_plan()` resolves MOK_BACKWARD, then
the cache, then the launch chain. Its entries sit under the forward key + "|bwd".

Cache: JSON at $MOK_AUTOTUNE_CACHE (default ~/.cache/megatron_mok/autotune.json), read
once per process. Fill it with `python -m benchmarks.autotune` or by calling `tune()`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from megatron_mok import knobs, megakernel

MINIBATCHES = (1024, 2048, 4096, 8192)
COMM_SMS = (4, 8, 16, 24)
BACKWARD_MINIBATCHES = (1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    path: str             # "launches" or a megakernel path (megakernel.FORWARD_PATHS)
    num_comm_sms: int     # comm CTAs (comm mode only)
    minibatch_rows: int   # rows per readiness counter (megakernel only)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    path: str             # "launches" or "megakernel" (megakernel.BACKWARD_PATHS)
    minibatch_rows: int   # rows per readiness counter (megakernel only)


def cache_file() -> Path:
    env = knobs.get("MOK_AUTOTUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_mok" / "autotune.json"


def plan_key(gpu: str, num_tokens: int, hidden: int, inter: int, num_local_experts: int,
             topk: int, ep_size: int) -> str:
    """GPU and shape, plus the MOK_* knobs that change what a plan measured (those not at
    their defaults: knobs.plan_signature), so a plan is never reused under other knobs."""
    key = f"{gpu}|T={num_tokens}|H={hidden}|I={inter}|E_loc={num_local_experts}|K={topk}|EP={ep_size}"
    signature = knobs.plan_signature()
    return f"{key}|{signature}" if signature else key


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def workspace_key(ws, inter: int) -> str:
    gpu = _device_name(ws.device)
    return plan_key(gpu, ws.num_tokens, ws.hidden_size, inter, ws.num_local_experts, ws.topk,
                    ws.ep_size)


_LOADED: dict = {}  # cache file path -> its entries


def _entries() -> dict:
    path = cache_file()
    key = str(path)
    if key not in _LOADED:
        entries = {}
        if path.exists():
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                warnings.warn(f"megatron_mok: ignoring the unreadable autotune cache {path}: {err}")
        _LOADED[key] = entries
    return _LOADED[key]


def lookup(key: str) -> Optional[ForwardPlan]:
    entry = _entries().get(key)
    if entry is None:
        return None
    plan = entry.get("plan", {})
    if plan.get("path") not in megakernel.FORWARD_PATHS:
        return None
    return ForwardPlan(plan["path"], int(plan["num_comm_sms"]), int(plan["minibatch_rows"]))


def store(key: str, plan, timings_ms: dict, write: bool = True) -> None:
    """Remember the plan (a ForwardPlan or BackwardPlan) in this process and, with
    `write`, in the cache file."""
    entries = _entries()
    entries[key] = {"plan": dataclasses.asdict(plan), "timings_ms": timings_ms}
    if not write:
        return
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of this writer's own (ranks and processes tune at once), then an
    # atomic rename: readers see the old or the new file, never a mix.
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def forward_plan(ws, inter: int, config) -> ForwardPlan:
    """The forward path and knobs for this workspace: MOK_FORWARD, else the cached plan
    (config.autotune), else the default with the config's knobs: at EP = 1 the spread
    megakernel where it can run (measured 0.97-1.17x the launch chain's time, 5 of 6
    shapes faster: docs/megakernel.md), otherwise the launch chain."""
    path = ("megakernel-spread" if ws.ep_size == 1 and megakernel.runnable(ws.hidden_size)
            else "launches")
    default = ForwardPlan(path, config.fwd_num_comm_sms, config.minibatch_size)
    if knobs.is_set("MOK_FORWARD"):
        return dataclasses.replace(default, path=megakernel.forward_path(ws.hidden_size))
    plan = lookup(workspace_key(ws, inter)) if config.autotune else None
    if plan is None or (plan.path != "launches" and not megakernel.runnable(ws.hidden_size)):
        return default
    return plan


def candidates(ep_size: int, num_sms: int) -> list[ForwardPlan]:
    plans = [ForwardPlan("launches", 0, 0)]
    if ep_size == 1:
        plans += [ForwardPlan("megakernel", 0, mb) for mb in MINIBATCHES]
    comm_path = "megakernel-comm" if ep_size == 1 else "megakernel"
    plans += [ForwardPlan(comm_path, c, mb) for c in COMM_SMS if c < num_sms
              for mb in MINIBATCHES[1:]]
    plans += [ForwardPlan("megakernel-spread", 0, mb) for mb in MINIBATCHES[1:]]
    return plans


def _run(plan: ForwardPlan, ws, sched, x, w1, w2):
    """The expert pass of a plan as the forward runs it (pushes or in-place rows alike)."""
    from megatron_mok import kernel_backend
    direct = plan.path == "megakernel" and ws.ep_size == 1
    spread = plan.path == "megakernel-spread"
    in_place = kernel_backend.rows_combine(ws) and (direct or spread or plan.path == "launches")
    if plan.path == "launches":
        ws.arena.view("x").copy_(x)
        return kernel_backend._expert_launches(ws, sched, w1, w2, x.shape[1], False,
                                               push=not in_place)
    return megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False,
                                  num_comm_sms=0 if spread else plan.num_comm_sms,
                                  minibatch_rows=plan.minibatch_rows, direct=direct,
                                  scatter=not in_place)


def tune(ws, sched, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
         plans: Optional[list] = None, warmup: int = 2, iters: int = 5,
         save: bool = True) -> tuple[ForwardPlan, dict]:
    """Time the expert pass of every candidate plan on this workspace and routing (the
    median of `iters` CUDA-event timings; at EP > 1 the slowest rank's time, so every rank
    picks the same plan) and return (fastest plan, {plan: ms}); stored in the cache with
    `save`. Collective at EP > 1: every rank must call it with the same plans."""
    if ws.arena is None:
        raise ValueError("megatron_mok: autotune needs a kernel-backend workspace")
    if not megakernel.available():
        raise RuntimeError("megatron_mok: the extension was built without the megakernel")
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    plans = plans or candidates(ws.ep_size, num_sms)
    if ws.hidden_size > megakernel.MAX_HIDDEN:
        plans = [p for p in plans if p.path == "launches"]
    w1, w2 = w1.contiguous(), w2.contiguous()
    ws.arena.view("x").copy_(x)  # EP > 1: the peers pull it (the real forward publishes it too)
    timings = {}
    for plan in plans:
        times = []
        for i in range(warmup + iters):
            ws.arena.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _run(plan, ws, sched, x, w1, w2)
            end.record()
            if i >= warmup:
                times.append((start, end))
        torch.cuda.synchronize(x.device)
        ms = torch.tensor(statistics.median(s.elapsed_time(e) for s, e in times),
                          device=x.device)
        if ws.group is not None:
            torch.distributed.all_reduce(ms, op=torch.distributed.ReduceOp.MAX, group=ws.group)
        timings[_name(plan)] = float(ms)
    best = min(plans, key=lambda p: timings[_name(p)])
    if save:  # one rank writes the file; the others only need the plan in memory
        store(workspace_key(ws, w1.shape[1] // 2), best, timings,
              write=ws.group is None or torch.distributed.get_rank(ws.group) == 0)
    return best, timings


def _name(plan: ForwardPlan) -> str:
    if plan.path == "launches":
        return "launches"
    if plan.path == "megakernel" and plan.num_comm_sms == 0:
        return f"megakernel-direct/mb{plan.minibatch_rows}"
    return f"{plan.path}/comm{plan.num_comm_sms}/mb{plan.minibatch_rows}"


# ---------------------------------------------------------------------------------------
# Backward


def backward_key(ws, inter: int) -> str:
    """The forward key + "|bwd"; + "|wgrad-fused" when MOK_BACKWARD_WGRAD=fused, whose
    megakernel plans time different work (the weight gradients inside)."""
    suffix = "|wgrad-fused" if knobs.get("MOK_BACKWARD_WGRAD") == "fused" else ""
    return workspace_key(ws, inter) + "|bwd" + suffix


def lookup_backward(key: str) -> Optional[BackwardPlan]:
    plan = _entries().get(key, {}).get("plan", {})
    if plan.get("path") not in megakernel.BACKWARD_PATHS:
        return None
    return BackwardPlan(plan["path"], int(plan["minibatch_rows"]))


def backward_plan(ws, inter: int, config, dtype: torch.dtype, in_place: bool) -> BackwardPlan:
    """The backward's dgrad path: MOK_BACKWARD (with MOK_BACKWARD_MINIBATCH) if set, else
    the cached plan (config.autotune) where the megakernel can run, else the launch chain
    (the backward megakernel is not yet measured: docs/perf-notes.md)."""
    minibatch = int(knobs.get("MOK_BACKWARD_MINIBATCH"))
    if knobs.is_set("MOK_BACKWARD"):
        return BackwardPlan(megakernel.backward_path(ws, dtype, in_place), minibatch)
    plan = lookup_backward(backward_key(ws, inter)) if config is None or config.autotune \
        else None
    if plan is None or (plan.path == "megakernel"
                        and not megakernel.backward_runnable(ws, dtype, in_place)):
        return BackwardPlan("launches", minibatch)
    return plan


def backward_candidates() -> list[BackwardPlan]:
    return [BackwardPlan("launches", 0)] + [BackwardPlan("megakernel", mb)
                                            for mb in BACKWARD_MINIBATCHES]


def tune_backward(ws, sched, x: torch.Tensor, topk_w: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, dy: torch.Tensor, *, plans: Optional[list] = None,
                  warmup: int = 2, iters: int = 5, save: bool = True
                  ) -> tuple[BackwardPlan, dict]:
    """Time what the plans change in the backward (pull dy scaled + dots, fc2 dgrad +
    SwiGLU backward, fc1 dgrad and the bf16 weight gradients: the core's wgrad launches,
    or inside the megakernel with MOK_BACKWARD_WGRAD=fused; the combine is the same)
    for every candidate at EP = 1 after one forward that keeps its context; return
    (fastest, {plan: ms}), stored in the cache with `save`."""
    from megatron_mok import kernel_backend, ops
    if ws.arena is None or ws.ep_size != 1:
        raise ValueError("megatron_mok: backward autotune needs a kernel-backend workspace "
                         "at EP = 1")
    _, saved = kernel_backend.forward(ws, sched, x, topk_w, w1, w2, None, None, True)
    if saved.x_rows is None:  # the direct megakernel gathered x on the fly
        saved.x_rows = kernel_backend._gather_rows(saved.x, sched)
    plans = plans or backward_candidates()
    if not megakernel.backward_runnable(ws, dy.dtype, saved.route_row is not None):
        plans = [p for p in plans if p.path == "launches"]
    core, offs = kernel_backend.gemm_core(), sched.expert_offsets[1:]
    arena = ws.arena

    def wgrads(d_out, d_h):
        kernel_backend._weight_grad(core, d_out, saved.act, sched, saved.w2, None)
        kernel_backend._weight_grad(core, d_h, saved.x_rows, sched, saved.w1, None)

    def run(plan):
        if plan.path == "megakernel":
            targets = kernel_backend._fused_wgrad_targets(saved, None, None)
            d_out, _, d_h, _ = megakernel.moe_backward(
                ws, sched, dy, saved.topk_w, saved.w1, saved.w2, saved.h, saved.y_rows,
                minibatch_rows=plan.minibatch_rows, wgrad=targets)
            if targets is None:
                wgrads(d_out, d_h)
            return
        arena.view("dy").copy_(dy)
        arena.view("topk_w").copy_(saved.topk_w)
        d_out = dy.new_empty(ws.capacity, dy.shape[1])
        dots = torch.empty(ws.capacity, dtype=torch.float32, device=dy.device)
        ops.pull_rows(arena.peer_base, arena.offset("dy"), sched, ws.topk, d_out,
                      w_offset=arena.offset("topk_w"), saved=saved.y_rows, dots=dots)
        d_h, _ = kernel_backend._dgrad_launches(core, sched, saved, d_out, offs)
        wgrads(d_out, d_h)

    timings = {}
    for plan in plans:
        times = []
        for i in range(warmup + iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(plan)
            end.record()
            if i >= warmup:
                times.append((start, end))
        torch.cuda.synchronize(dy.device)
        timings[_backward_name(plan)] = statistics.median(s.elapsed_time(e) for s, e in times)
    best = min(plans, key=lambda p: timings[_backward_name(p)])
    if save:
        store(backward_key(ws, w1.shape[1] // 2), best, timings)
    return best, timings


def _backward_name(plan: BackwardPlan) -> str:
    return "launches" if plan.path == "launches" else f"megakernel/mb{plan.minibatch_rows}"
