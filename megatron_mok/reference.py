"""The spec of the fused MoE pass, in pure PyTorch (DESIGN.md section 1).

Per rank r of an EP group of P ranks with E experts (E_loc = E / P local experts,
global expert e lives on rank e // E_loc):

    y[t] = shared(x_t) + sum_k w[t,k] * fc2_e(silu(g) * u),   [g; u] = fc1_e x_t,  e = idx[t,k]

(SwiGLU by default; megatron_mok.activations holds the other expert activations.)

Precision contract: operands in x.dtype, fp32 accumulation, the SwiGLU output
rounded to x.dtype before fc2, every expert output row (and the shared output)
rounded to x.dtype, the k-sum in fp32 in fixed k order, rounded once. `-1` routes
contribute nothing. For an fp32 model every rounding point is the identity.

The rounding points are straight-through in backward: gradients are the exact
fp32 gradients of the rounded forward, so the reference has no gradient rounding
of its own (backends are compared against it with a tolerance).

Runs on CPU and GPU, with autograd; EP > 1 goes over torch.distributed (gloo on
CPU works) and is deterministic: every (t, k) slot has exactly one writer, so
the cross-rank sum that returns the slots to their owners adds only zeros.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_mok.activations import SWIGLU, ExpertActivation
from megatron_mok.validation import check_expert_biases, check_moe_inputs, \
    check_same_shape_across_ranks


class _RoundTo(torch.autograd.Function):
    """Round to `dtype` and back in forward; identity in backward (straight-through)."""

    @staticmethod
    def forward(ctx, t, dtype):
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == t.dtype:
        return t
    return _RoundTo.apply(t, dtype)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ||a - b|| / ||b||, summed in float64: the metric every tolerance
    against this spec is stated in (BF16 backends <= 1e-2). Works through the tensors in
    chunks, so comparing two multi-GB gradients does not need float64 copies of them."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"rel_l2 of tensors with {a.numel()} and {b.numel()} elements")
    err = ref = 0.0
    step = 1 << 24
    for i in range(0, a.numel(), step):
        ai, bi = a[i:i + step].double(), b[i:i + step].double()
        err += float(((ai - bi) ** 2).sum())
        ref += float((bi ** 2).sum())
    return (err ** 0.5) / max(ref ** 0.5, 1e-30)


def expert_mlp(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype,
               activation: ExpertActivation = SWIGLU, b1: Optional[torch.Tensor] = None,
               b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One expert on fp32 rows: fc1 (+ b1) -> activation -> round -> fc2 (+ b2) -> round.

    w1 is [2I, H] = [gate; up] (Megatron's GLU layout) for gated activations, [I, H]
    otherwise; w2 is [H, I]; optional biases b1 [2I] (or [I]) and b2 [H] (GPT-OSS's). The
    routing weight later scales the whole output, b2 included, as Megatron's experts do
    (p * (fc2(act) + b2)).
    """
    h = rows @ w1.float().t()
    if b1 is not None:
        h = h + b1.float()
    act = round_to(activation(h), dtype)
    out = act @ w2.float().t()
    if b2 is not None:
        out = out + b2.float()
    return round_to(out, dtype)


