"""The steps of the kernel pass as separate launches (the v1 chain), and what the forward
saves for the backward.

The kernel backend (kernels.backend) strings these together when a pass does not run as
a megakernel, and the tuner (kernels.tuning) times them against the megakernel
plans; both import them from here, so neither reaches into the other. Expert GEMMs run
on our Hopper grouped-GEMM core (kernels.grouped_gemm) or, with MOK_GEMM_CORE=torch, on
`torch._grouped_mm` (side-by-side benchmarks).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_mok import knobs
from megatron_mok.activations import SWIGLU, ExpertActivation, activation_backward
from megatron_mok.config import MoKConfig
from megatron_mok.kernels import fp8_gemm, grouped_gemm, megakernel, ops
from megatron_mok.schedule import MoKSchedule
from megatron_mok.workspace import MoKWorkspace


GEMM_CORES = ("mok", "torch")


def gemm_core() -> str:
    """"mok" (our grouped-GEMM core, the default when built) or "torch" (_grouped_mm)."""
    core = knobs.get("MOK_GEMM_CORE")
    if core == "mok" and not grouped_gemm.available():
        raise RuntimeError("megatron_mok: the extension was built without the grouped-GEMM "
                           "core; rebuild it or set MOK_GEMM_CORE=torch")
    return core


def shared_forward(x, shared_w1, shared_w2, keep_graph: bool,
                   activation: ExpertActivation = SWIGLU):
    """Shared expert on this rank's tokens (BF16 GEMMs); keeps its graph for backward."""
    leaves = tuple(t.detach().requires_grad_(keep_graph) for t in (x, shared_w1, shared_w2))
    with torch.enable_grad() if keep_graph else torch.no_grad():
        act = activation(leaves[0] @ leaves[1].t()).to(x.dtype)
        out = act @ leaves[2].t()
    return out, leaves


@dataclasses.dataclass
class KernelSaved:
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    x_rows: torch.Tensor       # [capacity, H] routed tokens, row-table order
    h: torch.Tensor            # [capacity, 2I] fc1 output (gate; up), [capacity, I] for
                               # non-gated experts; the backward recomputes the activation
                               # from it (no act or y rows are kept)
    shared_out: Optional[torch.Tensor]
    shared_leaves: Optional[tuple]
    x: Optional[torch.Tensor] = None  # EP = 1 direct megakernel: x_rows is gathered again
    route_row: Optional[torch.Tensor] = None  # EP = 1 rows combine: row of route (t, k)
    config: Optional[MoKConfig] = None  # the forward's (the backward plan's autotune flag;
                                        # the activation)
    b1: Optional[torch.Tensor] = None   # the experts' biases (their gradients' dtype), or None
    b2: Optional[torch.Tensor] = None
    fp8: Optional[tuple] = None  # FP8 passes: (w1, w2) as fp8_gemm.Fp8Weight, both layouts

    @property
    def activation(self) -> ExpertActivation:
        return self.config.activation if self.config is not None else SWIGLU



def gather_rows(x: torch.Tensor, sched: MoKSchedule) -> torch.Tensor:
    """x_rows of the row table at EP = 1 (padding rows zero), bit-equal to a pull."""
    # Padding rows gather a zero row appended to x: one index_select over the rows (a
    # copy of x, 1 / K of their bytes, instead of a masking pass over all of them).
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    token = torch.where(sched.peer_rank >= 0, sched.peer_token, x.shape[0]).long()
    return padded.index_select(0, token)



