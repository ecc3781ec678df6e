"""The GPU pass, v1 (DESIGN.md section 4 as a sequence of launches, no host sync).

Forward, per rank:  publish x -> barrier -> pull rows of x into row-table order ->
grouped GEMM fc1 -> SwiGLU -> grouped GEMM fc2 -> push rows into the owners'
(t, k) slots -> barrier -> fp32 combine epilogue (+ shared expert). At EP = 1 by
default (spread mode), with MOK_FORWARD=megakernel*, or with a cached autotune plan that
measured it fastest (megatron_mok.autotune), the steps from pull to push run as one
launch, the forward megakernel (megatron_mok.megakernel); MOK_FORWARD=launches keeps
this chain.

Backward: publish dy and the router weights -> barrier -> pull dy rows scaled by
their router weight (and <dy, y_tk> per route, for d_topk_w) -> fc2 dgrad ->
SwiGLU backward -> fc1 dgrad -> push dx rows and d_topk_w into the owners' slots ->
weight gradients (one grouped GEMM per weight, tokens as K in row-table order) ->
barrier -> dx = shared dx + sum_k slots in fp32. With MOK_BACKWARD=megakernel (opt-in,
or an autotuned plan) the steps from pull to the dx rows run as one launch, the backward
megakernel (megatron_mok.megakernel.moe_backward); with MOK_BACKWARD_WGRAD=fused too the
weight gradients run in that launch (its phase 2) instead of the core's launches.

At EP = 1 (MOK_EP1_COMBINE=rows, the default; `slots` restores the pushes) there are
no pushes: both combines read the expert rows in place through route_rows
(ops.combine_rows), bit-equal to the slots path.

Launch shapes depend only on the workspace (capacity), never on the routing, so the
pass is CUDA-graph capturable. The megakernel issues replace these launches one by
one behind the same functions.

Expert GEMMs run on our Hopper grouped-GEMM core (megatron_mok.grouped_gemm: fc1 with
SwiGLU in the epilogue, fc2 dgrad with the SwiGLU backward in the epilogue, weight
gradients with tokens as K). MOK_GEMM_CORE=torch selects the `torch._grouped_mm` path
instead (side-by-side benchmarks); `gemm_core()` says which one runs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok import autotune, grouped_gemm, knobs, megakernel, ops, routing_errors
from megatron_mok.config import MoKConfig
from megatron_mok.schedule import MoKSchedule
from megatron_mok.workspace import MoKWorkspace


def gather_routing(ws: MoKWorkspace, topk_idx: torch.Tensor) -> torch.Tensor:
    """Every rank's routing, [P, T, K] int32, read from the peers' arenas."""
    arena = ws.arena
    if ws.ep_size == 1:
        return topk_idx.to(torch.int32).unsqueeze(0)
    arena.view("routing").copy_(topk_idx)
    arena.barrier()
    out = torch.empty(ws.ep_size, ws.num_tokens, ws.topk, dtype=torch.int32, device=ws.device)
    ops.gather_from_peers(arena.peer_base, arena.offset("routing"), out)
    return out


GEMM_CORES = ("mok", "torch")


def gemm_core() -> str:
    """"mok" (our grouped-GEMM core, the default when built) or "torch" (_grouped_mm)."""
    core = knobs.get("MOK_GEMM_CORE")
    if core == "mok" and not grouped_gemm.available():
        raise RuntimeError("megatron_mok: the extension was built without the grouped-GEMM "
                           "core; rebuild it or set MOK_GEMM_CORE=torch")
    return core


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(h.dtype)


def _swiglu_backward(h: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d = d_act.float()
    d_gate = d * up * sig * (1 + gate * (1 - sig))
    d_up = d * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(h.dtype)


def _shared_forward(x, shared_w1, shared_w2, keep_graph: bool):
    """Shared expert on this rank's tokens (BF16 GEMMs); keeps its graph for backward."""
    leaves = tuple(t.detach().requires_grad_(keep_graph) for t in (x, shared_w1, shared_w2))
    with torch.enable_grad() if keep_graph else torch.no_grad():
        act = _swiglu(leaves[0] @ leaves[1].t())
        out = act @ leaves[2].t()
    return out, leaves