def swiglu_expert(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """expert_mlp with SwiGLU (the default expert)."""
    return expert_mlp(rows, w1, w2, dtype, SWIGLU)


class _AllGatherRows(torch.autograd.Function):
    """Concatenate every rank's rows; backward sums the gradients and keeps this rank's block."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _ReturnRows(torch.autograd.Function):
    """Each rank holds rows for every rank's tokens, exactly one rank writing each row
    (the others hold zeros): sum over ranks and keep this rank's block. Exact, since
    only zeros are added. Backward hands every rank the full gradient."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        total = t.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(dist.get_world_size(group))[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _ep_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def routed_slots(x: torch.Tensor, topk_idx: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 group=None, topk_idx_all: Optional[torch.Tensor] = None,
                 activation: ExpertActivation = SWIGLU, b1: Optional[torch.Tensor] = None,
                 b2: Optional[torch.Tensor] = None, expert_fn=None,
                 route_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Expert output of every (t, k) route of this rank's tokens: [T, K, H] in fp32
    (values already rounded to x.dtype; -1 routes are zero rows). `topk_idx_all`
    [P, T, K], when the caller already gathered it, saves the routing all-gather.
    expert_fn(rows, e) -> out rows: local expert e's MLP on its rows (fp32, in (rank,
    token, k) order), instead of expert_mlp (the FP8 spec's experts). route_weights [T, K]
    (with expert_fn): every route's router weight reaches the expert's rank and
    expert_fn(rows, e, w_rows) applies it; the slots then come back weighted (combine them
    with unit weights)."""
    ep_size, ep_rank = _ep_size_rank(group)
    num_tokens, topk = topk_idx.shape
    num_local_experts = w1.shape[0]
    xf = x.float()
    if ep_size > 1:
        x_all = _AllGatherRows.apply(xf, group)
        idx_all = gather_routing(topk_idx, group) if topk_idx_all is None else topk_idx_all
        idx_all = idx_all.reshape(-1, topk)
    else:
        x_all, idx_all = xf, topk_idx
    flat_idx = idx_all.reshape(-1)
    # Every input stays in the graph even when no route reaches this rank (or an expert):
    # the backward's collectives then run on every rank, and unused experts get zero
    # gradients rather than None. Adds exact zeros.
    anchor = x_all[:0].sum() + (w1.float().sum() + w2.float().sum()) * 0
    for bias in (b1, b2):
        if bias is not None:
            anchor = anchor + bias.float().sum() * 0
    w_flat = None
    if route_weights is not None:
        w_all = route_weights.float()
        if ep_size > 1:
            w_all = _AllGatherRows.apply(w_all, group)
        anchor = anchor + w_all[:0].sum()  # its backward's collective runs on every rank
        w_flat = w_all.reshape(-1)
    slots = xf.new_zeros(flat_idx.numel(), x.shape[1]) + anchor
    first_expert = ep_rank * num_local_experts
    for e in range(num_local_experts):
        # Routes to this expert in (rank, token, k) order.
        route_ids = (flat_idx == first_expert + e).nonzero().squeeze(1)
        if route_ids.numel() == 0:
            continue
        rows = x_all[route_ids // topk]
        if expert_fn is not None:
            out = expert_fn(rows, e) if w_flat is None else expert_fn(rows, e, w_flat[route_ids])
        else:
            out = expert_mlp(rows, w1[e], w2[e], x.dtype, activation,
                             None if b1 is None else b1[e], None if b2 is None else b2[e])
        slots = slots.index_copy(0, route_ids, out)
    if ep_size > 1:
        slots = _ReturnRows.apply(slots, group)
    return slots.view(num_tokens, topk, x.shape[1])


def gather_routing(topk_idx: torch.Tensor, group=None) -> torch.Tensor:
    """Routing of every EP rank, [P, T, K] (P = 1 without a group)."""
    ep_size, _ = _ep_size_rank(group)
    if ep_size == 1:
        return topk_idx.unsqueeze(0)
    parts = [torch.empty_like(topk_idx) for _ in range(ep_size)]
    dist.all_gather(parts, topk_idx.contiguous(), group=group)
    return torch.stack(parts)


def combine(slots: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
            shared_out: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """y = shared + sum_k w[t,k] * slot[t,k] in fp32, fixed k order, rounded once."""
    weights = torch.where(topk_idx >= 0, topk_w.float(), torch.zeros_like(topk_w, dtype=torch.float))
    acc = shared_out if shared_out is not None else slots.new_zeros(slots.shape[0], slots.shape[2])
    for k in range(slots.shape[1]):
        acc = acc + weights[:, k:k + 1] * slots[:, k]
    return acc.to(dtype)


def moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                  w1: torch.Tensor, w2: torch.Tensor,
                  shared_w1: Optional[torch.Tensor] = None, shared_w2: Optional[torch.Tensor] = None,
                  group=None, check: bool = True,
                  topk_idx_all: Optional[torch.Tensor] = None,
                  activation: ExpertActivation = SWIGLU, b1: Optional[torch.Tensor] = None,
                  b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fused MoE layer of one EP rank. Differentiable in x, topk_w and every weight.

    x [T, H]; topk_idx [T, K] int (global expert ids, -1 = no route); topk_w [T, K] fp32;
    w1 [E_loc, 2I, H] ([E_loc, I, H] for a non-gated activation); w2 [E_loc, H, I];
    optional shared expert shared_w1 [2Is, H] (or [Is, H]), shared_w2 [H, Is], with the
    same activation; group: the EP process group (None = EP 1); activation: the experts'
    (megatron_mok.activations; SwiGLU by default); b1 [E_loc, 2I] / b2 [E_loc, H]: the
    routed experts' biases (GPT-OSS), both or neither.
    """
    ep_size, _ = _ep_size_rank(group)
    if check:
        check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2, ep_size=ep_size,
                         check_values=True, fc1_rows_per_inter=activation.fc1_rows_per_inter)
        check_same_shape_across_ranks(group, tokens=x.shape[0], hidden=x.shape[1],
                                      topk=topk_idx.shape[1])
    check_expert_biases(b1, b2, w1, w2, x)
    slots = routed_slots(x, topk_idx, w1, w2, group, topk_idx_all, activation, b1, b2)
    shared_out = None
    if shared_w1 is not None:
        shared_out = expert_mlp(x.float(), shared_w1, shared_w2, x.dtype, activation)
    return combine(slots, topk_idx, topk_w, shared_out, x.dtype)
