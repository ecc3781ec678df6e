"""The GPU pass, v1 (DESIGN.md section 4 as a sequence of launches, no host sync).

Forward, per rank:  publish x -> barrier -> pull rows of x into row-table order ->
grouped GEMM fc1 -> SwiGLU -> grouped GEMM fc2 -> push rows into the owners'
(t, k) slots -> barrier -> fp32 combine epilogue (+ shared expert). At EP = 1 by
default (spread mode), with MOK_FORWARD=megakernel*, or with a cached autotune plan that
measured it fastest (megatron_mok.kernels.autotune), the steps from pull to push run as one
launch, the forward megakernel (megatron_mok.kernels.megakernel); MOK_FORWARD=launches keeps
this chain.

Backward: publish dy and the router weights -> barrier -> pull dy rows and their
router weights -> fc2 dgrad with the weight and the SwiGLU backward in its epilogue (which
also gives <dy, y_tk> per route for d_topk_w, from SwiGLU(h) recomputed: no y rows are kept,
and w * act for dW2) -> fc1 dgrad -> push dx rows and d_topk_w into the owners' slots ->
weight gradients (one grouped GEMM per weight, tokens as K in row-table order) ->
barrier -> dx = shared dx + sum_k slots in fp32. With MOK_BACKWARD=megakernel (opt-in,
or an autotuned plan) the steps from pull to the dx rows run as one launch, the backward
megakernel (megatron_mok.kernels.megakernel.moe_backward); with MOK_BACKWARD_WGRAD=fused too the
weight gradients run in that launch (its phase 2) instead of the core's launches.

At EP = 1 (MOK_EP1_COMBINE=rows, the default; `slots` restores the pushes) there are
no pushes: both combines read the expert rows in place through route_rows
(ops.combine_rows), bit-equal to the slots path.

Launch shapes depend only on the workspace (capacity), never on the routing, so the
pass is CUDA-graph capturable. The megakernel issues replace these launches one by
one behind the same functions.

Expert GEMMs run on our Hopper grouped-GEMM core (megatron_mok.kernels.grouped_gemm: fc1 with
SwiGLU in the epilogue, fc2 dgrad with the SwiGLU backward in the epilogue, weight
gradients with tokens as K). MOK_GEMM_CORE=torch selects the `torch._grouped_mm` path
instead (side-by-side benchmarks); `gemm_core()` says which one runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_mok import knobs, routing_errors
from megatron_mok.config import MoKConfig
from megatron_mok.kernels import (autotune, fp8_gemm, fp8_weight_cache, grouped_gemm,
                                  megakernel, ops)
from megatron_mok.kernels.launch_chain import (KernelSaved, backward_wgrad_path, bias_grads,
                                               dgrad_launches, expert_launches,
                                               fused_wgrad_targets, gather_rows, gemm_core,
                                               rows_combine, shared_forward, weight_grad)
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


def backward_minibatch() -> int:
    """Rows per readiness counter of the backward megakernel (MOK_BACKWARD_MINIBATCH,
    default 2048: the forward's best at T = 8192, perf-notes v7)."""
    return int(knobs.get("MOK_BACKWARD_MINIBATCH"))


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


def forward(ws: MoKWorkspace, sched: MoKSchedule, x, topk_w, w1, w2, shared_w1, shared_w2,
            keep_ctx: bool, config: Optional[MoKConfig] = None, b1=None, b2=None,
            fp8_cache: Optional[fp8_weight_cache.Fp8WeightCache] = None):
    """(y, KernelSaved or None). The experts' activation comes from config (SwiGLU, or a
    GLU the epilogues run: ExpertActivation.kernel_runs); b1 / b2 their biases. FP8: the
    weights from fp8_cache (quantised once per step where it reuses them), else per pass."""
    arena, topk = ws.arena, ws.topk
    config = config or MoKConfig()
    activation = config.activation
    num_tokens, hidden = x.shape
    topk_idx = sched.topk_idx_all[ws.ep_rank]
    inter = w1.shape[1] // activation.fc1_rows_per_inter
    plan = autotune.forward_plan(ws, inter, config)
    fused = gemm_core() == "mok" and plan.path != "launches"
    if fused and (not activation.gated or config.fp8):  # the plans keep them on the chain
        raise RuntimeError("megatron_mok: the forward megakernel runs BF16 GLU experts only")
    # The megakernel pulls straight from x at EP = 1; so does the FP8 chain (E4M3 rows).
    if ws.ep_size > 1 or not (fused or config.fp8):
        arena.view("x").copy_(x)
    shared_out = shared_leaves = None
    if shared_w1 is not None:  # independent of the peers: runs before the barrier
        shared_out, shared_leaves = shared_forward(x, shared_w1, shared_w2, keep_ctx, activation)
    arena.barrier()
    zero_dropped_routes(ws, sched)
    direct = fused and ws.ep_size == 1 and plan.path == "megakernel"
    spread = fused and plan.path == "megakernel-spread"
    # In place: the combine reads the rows (chain, direct and spread megakernel); comm
    # CTAs push.
    in_place = rows_combine(ws) and (direct or spread or not fused)
    fp8 = None
    if fused:
        w1, w2 = w1.contiguous(), w2.contiguous()
        x_rows, act, h, y_rows = megakernel.moe_forward(
            ws, sched, x, w1, w2, save_h=keep_ctx,
            num_comm_sms=0 if spread else plan.num_comm_sms,
            minibatch_rows=plan.minibatch_rows, direct=direct, scatter=not in_place,
            b1=b1, b2=b2, glu=activation.kernel_glu)
    else:
        # FP8: the weights in 128 x 128 blocks, both layouts, on the device (the backward's
        # dgrads read the transposed ones kept here).
        fp8 = (fp8_cache or fp8_weight_cache.Fp8WeightCache()).weights(w1, w2) \
            if config.fp8 else None
        x_rows, act, h, y_rows = expert_launches(ws, sched, w1, w2, hidden, keep_ctx,
                                                  push=not in_place, activation=activation,
                                                  b1=b1, b2=b2, fp8=fp8,
                                                  x=x if fp8 is not None and ws.ep_size == 1
                                                  else None)
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
    if x_rows is not None and not wgrad_reads_x_rows(ws, x):
        x_rows = None  # the chain's rows die here: dW1 gathers them from x (MOK_WGRAD_GATHER)
    saved = None
    if keep_ctx:  # act and y_rows are not kept: the backward recomputes what it needs from h
        saved = KernelSaved(topk_idx, topk_w.detach(), w1.detach(), w2.detach(), x_rows, h,
                            shared_out, shared_leaves, x.detach(), route_row, config,
                            None if b1 is None else b1.detach(),
                            None if b2 is None else b2.detach(),
                            fp8)
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


def data_gradients(ws: MoKWorkspace, sched: MoKSchedule, saved: KernelSaved, dy: torch.Tensor,
                   fused: bool, minibatch_rows: int,
                   wgrad: Optional[megakernel.WgradTargets] = None) -> megakernel.DataGradients:
    """The routed experts' data gradients after the backward's barrier: the backward
    megakernel (`fused`; at EP > 1 it writes the dx rows into the owners' slots itself) or
    the launch chain (pull dy rows and weights from the published arena, fc2 dgrad + SwiGLU
    backward, fc1 dgrad). The same bits either way."""
    if fused:
        return megakernel.moe_backward(ws, sched, dy.contiguous(), saved.topk_w,
                                       saved.w1.contiguous(), saved.w2.contiguous(), saved.h,
                                       minibatch_rows=minibatch_rows, wgrad=wgrad,
                                       glu=saved.activation.kernel_glu)
    if fp8_reads_dy_in_place(ws, saved):
        # One pass: dy's rows gathered, quantised (the FP8 dgrad's A) and kept in bf16 (the
        # weight gradients' rows), with their router weights: the bits of the pull below
        # and of quantising the pulled rows. MOK_WGRAD_GATHER=1: no bf16 rows (None), dW2's
        # launch gathers them from dy.
        keep_rows = not wgrad_gathers_dy(ws, saved, dy)
        dy_fp8, dy_rows, row_w = fp8_gemm.gather_quantize_rows(
            dy.contiguous(), sched, topk_w=saved.topk_w.contiguous(), keep_rows=keep_rows)
        return dgrad_launches(gemm_core(), sched, saved, dy_rows, row_w,
                              sched.expert_offsets[1:], dy_fp8)
    arena = ws.arena
    dy_rows = dy.new_empty(ws.capacity, dy.shape[1])
    row_w = torch.empty(ws.capacity, dtype=torch.float32, device=dy.device)
    ops.pull_rows(arena.peer_base, arena.offset("dy"), sched, ws.topk, dy_rows,
                  w_offset=arena.offset("topk_w"), row_w=row_w)
    return dgrad_launches(gemm_core(), sched, saved, dy_rows, row_w, sched.expert_offsets[1:])


def wgrad_reads_x_rows(ws: MoKWorkspace, x: torch.Tensor) -> bool:
    """Whether the backward's dW1 reads materialised x rows, so that a forward which made
    them keeps them: not where MOK_WGRAD_GATHER=1 lets dW1 gather from x (EP = 1, the mok
    core, weight gradients as launches); there the backward keeps x only, as SonicMoE's
    (qwen3-30b-a3b, T = 8192: 256 MiB less saved per layer)."""
    return not (knobs.get("MOK_WGRAD_GATHER") == "1" and gemm_core() == "mok"
                and ws.ep_size == 1 and x.shape[0] > 0 and x.shape[1] % 64 == 0
                and backward_wgrad_path() == "launches")


def wgrad_gathers_x(ws: MoKWorkspace, core: str, fused: bool, saved: KernelSaved) -> bool:
    """MOK_WGRAD_GATHER=1 at EP = 1 (x kept, its rows never made): dW1's launch gathers x's
    rows in its producer instead of reading materialised x rows (the same bits). Not with
    the backward megakernel's fused weight gradients, which read the rows."""
    if knobs.get("MOK_WGRAD_GATHER") != "1" or core != "mok" or ws.ep_size != 1:
        return False
    x = saved.x
    if x is None or saved.x_rows is not None or x.shape[0] == 0 or x.shape[1] % 64:
        return False
    return not fused or backward_wgrad_path() == "launches"


def expert_weight_grads(core: str, sched: MoKSchedule, saved: KernelSaved, dy: torch.Tensor,
                        grads: megakernel.DataGradients, gather_x: bool, acc1=None, acc2=None):
    """(dw2, dw1) as the core's launches: dW2 = dy_rows^T act_scaled (dy's rows gathered
    from dy where the data gradients made none: wgrad_gathers_dy), dW1 = d_h^T x_rows (x's
    rows gathered from x with gather_x)."""
    if grads.dy_rows is None:
        dw2 = weight_grad(core, dy.contiguous(), grads.act_scaled, sched, saved.w2, acc2,
                          gathered="a")
    else:
        dw2 = weight_grad(core, grads.dy_rows, grads.act_scaled, sched, saved.w2, acc2)
    if gather_x:
        dw1 = weight_grad(core, grads.d_h, saved.x.contiguous(), sched, saved.w1, acc1,
                          gathered="b")
    else:
        dw1 = weight_grad(core, grads.d_h, saved.x_rows, sched, saved.w1, acc1)
    return dw2, dw1


def wgrad_gathers_dy(ws: MoKWorkspace, saved: KernelSaved, dy: torch.Tensor) -> bool:
    """MOK_WGRAD_GATHER=1 on the FP8 chain at EP = 1: dW2's launch gathers dy's rows from dy
    (the one-pass gather then writes no bf16 rows). The BF16 paths keep the rows their
    pulls or the backward megakernel write."""
    return (knobs.get("MOK_WGRAD_GATHER") == "1" and gemm_core() == "mok"
            and fp8_reads_dy_in_place(ws, saved) and dy.shape[0] > 0
            and dy.shape[1] % 64 == 0)


def fp8_reads_dy_in_place(ws: MoKWorkspace, saved: KernelSaved) -> bool:
    """The FP8 chain at EP = 1 gathers dy's rows from dy itself (nothing is published)."""
    return saved.fp8 is not None and ws.ep_size == 1


def backward(ws: MoKWorkspace, sched: MoKSchedule, saved: KernelSaved, dy: torch.Tensor,
             accumulators=None):
    """(dx, d_topk_w, dw1, dw2, d_shared_w1, d_shared_w2, db1, db2); db1 / db2 None
    without expert biases. accumulators: (w1's, w2's) ExpertGradAccumulator or None
    (functional.backward)."""
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
    activation = saved.activation
    plan = autotune.backward_plan(ws, saved.w1.shape[1] // activation.fc1_rows_per_inter,
                                  saved.config, dy.dtype, saved.route_row is not None)
    fused = core == "mok" and plan.path == "megakernel"
    if fused and not activation.gated:
        raise RuntimeError("megatron_mok: the backward megakernel runs GLU experts only")
    if (not fused or ws.ep_size > 1) and not fp8_reads_dy_in_place(ws, saved):
        arena.view("dy").copy_(dy)
        arena.view("topk_w").copy_(saved.topk_w)
    d_shared = (None, None, None)
    if saved.shared_out is not None:  # local work first, while peers catch up
        d_shared = torch.autograd.grad(saved.shared_out, saved.shared_leaves, dy)
    arena.barrier()
    zero_dropped_routes(ws, sched)
    gather_x = wgrad_gathers_x(ws, core, fused, saved)
    if saved.x_rows is None and not gather_x:
        # the direct megakernel or the FP8 chain gathered x on the fly: dW1 needs its rows
        saved.x_rows = gather_rows(saved.x, sched)
    wgrad = fused_wgrad_targets(saved, acc1, acc2) if fused else None
    grads = data_gradients(ws, sched, saved, dy, fused, plan.minibatch_rows, wgrad)
    dots = grads.dots()  # <dy, act @ w2^T> per row
    if saved.b2 is not None:  # y_row includes fc2's bias: d_topk_w gets <dy, b2[e]> too
        dots = dots + grouped_gemm.segment_row_dots(grads.dy_rows, saved.b2.contiguous(),
                                                    sched.expert_offsets, sched.num_rows)
    db1, db2 = bias_grads(saved, grads, sched)
    if saved.route_row is None:  # EP > 1: d_topk_w (and the chain's dx rows) to the owners
        ops.push_rows(None if fused else grads.dx_rows, arena.peer_base, arena.offset("slots"),
                      sched, topk, scalars=dots, scalar_offset=arena.offset("d_topk_w"))
    if wgrad is None:
        dw2, dw1 = expert_weight_grads(core, sched, saved, dy, grads, gather_x, acc1, acc2)
    elif wgrad.accumulate:  # phase 2 added them into the main_grads
        dw2, dw1 = acc2.finish(saved.w2), acc1.finish(saved.w1)
    else:
        dw2, dw1 = wgrad.dw2, wgrad.dw1
    arena.barrier()
    if saved.route_row is not None:  # EP = 1, rows read in place
        dx = ops.combine_rows(grads.dx_rows, saved.route_row, ws.unit_weights(), d_shared[0])
        # d_topk_w[t, k] = dots[row of (t, k)], 0 without a row: route_row -1 picks the
        # padded 0 at the end (two ops instead of five; the same bits).
        d_topk_w = F.pad(dots, (0, 1))[saved.route_row]
    else:
        routed = saved.topk_idx >= 0
        ones = routed.to(torch.float32)
        slots = arena.view("slots").view(num_tokens, topk, hidden)
        dx = ops.combine_epilogue(slots, saved.topk_idx, ones, d_shared[0])
        d_topk_w = torch.where(routed, arena.view("d_topk_w").view(num_tokens, topk), 0.0)
    return dx, d_topk_w, dw1, dw2, d_shared[1], d_shared[2], db1, db2
