"""The FP8 (blockwise) MoE layer of the spec, in pure PyTorch: every quantisation point
explicit (docs/fp8.md).

Forward, per expert e (rows of the tokens routed to it):
    x        quantised once per token, 1 x 128 groups along H (fc1's K)
    w1, w2   quantised in 128 x 128 blocks along their K (H for fc1, I for fc2)
    h        = dq(x) @ dq(w1)^T in fp32; act = SwiGLU(h) in fp32, rounded to the
             activation dtype (the tensor between the two GEMMs, as with unfused quantisers)
    act      quantised 1 x 128 along I (fc2's K)
    out      = dq(act) @ dq(w2)^T in fp32, rounded to bf16 per row
    y[t]     = shared(x_t) (BF16, as in MoK: FP8 there hurt stability)
               + sum_k w[t,k] * out_tk in fp32, fixed k order, rounded once
Backward (each GEMM's own quantisation of its operands):
    dgrad    dY quantised 1 x 128 along the output features; the weight's transpose
             quantised in 128 x 128 blocks along those features (the weights' second
             layout): d_in = dq(dY) @ dq(W^T)^T. For fc2, dY is the route's unweighted dy
             and w[t,k] multiplies the fp32 result (as the kernels and the BF16 pass);
             d_topk_w[t,k] = <dy_t, out_tk>
    wgrad    "fp8": both operands quantised 1 x 128 along the tokens (each expert's rows
             padded with zeros to a multiple of 128, which adds nothing); "bf16": the
             operands as bf16, fp32 accumulation
    SwiGLU backward and the routing-weight gradient in fp32, the SwiGLU backward at h as
    the layer keeps it (rounded to the activation dtype); its output d_h is rounded to the
    activation dtype before fc1's dgrad quantises it.
The weights are quantised from their bf16 values at every call here; the kernels quantise
them once per optimizer step, the same values.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok.activations import SWIGLU
from megatron_mok.fp8_formats import GROUP_SIZE, quantize_blockwise
from megatron_mok.reference import combine, expert_mlp, round_to, routed_slots
from megatron_mok.validation import check_moe_inputs

WGRAD_MODES = ("fp8", "bf16")


def _dq_act(t: torch.Tensor, pow2: bool) -> torch.Tensor:
    """t [M, K] through 1 x 128 groups along K: the values an FP8 GEMM reads."""
    return quantize_blockwise(t, block_rows=1, pow2_scales=pow2).dequantize()


def _dq_weight(w: torch.Tensor, pow2: bool) -> torch.Tensor:
    """w [N, K] through 128 x 128 blocks."""
    return quantize_blockwise(w, block_rows=GROUP_SIZE, pow2_scales=pow2).dequantize()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % GROUP_SIZE
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


class _RoundGrad(torch.autograd.Function):
    """Identity in forward; the gradient rounded to `dtype` (and back) in backward."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


class _SwiGLUOfStoredH(torch.autograd.Function):
    """SwiGLU(h) from the fp32 h; its backward at h rounded to `dtype`, the h a layer keeps
    for its backward (the kernels store h in bf16). In BF16 the difference is one rounding;
    here d_h is quantised next, and a 2^-9 change of d_h flips ~2 % of its E4M3 roundings
    (1.4-1.6e-2 on dx): the spec computes d_h as the kernels must."""

    @staticmethod
    def forward(ctx, h, dtype):
        ctx.save_for_backward(h.to(dtype))
        return SWIGLU(h)

    @staticmethod
    def backward(ctx, grad):
        (h_kept,) = ctx.saved_tensors
        with torch.enable_grad():
            h = h_kept.to(grad.dtype).requires_grad_(True)
            (d_h,) = torch.autograd.grad(SWIGLU(h), h, grad)
        return d_h, None


class _FP8Linear(torch.autograd.Function):
    """out [M, N] fp32 = dq(q(a)) @ dq(q(w))^T for a [M, K] (1 x 128), w [N, K] (128 x 128),
    with the backward's quantisation points of the module docstring."""

    @staticmethod
    def forward(ctx, a, w, pow2: bool, wgrad: str):
        ctx.save_for_backward(a, w)
        ctx.pow2, ctx.wgrad = pow2, wgrad
        return _dq_act(a.float(), pow2) @ _dq_weight(w.float(), pow2).t()

    @staticmethod
    def backward(ctx, d_out):
        a, w = ctx.saved_tensors
        pow2 = ctx.pow2
        d_out = d_out.float()
        d_a = _dq_act(d_out, pow2) @ _dq_weight(w.float().t().contiguous(), pow2).t()
        if ctx.wgrad == "fp8":  # K = tokens: both operands grouped along them
            d_w = (_dq_act(_pad_rows(d_out).t().contiguous(), pow2)
                   @ _dq_act(_pad_rows(a.float()).t().contiguous(), pow2).t())
        else:
            d_w = d_out.to(torch.bfloat16).float().t() @ a.to(torch.bfloat16).float()
        return d_a.to(a.dtype), d_w.to(w.dtype), None, None