def dgrad_launches(core: str, sched: MoKSchedule, saved: KernelSaved, dy_rows: torch.Tensor,
                   row_w: torch.Tensor, offs: torch.Tensor,
                   dy_fp8: Optional[tuple] = None) -> megakernel.DataGradients:
    """v1: fc2 dgrad with the router weights and the activation's backward, then fc1 dgrad,
    as separate launches, from the pulled dy rows and their weights. dy_fp8: FP8 passes at
    EP = 1, the dy rows already quantised (per token, then gathered)."""
    activation = saved.activation
    if saved.fp8 is not None:  # blockwise FP8 (SwiGLU experts on the core)
        d_h, dots_part, act_scaled, dx_rows = fp8_gemm.expert_dgrad(
            dy_fp8 if dy_fp8 is not None else dy_rows, row_w, *saved.fp8, saved.h,
            sched.expert_offsets, sched.num_rows)
    elif core == "mok" and not activation.gated:
        d_h, dots_part, act_scaled = grouped_gemm.dgrad_act_routed(
            dy_rows, row_w, saved.w2, saved.h, sched.expert_offsets, sched.num_rows, activation)
        dx_rows = grouped_gemm.rows_matmul(d_h, saved.w1, sched.expert_offsets, sched.num_rows,
                                           w_transposed=True)
    elif core == "mok":
        d_h, dots_part, act_scaled = grouped_gemm.dgrad_swiglu_routed(
            dy_rows, row_w, saved.w2, saved.h, sched.expert_offsets, sched.num_rows,
            glu=activation.kernel_glu)
        dx_rows = grouped_gemm.rows_matmul(d_h, saved.w1, sched.expert_offsets, sched.num_rows,
                                           w_transposed=True)
    else:
        acc = torch._grouped_mm(dy_rows, saved.w2, offs=offs).float()
        act = activation(saved.h)
        dots_part = (acc * act).sum(1, keepdim=True)
        w = row_w.unsqueeze(1)
        d_h = activation_backward(activation, saved.h, w * acc).to(saved.h.dtype)
        act_scaled = (w * act).to(dy_rows.dtype)
        dx_rows = torch._grouped_mm(d_h, saved.w1, offs=offs)
    return megakernel.DataGradients(dy_rows, row_w, dots_part, act_scaled, d_h, dx_rows)


def expert_launches(ws: MoKWorkspace, sched: MoKSchedule, w1, w2, hidden: int, keep_ctx: bool,
                     push: bool = True, activation: ExpertActivation = SWIGLU, b1=None, b2=None,
                     fp8: Optional[tuple] = None, x: Optional[torch.Tensor] = None):
    """v1: pull, fc1 (+ b1, + the activation), fc2 (+ b2) and push (unless the combine
    reads the rows in place) as separate launches. fp8: (w1, w2) as fp8_gemm.Fp8Weight: the
    blockwise-FP8 GEMMs (SwiGLU experts; act is then not returned); with x (EP = 1) the
    rows of x are gathered and quantised in one pass, and no bf16 x rows are made (x_rows None:
    the backward gathers them for the weight gradients)."""
    arena = ws.arena
    if fp8 is not None and x is not None:
        act = x_rows = None
        rows = fp8_gemm.gather_quantize_rows(x.contiguous(), sched)[0]
        y_rows, h = fp8_gemm.expert_forward(rows, *fp8, sched.expert_offsets, sched.num_rows,
                                            save_h=keep_ctx)
        if push:
            ops.push_rows(y_rows, arena.peer_base, arena.offset("slots"), sched, ws.topk)
        return x_rows, act, h, y_rows
    x_rows = w1.new_empty(ws.capacity, hidden)
    ops.pull_rows(arena.peer_base, arena.offset("x"), sched, ws.topk, x_rows)
    if fp8 is not None:
        act = None
        y_rows, h = fp8_gemm.expert_forward(x_rows, *fp8, sched.expert_offsets, sched.num_rows,
                                            save_h=keep_ctx)
    elif gemm_core() == "mok":
        w1, w2 = w1.contiguous(), w2.contiguous()
        if activation.gated:
            act, h = grouped_gemm.fc1_swiglu(x_rows, w1, sched.expert_offsets, sched.num_rows,
                                             save_h=keep_ctx, bias=b1, glu=activation.kernel_glu)
        else:
            act, h = grouped_gemm.fc1_act(x_rows, w1, sched.expert_offsets, sched.num_rows,
                                          activation, save_h=keep_ctx, bias=b1)
        y_rows = grouped_gemm.rows_matmul(act, w2, sched.expert_offsets, sched.num_rows,
                                          bias=b2)
    else:
        offs = sched.expert_offsets[1:]
        h = torch._grouped_mm(x_rows, w1.transpose(1, 2), offs=offs)
        # Per row the bias of the row's expert (padding rows too), an fp32 add and one
        # rounding, as the kernels' epilogues (this path: MOK_GEMM_CORE=torch).
        experts = None if b1 is None and b2 is None else row_experts(sched, h.shape[0])
        if b1 is not None:
            h = (h.float() + b1.float()[experts]).to(x_rows.dtype)
        act = activation(h).to(h.dtype)
        y_rows = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        if b2 is not None:
            y_rows = (y_rows.float() + b2.float()[experts]).to(y_rows.dtype)
    if push:
        ops.push_rows(y_rows, arena.peer_base, arena.offset("slots"), sched, ws.topk)
    return x_rows, act, h, y_rows