@dataclasses.dataclass
class KernelSaved:
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    x_rows: torch.Tensor       # [capacity, H] routed tokens, row-table order
    h: torch.Tensor            # [capacity, 2I] fc1 output (gate; up)
    act: torch.Tensor          # [capacity, I] SwiGLU output
    y_rows: torch.Tensor       # [capacity, H] expert output rows
    shared_out: Optional[torch.Tensor]
    shared_leaves: Optional[tuple]
    x: Optional[torch.Tensor] = None  # EP = 1 direct megakernel: x_rows is gathered again
    route_row: Optional[torch.Tensor] = None  # EP = 1 rows combine: row of route (t, k)
    config: Optional[MoKConfig] = None  # the forward's (the backward plan's autotune flag)


def backward_minibatch() -> int:
    """Rows per readiness counter of the backward megakernel (MOK_BACKWARD_MINIBATCH,
    default 2048: the forward's best at T = 8192, perf-notes v7)."""
    return int(knobs.get("MOK_BACKWARD_MINIBATCH"))


def rows_combine(ws: MoKWorkspace) -> bool:
    """MOK_EP1_COMBINE=rows (the default; EP = 1 only): the combines of the forward and the
    backward read the expert rows in place (ops.combine_rows) instead of pushing them into
    (t, k) slots first: one pass over the rows fewer each way. Bit-equal to `slots`;
    measured 3-6 % faster layer forward and 1-4 % faster backward on the H200
    (docs/perf-notes.md, "EP = 1 in-place combine")."""
    return knobs.get("MOK_EP1_COMBINE") == "rows" and ws.ep_size == 1


def route_rows(sched: MoKSchedule, num_tokens: int, topk: int) -> torch.Tensor:
    """[T, K] int32: the row-table row of route (t, k), -1 if it has none (EP = 1). The
    schedule's own map when it was built with one; else from the table (no host sync:
    padding rows write to a spare last entry, which is dropped)."""
    own = getattr(sched, "route_row", None)
    if own is not None:
        return own
    valid = sched.peer_rank >= 0
    key = torch.where(valid, sched.peer_token.long() * topk + sched.peer_k.long(),
                      num_tokens * topk)
    rows = torch.arange(key.numel(), dtype=torch.int32, device=key.device)
    table = torch.full((num_tokens * topk + 1,), -1, dtype=torch.int32, device=key.device)
    table.index_put_((key,), torch.where(valid, rows, -1))
    return table[:-1].view(num_tokens, topk)


def _gather_rows(x: torch.Tensor, sched: MoKSchedule) -> torch.Tensor:
    """x_rows of the row table at EP = 1 (padding rows zero), bit-equal to a pull."""
    valid = (sched.peer_rank >= 0).unsqueeze(1)
    rows = x[sched.peer_token.clamp(min=0).long()]
    return torch.where(valid, rows, torch.zeros((), dtype=x.dtype, device=x.device))