class _RoutedFP8Linear(torch.autograd.Function):
    """fc2 of a routed expert with its rows' router weights: forward w_rows * round(dq(q(a))
    @ dq(q(w))^T) in fp32 (the combine's products). Backward from the unweighted dy rows g,
    as the kernels compute it: acc = dq(q(g)) @ dq(q(w^T))^T, d_a = w_rows * acc in fp32,
    d_w_rows = <g, out>; the weight gradient "bf16": g^T (w_rows * a) from bf16 operands,
    "fp8": as _FP8Linear's with d_out = w_rows * g."""

    @staticmethod
    def forward(ctx, a, w, w_rows, pow2: bool, wgrad: str, dtype: torch.dtype):
        out = (_dq_act(a.float(), pow2) @ _dq_weight(w.float(), pow2).t()).to(dtype).float()
        ctx.save_for_backward(a, w, w_rows, out)
        ctx.pow2, ctx.wgrad = pow2, wgrad
        return w_rows.unsqueeze(1) * out

    @staticmethod
    def backward(ctx, g):
        a, w, w_rows, out = ctx.saved_tensors
        pow2, wr = ctx.pow2, w_rows.unsqueeze(1)
        g = g.float()
        acc = _dq_act(g, pow2) @ _dq_weight(w.float().t().contiguous(), pow2).t()
        d_w_rows = (g * out).sum(1)
        if ctx.wgrad == "fp8":
            d_out = wr * g
            d_w = (_dq_act(_pad_rows(d_out).t().contiguous(), pow2)
                   @ _dq_act(_pad_rows(a.float()).t().contiguous(), pow2).t())
        else:
            d_w = (g.to(torch.bfloat16).float().t()
                   @ (wr * a.float()).to(torch.bfloat16).float())
        return (wr * acc).to(a.dtype), d_w.to(w.dtype), d_w_rows.to(w_rows.dtype), None, None, None


def fp8_routed_expert(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      w_rows: torch.Tensor, dtype: torch.dtype, *, pow2_scales: bool = False,
                      wgrad: str = "fp8") -> torch.Tensor:
    """fp8_expert with its rows' router weights applied after fc2: out [M, H] fp32 = w_rows *
    round(out), so that the backward quantises the unweighted dy (as the kernels do)."""
    h = _RoundGrad.apply(_FP8Linear.apply(rows, w1, pow2_scales, wgrad), dtype)
    act = round_to(_SwiGLUOfStoredH.apply(h, dtype), dtype)
    return _RoutedFP8Linear.apply(act, w2, w_rows, pow2_scales, wgrad, dtype)


def fp8_expert(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, *,
               pow2_scales: bool = False, wgrad: str = "fp8") -> torch.Tensor:
    """One SwiGLU expert in blockwise FP8: rows [M, H] -> out [M, H] (rounded to dtype,
    held in fp32)."""
    h = _RoundGrad.apply(_FP8Linear.apply(rows, w1, pow2_scales, wgrad), dtype)
    act = round_to(_SwiGLUOfStoredH.apply(h, dtype), dtype)
    out = _FP8Linear.apply(act, w2, pow2_scales, wgrad)
    return round_to(out, dtype)


def moe_reference_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor,
                      shared_w1: Optional[torch.Tensor] = None,
                      shared_w2: Optional[torch.Tensor] = None, *,
                      pow2_scales: bool = False, wgrad: str = "fp8", group=None,
                      topk_idx_all: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The blockwise-FP8 MoE layer of one EP rank, differentiable in x, topk_w and every
    weight. Shapes and `group` / `topk_idx_all` as reference.moe_reference (SwiGLU
    experts); H and I must be multiples of 128 (the recipe's group size): ValueError
    otherwise. At EP > 1 a token's rows reach the experts' owners and come back as in the
    BF16 spec; every quantisation is per row (x per token, act and d_h per route row) or
    per expert over its rows in (rank, token, k) order (the "fp8" weight gradients), so a
    route's values do not depend on where it ran."""
    check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2,
                     ep_size=_ep_size(group))
    hidden, inter = x.shape[1], w2.shape[2]
    if hidden % GROUP_SIZE or inter % GROUP_SIZE:
        raise ValueError(f"blockwise FP8 needs H and I to be multiples of {GROUP_SIZE}, got "
                         f"H={hidden}, I={inter}; run those layers in BF16")
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"wgrad must be one of {WGRAD_MODES}, got {wgrad!r}")

    def expert(rows, e, w_rows):
        return fp8_routed_expert(rows, w1[e], w2[e], w_rows, x.dtype,
                                 pow2_scales=pow2_scales, wgrad=wgrad)

    # The router weights are applied in the experts (after fc2, in fp32: the combine's
    # products), so that dy is quantised unweighted, as the kernels do; the slots come back
    # weighted and are summed with unit weights. dx sums over the routes in fp32, rounded
    # once (as the BF16 spec).
    slots = routed_slots(x, topk_idx, w1, w2, group, topk_idx_all, expert_fn=expert,
                         route_weights=topk_w)
    shared_out = None
    if shared_w1 is not None:
        shared_out = expert_mlp(x.float(), shared_w1, shared_w2, x.dtype)
    return combine(slots, topk_idx, torch.ones_like(topk_w, dtype=torch.float32), shared_out,
                   x.dtype)


def _ep_size(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group) if group is not None else 1
