"""The MoK-shaped functional API of the fused MoE pass.

    ws    = get_workspace(config, group, device=..., num_local_tokens=T, hidden_size=H,
                          topk=K, num_local_experts=E_loc)
    sched = build_schedule(ws, config, topk_idx)
    y, ctx = forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2)
    grads  = backward(config, ws, sched, ctx, dy)

or, with autograd, `fused_moe(x, topk_idx, topk_w, w1, w2, ...)`.

Backends: "reference" (megatron_mok.reference, pure PyTorch, any device) and
"kernel" (the compiled Hopper pass); "auto" picks the kernel where it can run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_mok import ops, reference
from megatron_mok.config import MoKConfig
from megatron_mok.schedule import MoKSchedule, build_row_table
from megatron_mok.validation import check_expert_ids, check_moe_inputs
from megatron_mok.workspace import MoKWorkspace, clear_workspace_cache, create_workspace, \
    get_workspace

__all__ = [
    "MoKConfig", "MoKWorkspace", "MoKSchedule", "MoKForwardContext", "MoKGrads",
    "create_workspace", "get_workspace", "clear_workspace_cache", "build_schedule", "forward",
    "backward", "recompute_forward_context", "resolve_backend", "MoKFunction", "fused_moe",
]


def resolve_backend(config: MoKConfig, device: torch.device) -> str:
    """The backend that runs on `device`; forcing an unavailable one is an error."""
    available, reason = ops.kernel_backend_status(device)
    if config.backend == "kernel" and not available:
        raise RuntimeError(f"megatron_mok: backend='kernel' is not available here: {reason}. "
                           f"Use backend='reference' or 'auto'.")
    if config.backend == "auto":
        return "kernel" if available else "reference"
    return config.backend


def build_schedule(ws: MoKWorkspace, config: MoKConfig, topk_idx: torch.Tensor) -> MoKSchedule:
    """Gather every rank's routing and build this rank's row table (sync-free).

    Expert ids are validated eagerly when the routing is on the CPU or when
    config.debug_checks is set; otherwise a bad id can only surface through the
    kernel backend's device-side error flag.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be an int32/int64 tensor, got "
                        f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)}")
    if tuple(topk_idx.shape) != (ws.num_tokens, ws.topk):
        raise ValueError(f"topk_idx must be [T={ws.num_tokens}, K={ws.topk}] as in the workspace, "
                         f"got {tuple(topk_idx.shape)}")
    if topk_idx.device != ws.device:
        raise ValueError(f"topk_idx is on {topk_idx.device}, the workspace on {ws.device}")
    if not topk_idx.is_contiguous():
        raise ValueError("topk_idx must be contiguous")
    if topk_idx.device.type == "cpu" or config.debug_checks or \
            resolve_backend(config, ws.device) == "reference":
        check_expert_ids(topk_idx, ws.num_experts)
    topk_idx_all = reference.gather_routing(topk_idx, ws.group)
    return build_row_table(topk_idx_all, ws.ep_rank, ws.num_local_experts, ws.capacity)


@dataclasses.dataclass
class MoKForwardContext:
    """What backward needs from forward. The reference backend keeps its autograd graph."""

    backend: str
    leaves: tuple            # detached inputs the gradients are taken for
    output: Optional[torch.Tensor]


@dataclasses.dataclass
class MoKGrads:
    dx: torch.Tensor
    d_topk_w: torch.Tensor
    dw1: torch.Tensor
    dw2: torch.Tensor
    d_shared_w1: Optional[torch.Tensor] = None
    d_shared_w2: Optional[torch.Tensor] = None


def _check_pass_inputs(ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2):
    topk_idx = sched.topk_idx_all[ws.ep_rank]
    check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2, ep_size=ws.ep_size,
                     check_values=False)
    if tuple(x.shape) != (ws.num_tokens, ws.hidden_size) or w1.shape[0] != ws.num_local_experts:
        raise ValueError(
            f"x {tuple(x.shape)} / w1 {tuple(w1.shape)} do not match the workspace "
            f"(T={ws.num_tokens}, H={ws.hidden_size}, E_loc={ws.num_local_experts})")
    return topk_idx