def row_experts(sched: MoKSchedule, rows: int) -> torch.Tensor:
    """[rows] int64: the expert of each row-table row (the last expert past the segments)."""
    r = torch.arange(rows, device=sched.expert_offsets.device, dtype=torch.int32)
    e = torch.searchsorted(sched.expert_offsets[1:], r, right=True)
    return e.clamp(max=sched.expert_offsets.numel() - 2)


def bias_grads(saved: KernelSaved, grads: "megakernel.DataGradients", sched: MoKSchedule):
    """(db1, db2) in the biases' dtype, or (None, None) without biases: per-expert column
    sums of d_h and of the router-weighted dy rows (deterministic, row order)."""
    if saved.b1 is None and saved.b2 is None:
        return None, None
    offsets, num_rows = sched.expert_offsets, sched.num_rows
    db1 = db2 = None
    if saved.b1 is not None:
        db1 = grouped_gemm.segment_column_sums(grads.d_h, offsets, num_rows).to(saved.b1.dtype)
    if saved.b2 is not None:
        db2 = grouped_gemm.segment_column_sums(grads.dy_rows, offsets, num_rows,
                                               scale=grads.row_w).to(saved.b2.dtype)
    return db1, db2


def weight_grad(core: str, a: torch.Tensor, b: torch.Tensor, sched: MoKSchedule,
                 weight: torch.Tensor, acc, gathered: str = "") -> torch.Tensor:
    """dw[e] = a[rows of e]^T @ b[rows of e]: tokens are K, in row-table order; one GEMM
    owns each output tile. With an accumulator (grad_accumulation) the fp32 gradient goes
    into its buffers, in the wgrad's epilogue where they lie equally spaced. gathered ("a",
    "b"; the core only, EP = 1): that operand is the tokens and the kernel gathers the row
    table's rows of it."""
    offsets = sched.expert_offsets
    gather = (sched.peer_rank, sched.peer_token) if gathered else None
    kw = dict(gather=gather, gathered=gathered) if gathered else {}
    if core != "mok":
        if gathered:
            raise ValueError("megatron_mok: the gathered weight gradient runs on the mok core")
        dw = torch._grouped_mm(a.t(), b, offs=offsets[1:])
    elif acc is None:
        return grouped_gemm.wgrad(a, b, offsets, **kw)
    elif acc.fused_runs is not None:  # one launch per run of equally spaced buffers
        for first, count, planes, reverse in acc.fused_runs:
            grouped_gemm.wgrad(a, b, offsets[first:first + count + 1], accumulate_into=planes,
                               reverse_experts=reverse, **kw)
        return acc.finish(weight)
    else:
        dw = grouped_gemm.wgrad(a, b, offsets, out_dtype=torch.float32, **kw)
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


def fused_wgrad_targets(saved: KernelSaved, acc1, acc2):
    """The backward megakernel's phase-2 targets, or None where the weight gradients stay
    launches: MOK_BACKWARD_WGRAD=launches (the default), one weight frozen, or accumulators
    whose buffers are not one run of equally spaced planes each (those take one
    reduce-add wgrad launch per run, or an fp32 gradient and a separate add)."""
    if backward_wgrad_path() != "fused":
        return None
    if acc1 is None and acc2 is None:
        experts, two_inter, hidden = saved.w1.shape
        return megakernel.WgradTargets(
            saved.x_rows, saved.w2.new_empty(experts, hidden, two_inter // 2),
            saved.w1.new_empty(experts, two_inter, hidden))
    if acc1 is None or acc2 is None or acc1.fused_target is None or acc2.fused_target is None:
        return None
    (planes1, reverse1), (planes2, reverse2) = acc1.fused_target, acc2.fused_target
    return megakernel.WgradTargets(saved.x_rows, planes2, planes1, accumulate=True,
                                   reverse2=reverse2, reverse1=reverse1)


def rows_combine(ws: MoKWorkspace) -> bool:
    """MOK_EP1_COMBINE=rows (the default; EP = 1 only): the combines of the forward and the
    backward read the expert rows in place (ops.combine_rows) instead of pushing them into
    (t, k) slots first: one pass over the rows fewer each way. Bit-equal to `slots`;
    measured 3-6 % faster layer forward and 1-4 % faster backward on the H200
    (docs/perf-notes.md, "EP = 1 in-place combine")."""
    return knobs.get("MOK_EP1_COMBINE") == "rows" and ws.ep_size == 1
