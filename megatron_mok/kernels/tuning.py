"""Timing the candidate plans of the kernel backend on a real workspace (the measuring
half of the autotuner; kernels.autotune holds the plans, their cache and their lookup).

`tune()` times the forward's expert pass for every candidate (v1's launch chain and the
megakernel modes x knobs) and `tune_backward()` the backward's dgrad half; each stores the
fastest in the cache that every later pass reads (kernels.autotune.forward_plan /
backward_plan). With a config (its activation) and expert biases they time the epilogues
that layer runs (GPT-OSS's clamped GLU, biased SwiGLU), cached under that variant's key.
Non-gated experts have one plan (the launch chain) and nothing to tune. Collective at
EP > 1 (the slowest rank's time decides, so every rank picks the same plan). GPU only; `python -m benchmarks.autotune` runs both per shape.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Optional

import torch

from megatron_mok.config import MoKConfig
from megatron_mok.kernels import autotune, backend, megakernel
from megatron_mok.kernels.autotune import BackwardPlan, ForwardPlan
from megatron_mok.kernels.launch_chain import (expert_launches, fused_wgrad_targets, gather_rows,
                                               gemm_core, rows_combine)


def _run(plan: ForwardPlan, ws, sched, x, w1, w2, config: MoKConfig, b1=None, b2=None):
    """The expert pass of a plan as the forward runs it (pushes or in-place rows alike)."""
    direct = plan.path == "megakernel" and ws.ep_size == 1
    spread = plan.path == "megakernel-spread"
    in_place = rows_combine(ws) and (direct or spread or plan.path == "launches")
    if plan.path == "launches":
        ws.arena.view("x").copy_(x)
        return expert_launches(ws, sched, w1, w2, x.shape[1], False, push=not in_place,
                               activation=config.activation, b1=b1, b2=b2)
    return megakernel.moe_forward(ws, sched, x, w1, w2, save_h=False,
                                  num_comm_sms=0 if spread else plan.num_comm_sms,
                                  minibatch_rows=plan.minibatch_rows, direct=direct,
                                  scatter=not in_place, b1=b1, b2=b2,
                                  glu=config.activation.kernel_glu)


def _variant(config: Optional[MoKConfig], b1, b2) -> MoKConfig:
    """The config whose epilogues are timed (SwiGLU without biases by default); its
    expert_bias follows the biases given."""
    config = config or MoKConfig()
    if (b1 is None) != (b2 is None):
        raise ValueError("megatron_mok: b1 and b2 must be given together")
    if not config.activation.gated:
        raise ValueError("megatron_mok: non-gated experts run the launch chain only; there "
                         "is no plan to tune")
    return dataclasses.replace(config, expert_bias=b1 is not None)


def tune(ws, sched, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
         plans: Optional[list] = None, warmup: int = 2, iters: int = 5,
         save: bool = True, config: Optional[MoKConfig] = None, b1=None, b2=None
         ) -> tuple[ForwardPlan, dict]:
    """Time the expert pass of every candidate plan on this workspace and routing (the
    median of `iters` CUDA-event timings; at EP > 1 the slowest rank's time, so every rank
    picks the same plan) and return (fastest plan, {plan: ms}); stored in the cache with
    `save`, under the key of config's activation and the biases' presence. Collective at
    EP > 1: every rank must call it with the same plans."""
    config = _variant(config, b1, b2)
    if ws.arena is None:
        raise ValueError("megatron_mok: autotune needs a kernel-backend workspace")
    if not megakernel.available():
        raise RuntimeError("megatron_mok: the extension was built without the megakernel")
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    plans = plans or autotune.candidates(ws.ep_size, num_sms)
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
            _run(plan, ws, sched, x, w1, w2, config, b1, b2)
            end.record()
            if i >= warmup:
                times.append((start, end))
        torch.cuda.synchronize(x.device)
        ms = torch.tensor(statistics.median(s.elapsed_time(e) for s, e in times),
                          device=x.device)
        if ws.group is not None:
            torch.distributed.all_reduce(ms, op=torch.distributed.ReduceOp.MAX, group=ws.group)
        timings[autotune.plan_name(plan)] = float(ms)
    best = min(plans, key=lambda p: timings[autotune.plan_name(p)])
    if save:  # one rank writes the file; the others only need the plan in memory
        autotune.store(autotune.workspace_key(ws, w1.shape[1] // 2, config), best, timings,
              write=ws.group is None or torch.distributed.get_rank(ws.group) == 0)
    return best, timings


def tune_backward(ws, sched, x: torch.Tensor, topk_w: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, dy: torch.Tensor, *, plans: Optional[list] = None,
                  warmup: int = 2, iters: int = 5, save: bool = True,
                  config: Optional[MoKConfig] = None, b1=None, b2=None
                  ) -> tuple[BackwardPlan, dict]:
    """Time what the plans change in the backward (pull dy rows + weights, fc2 dgrad +
    SwiGLU backward, fc1 dgrad and the bf16 weight gradients: the core's wgrad launches,
    or inside the megakernel with MOK_BACKWARD_WGRAD=fused; the combine is the same)
    for every candidate at EP = 1 after one forward that keeps its context; return
    (fastest, {plan: ms}), stored in the cache with `save` (config and biases: as tune)."""
    config = _variant(config, b1, b2)
    if ws.arena is None or ws.ep_size != 1:
        raise ValueError("megatron_mok: backward autotune needs a kernel-backend workspace "
                         "at EP = 1")
    _, saved = backend.forward(ws, sched, x, topk_w, w1, w2, None, None, True, config, b1, b2)
    if saved.x_rows is None:  # the direct megakernel gathered x on the fly
        saved.x_rows = gather_rows(saved.x, sched)
    plans = plans or autotune.backward_candidates()
    if not megakernel.backward_runnable(ws, dy.dtype, saved.route_row is not None):
        plans = [p for p in plans if p.path == "launches"]
    core, arena = gemm_core(), ws.arena

    def run(plan):
        fused = plan.path == "megakernel"
        targets = fused_wgrad_targets(saved, None, None) if fused else None
        if not fused:
            arena.view("dy").copy_(dy)
            arena.view("topk_w").copy_(saved.topk_w)
        grads = backend.data_gradients(ws, sched, saved, dy, fused, plan.minibatch_rows,
                                       targets)
        if targets is None:  # the pass's launches (x rows materialised above, so dW1 reads
            # them even under MOK_WGRAD_GATHER; dW2 gathers dy where no rows were made)
            backend.expert_weight_grads(core, sched, saved, dy, grads, gather_x=False)

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
        timings[autotune.backward_plan_name(plan)] = statistics.median(
            s.elapsed_time(e) for s, e in times)
    best = min(plans, key=lambda p: timings[autotune.backward_plan_name(p)])
    if save:
        autotune.store(autotune.backward_key(ws, w1.shape[1] // 2, config), best, timings)
    return best, timings