def forward(ws: MoKWorkspace, sched: MoKSchedule, x, topk_w, w1, w2, shared_w1, shared_w2,
            keep_ctx: bool, config: Optional[MoKConfig] = None):
    arena, topk = ws.arena, ws.topk
    config = config or MoKConfig()
    num_tokens, hidden = x.shape
    topk_idx = sched.topk_idx_all[ws.ep_rank]
    plan = autotune.forward_plan(ws, w1.shape[1] // 2, config)
    fused = gemm_core() == "mok" and plan.path != "launches"
    if ws.ep_size > 1 or not fused:  # the megakernel pulls straight from x at EP = 1
        arena.view("x").copy_(x)
    shared_out = shared_leaves = None
    if shared_w1 is not None:  # independent of the peers: runs before the barrier
        shared_out, shared_leaves = _shared_forward(x, shared_w1, shared_w2, keep_ctx)
    arena.barrier()
    zero_dropped_routes(ws, sched)
    direct = fused and ws.ep_size == 1 and plan.path == "megakernel"
    spread = fused and plan.path == "megakernel-spread"
    # In place: the combine reads the rows (chain, direct and spread megakernel); comm
    # CTAs push.
    in_place = rows_combine(ws) and (direct or spread or not fused)
    if fused:
        w1, w2 = w1.contiguous(), w2.contiguous()
        x_rows, act, h, y_rows = megakernel.moe_forward(
            ws, sched, x, w1, w2, save_h=keep_ctx,
            num_comm_sms=0 if spread else plan.num_comm_sms,
            minibatch_rows=plan.minibatch_rows, direct=direct, scatter=not in_place)
    else:
        x_rows, act, h, y_rows = _expert_launches(ws, sched, w1, w2, hidden, keep_ctx,
                                                  push=not in_place)
    arena.barrier()
    shared_y = None if shared_out is None else shared_out.detach()
    route_row = None
    if in_place:
        route_row = route_rows(sched, num_tokens, topk)
        y = ops.combine_rows(y_rows, route_row, topk_w.detach(), shared_y)
    else:
        topk_idx = routed_ids(ws, topk_idx)
        slots = arena.view("slots").view(num_tokens, topk, hidden)
        y = ops.combine_epilogue(slots, topk_idx, topk_w.detach(), shared_y)
    saved = None
    if keep_ctx:
        saved = KernelSaved(topk_idx, topk_w.detach(), w1.detach(), w2.detach(), x_rows, h, act,
                            y_rows, shared_out, shared_leaves, x.detach(), route_row, config)
    return y, saved


def routed_ids(ws: MoKWorkspace, topk_idx: torch.Tensor) -> torch.Tensor:
    """topk_idx with ids past the last expert set to -1: the slots combine reads slot
    (t, k) for every id >= 0, and no rank computes an invalid id's route (the schedule
    latched the error, routing_errors)."""
    return torch.where(topk_idx < ws.num_experts, topk_idx, -1)


def zero_dropped_routes(ws: MoKWorkspace, sched: MoKSchedule) -> None:
    """EP > 1, at the start of each pass (after its barrier): zero the slots of the routes
    this rank's table left out (overflow), on their source ranks, so their combine adds
    nothing rather than a row of another pass. One launch that returns at once when
    nothing was dropped."""
    if sched.dropped is None:
        return
    arena = ws.arena
    ops.zero_dropped_routes(arena.peer_base, arena.offset("slots"), arena.offset("d_topk_w"),
                            sched.dropped, ws.num_tokens, ws.topk, ws.hidden_size)


def _dgrad_launches(core: str, sched: MoKSchedule, saved: KernelSaved, d_out: torch.Tensor,
                    offs: torch.Tensor):
    """v1: fc2 dgrad + SwiGLU backward, then fc1 dgrad, as separate launches: (d_h, dx_rows)."""
    if core == "mok":
        d_h = grouped_gemm.dgrad_swiglu(d_out, saved.w2, saved.h, sched.expert_offsets,
                                        sched.num_rows)
        dx_rows = grouped_gemm.rows_matmul(d_h, saved.w1, sched.expert_offsets, sched.num_rows,
                                           w_transposed=True)
    else:
        d_act = torch._grouped_mm(d_out, saved.w2, offs=offs)
        d_h = _swiglu_backward(saved.h, d_act)
        dx_rows = torch._grouped_mm(d_h, saved.w1, offs=offs)
    return d_h, dx_rows


def _expert_launches(ws: MoKWorkspace, sched: MoKSchedule, w1, w2, hidden: int, keep_ctx: bool,
                     push: bool = True):
    """v1: pull, fc1 (+ SwiGLU), fc2 and push (unless the combine reads the rows in
    place) as separate launches."""
    arena = ws.arena
    x_rows = w1.new_empty(ws.capacity, hidden)
    ops.pull_rows(arena.peer_base, arena.offset("x"), sched, ws.topk, x_rows)
    if gemm_core() == "mok":
        w1, w2 = w1.contiguous(), w2.contiguous()
        act, h = grouped_gemm.fc1_swiglu(x_rows, w1, sched.expert_offsets, sched.num_rows,
                                         save_h=keep_ctx)
        y_rows = grouped_gemm.rows_matmul(act, w2, sched.expert_offsets, sched.num_rows)
    else:
        offs = sched.expert_offsets[1:]
        h = torch._grouped_mm(x_rows, w1.transpose(1, 2), offs=offs)
        act = _swiglu(h)
        y_rows = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    if push:
        ops.push_rows(y_rows, arena.peer_base, arena.offset("slots"), sched, ws.topk)
    return x_rows, act, h, y_rows


def _weight_grad(core: str, a: torch.Tensor, b: torch.Tensor, sched: MoKSchedule,
                 weight: torch.Tensor, acc) -> torch.Tensor:
    """dw[e] = a[rows of e]^T @ b[rows of e]: tokens are K, in row-table order; one GEMM
    owns each output tile. With an accumulator (grad_accumulation) the fp32 gradient goes
    into its buffers, in the wgrad's epilogue where they lie equally spaced."""
    offsets = sched.expert_offsets
    if core != "mok":
        dw = torch._grouped_mm(a.t(), b, offs=offsets[1:])
    elif acc is None:
        return grouped_gemm.wgrad(a, b, offsets)
    elif acc.fused_runs is not None:  # one launch per run of equally spaced buffers
        for first, count, planes, reverse in acc.fused_runs:
            grouped_gemm.wgrad(a, b, offsets[first:first + count + 1], accumulate_into=planes,
                               reverse_experts=reverse)
        return acc.finish(weight)
    else:
        dw = grouped_gemm.wgrad(a, b, offsets, out_dtype=torch.float32)
    if acc is None:
        return dw
    acc.add_(dw)
    return acc.finish(weight)


BACKWARD_WGRAD_PATHS = ("fused", "launches")


def backward_wgrad_path() -> str:
    """Where the backward megakernel leaves the weight gradients (MOK_BACKWARD_WGRAD):
    "launches" (default): the core's wgrad launches after it, as the launch chain does;
    "fused": its phase 2, in the same launch (the same bits; measured 0-5 % slower layer
    backward on the H200 at fe14702: docs/perf-notes.md, "backward megakernel phase 2")."""
    return knobs.get("MOK_BACKWARD_WGRAD")


def _fused_wgrad_targets(saved: KernelSaved, acc1, acc2):
    """The backward megakernel's phase-2 targets, or None where the weight gradients stay
    launches: MOK_BACKWARD_WGRAD=launches (the default), one weight frozen, or accumulators
    whose buffers are not one run of equally spaced planes each (those take one
    reduce-add wgrad launch per run, or an fp32 gradient and a separate add)."""
    if backward_wgrad_path() != "fused":
        return None
    if acc1 is None and acc2 is None:
        experts, two_inter, hidden = saved.w1.shape
        return megakernel.WgradTargets(
            saved.act, saved.x_rows, saved.w2.new_empty(experts, hidden, two_inter // 2),
            saved.w1.new_empty(experts, two_inter, hidden))
    if acc1 is None or acc2 is None or acc1.fused_target is None or acc2.fused_target is None:
        return None
    (planes1, reverse1), (planes2, reverse2) = acc1.fused_target, acc2.fused_target
    return megakernel.WgradTargets(saved.act, saved.x_rows, planes2, planes1, accumulate=True,
                                   reverse2=reverse2, reverse1=reverse1)


def backward(ws: MoKWorkspace, sched: MoKSchedule, saved: KernelSaved, dy: torch.Tensor,
             accumulators=None):
    """(dx, d_topk_w, dw1, dw2, d_shared_w1, d_shared_w2). accumulators: (w1's, w2's)
    ExpertGradAccumulator or None (functional.backward)."""
    acc1, acc2 = accumulators or (None, None)
    backward_wgrad_path()  # a bad MOK_BACKWARD_WGRAD raises before any work
    routing_errors.poll(ws.device)  # an error latched by an earlier pass's schedule
    arena, topk = ws.arena, ws.topk
    num_tokens, hidden = dy.shape
    core = gemm_core()
    # The backward megakernel (MOK_BACKWARD, else an autotuned plan): pull, fc2 dgrad +
    # SwiGLU backward, fc1 dgrad and (MOK_BACKWARD_WGRAD=fused) the weight gradients in
    # one launch; at EP = 1 it reads dy itself (nothing is published), at
    # EP > 1 it pulls from the peers' arenas and writes the owners' slots (no push launch).
    plan = autotune.backward_plan(ws, saved.w1.shape[1] // 2, saved.config, dy.dtype,
                                  saved.route_row is not None)
    fused = core == "mok" and plan.path == "megakernel"
    if not fused or ws.ep_size > 1:
        arena.view("dy").copy_(dy)
        arena.view("topk_w").copy_(saved.topk_w)
    d_shared = (None, None, None)
    if saved.shared_out is not None:  # local work first, while peers catch up
        d_shared = torch.autograd.grad(saved.shared_out, saved.shared_leaves, dy)
    arena.barrier()
    zero_dropped_routes(ws, sched)
    offs = sched.expert_offsets[1:]
    if saved.x_rows is None:  # the direct megakernel gathered x on the fly
        saved.x_rows = _gather_rows(saved.x, sched)
    wgrad = _fused_wgrad_targets(saved, acc1, acc2) if fused else None
    if fused:
        d_out, dots, d_h, dx_rows = megakernel.moe_backward(
            ws, sched, dy.contiguous(), saved.topk_w, saved.w1.contiguous(),
            saved.w2.contiguous(), saved.h, saved.y_rows, minibatch_rows=plan.minibatch_rows,
            wgrad=wgrad)
    else:
        d_out = dy.new_empty(ws.capacity, hidden)
        dots = torch.empty(ws.capacity, dtype=torch.float32, device=dy.device)
        ops.pull_rows(arena.peer_base, arena.offset("dy"), sched, topk, d_out,
                      w_offset=arena.offset("topk_w"), saved=saved.y_rows, dots=dots)
    if not fused:
        d_h, dx_rows = _dgrad_launches(core, sched, saved, d_out, offs)
    if saved.route_row is None and not fused:  # the megakernel wrote the slots itself
        ops.push_rows(dx_rows, arena.peer_base, arena.offset("slots"), sched, topk,
                      scalars=dots, scalar_offset=arena.offset("d_topk_w"))
    if wgrad is None:
        dw2 = _weight_grad(core, d_out, saved.act, sched, saved.w2, acc2)
        dw1 = _weight_grad(core, d_h, saved.x_rows, sched, saved.w1, acc1)
    elif wgrad.accumulate:  # phase 2 added them into the main_grads
        dw2, dw1 = acc2.finish(saved.w2), acc1.finish(saved.w1)
    else:
        dw2, dw1 = wgrad.dw2, wgrad.dw1
    arena.barrier()
    routed = saved.topk_idx >= 0
    ones = routed.to(torch.float32)
    if saved.route_row is not None:  # EP = 1, rows read in place
        dx = ops.combine_rows(dx_rows, saved.route_row, ones, d_shared[0])
        d_topk_w = torch.where(saved.route_row >= 0,
                               dots[saved.route_row.clamp(min=0).long()], 0.0)
    else:
        slots = arena.view("slots").view(num_tokens, topk, hidden)
        dx = ops.combine_epilogue(slots, saved.topk_idx, ones, d_shared[0])
        d_topk_w = torch.where(routed, arena.view("d_topk_w").view(num_tokens, topk), 0.0)
    return dx, d_topk_w, dw1, dw2, d_shared[1], d_shared[2]