def recompute_forward_context(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule,
                              x, topk_w, w1, w2, shared_w1=None, shared_w2=None
                              ) -> MoKForwardContext:
    """Rebuild the forward context (activation recompute) without keeping the output."""
    _, ctx = _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, keep_ctx=True)
    return ctx


def forward(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, topk_w, w1, w2,
            shared_w1=None, shared_w2=None) -> tuple[torch.Tensor, MoKForwardContext]:
    """y [T, H] in x.dtype and the context backward needs."""
    return _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, keep_ctx=True)


def _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, *, keep_ctx):
    topk_idx = _check_pass_inputs(ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2)
    backend = resolve_backend(config, x.device)
    if backend == "kernel":  # pragma: no cover - resolve_backend refuses it in this build
        raise NotImplementedError
    if sched.overflow.device.type == "cpu" or backend == "reference":
        sched.raise_if_overflow()
    leaves = tuple(None if t is None else t.detach().requires_grad_(True)
                   for t in (x, topk_w, w1, w2, shared_w1, shared_w2))
    with torch.enable_grad() if keep_ctx else torch.no_grad():
        y = reference.moe_reference(leaves[0], topk_idx, *leaves[1:], group=ws.group,
                                    check=False, topk_idx_all=sched.topk_idx_all)
    ctx = MoKForwardContext(backend=backend, leaves=leaves, output=y if keep_ctx else None)
    return y.detach(), ctx


def backward(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx: MoKForwardContext,
             grad_output: torch.Tensor) -> MoKGrads:
    """Gradients of every input; d_topk_w is fp32, weight grads in the weights' dtype."""
    if ctx.output is None:
        raise ValueError("the forward context holds no graph; rebuild it with "
                         "recompute_forward_context")
    if grad_output.shape != ctx.output.shape or grad_output.dtype != ctx.output.dtype:
        raise ValueError(f"grad_output must be {tuple(ctx.output.shape)} {ctx.output.dtype}, got "
                         f"{tuple(grad_output.shape)} {grad_output.dtype}")
    wanted = [t for t in ctx.leaves if t is not None]
    grads = torch.autograd.grad(ctx.output, wanted, grad_output, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads)]
    ctx.output = None  # the graph is consumed
    return MoKGrads(*grads)


class MoKFunction(torch.autograd.Function):
    """Autograd over forward / backward. With recompute=True only the inputs are saved
    and backward rebuilds the context first (activation checkpointing)."""

    @staticmethod
    def forward(fctx, x, topk_w, w1, w2, shared_w1, shared_w2, config, ws, sched, recompute):
        y, ctx = _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2,
                          keep_ctx=not recompute)
        fctx.mok = (config, ws, sched, ctx if not recompute else None)
        fctx.has_shared = shared_w1 is not None
        if recompute:
            fctx.save_for_backward(x, topk_w, w1, w2, shared_w1, shared_w2)
        return y

    @staticmethod
    def backward(fctx, dy):
        config, ws, sched, ctx = fctx.mok
        if ctx is None:
            ctx = recompute_forward_context(config, ws, sched, *fctx.saved_tensors)
        g = backward(config, ws, sched, ctx, dy.contiguous())
        fctx.mok = None
        return (g.dx, g.d_topk_w, g.dw1, g.dw2, g.d_shared_w1, g.d_shared_w2,
                None, None, None, None)


def fused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, shared_w1: Optional[torch.Tensor] = None,
              shared_w2: Optional[torch.Tensor] = None, *, group=None,
              config: Optional[MoKConfig] = None, recompute: bool = False) -> torch.Tensor:
    """The fused MoE layer with autograd: x [T, H], topk_idx [T, K] (global ids, -1 = none),
    topk_w [T, K] fp32, w1 [E_loc, 2I, H], w2 [E_loc, H, I], optional shared expert."""
    config = config or MoKConfig()
    check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2, check_values=False)
    ws = get_workspace(config, group, device=x.device, num_local_tokens=x.shape[0],
                       hidden_size=x.shape[1], topk=topk_idx.shape[1],
                       num_local_experts=w1.shape[0])
    sched = build_schedule(ws, config, topk_idx)
    return MoKFunction.apply(x, topk_w, w1, w2, shared_w1, shared_w2, config, ws, sched, recompute)
