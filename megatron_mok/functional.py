"""The MoK-shaped functional API of the fused MoE pass.

    ws    = get_workspace(config, group, device=..., num_local_tokens=T, hidden_size=H,
                          topk=K, num_local_experts=E_loc)
    sched = build_schedule(ws, config, topk_idx)
    y, ctx = forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2)
    grads  = backward(config, ws, sched, ctx, dy)

(b1=, b2= add the routed experts' biases, GPT-OSS's; both backends run them, the kernel
backend in its GEMM epilogues.)

or, with autograd, `fused_moe(x, topk_idx, topk_w, w1, w2, ...)`. With `accumulators`
(megatron_mok.grad_accumulation) the weight gradients are added into caller-owned buffers
(Megatron's main_grad) and placeholders are returned in their place.

Backends: "reference" (megatron_mok.reference, pure PyTorch, any device) and
"kernel" (the compiled Hopper pass); "auto" picks the kernel where it can run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from megatron_mok import reference, reference_fp8, routing_errors, shared_fold
from megatron_mok.kernels import backend as kernel_backend
from megatron_mok.kernels.fp8_weight_cache import Fp8WeightCache
from megatron_mok.backend_choice import resolve_backend
from megatron_mok.config import MoKConfig
from megatron_mok.grad_accumulation import ExpertGradAccumulator
from megatron_mok.schedule import MoKSchedule, build_row_table
from megatron_mok.validation import check_expert_biases, check_expert_ids, check_fp8_pass, \
    check_kernel_config, check_kernel_dims, check_moe_inputs
from megatron_mok.workspace import MoKWorkspace, clear_workspace_cache, create_workspace, \
    get_workspace

__all__ = [
    "MoKConfig", "MoKWorkspace", "MoKSchedule", "MoKForwardContext", "MoKGrads",
    "create_workspace", "get_workspace", "clear_workspace_cache", "build_schedule", "forward",
    "backward", "recompute_forward_context", "resolve_backend", "synchronize", "MoKFunction",
    "fused_moe", "ExpertGradAccumulator",
]


def build_schedule(ws: MoKWorkspace, config: MoKConfig, topk_idx: torch.Tensor) -> MoKSchedule:
    """Gather every rank's routing and build this rank's row table (sync-free).

    Expert ids are validated eagerly when the routing is on the CPU or when
    config.debug_checks is set. On the kernel backend the schedule latches an overflow or
    an invalid id on the device, and `routing_errors.RoutingError` is raised at a later
    layer call or at `routing_errors.check()` (no host sync in the pass; the pass itself
    leaves the bad routes out: docs/reliability.md). Raises here the error latched by an
    earlier pass once its copy has reached the host.
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
    kernel = ws.arena is not None
    if kernel:
        routing_errors.poll(ws.device)  # an earlier pass's error, if it has reached the host
    if topk_idx.device.type == "cpu" or config.debug_checks or not kernel:
        check_expert_ids(topk_idx, ws.num_experts)
    if kernel:
        topk_idx_all = kernel_backend.gather_routing(ws, topk_idx)
    else:
        topk_idx_all = reference.gather_routing(topk_idx, ws.group)
    sched = build_row_table(topk_idx_all, ws.ep_rank, ws.num_local_experts, ws.capacity,
                            num_experts=ws.num_experts,
                            status=routing_errors.status_tensor(ws.device) if kernel else None,
                            list_dropped=kernel and ws.ep_size > 1)
    if kernel:
        routing_errors.record(ws.device)
    if config.debug_checks:
        sched.check_errors()
    return sched


def _meta(y: torch.Tensor) -> tuple:
    return tuple(y.shape), y.dtype


@dataclasses.dataclass
class MoKForwardContext:
    """What backward needs from forward. The reference backend keeps its autograd graph."""

    backend: str
    # y's (shape, dtype); None once backward consumed the context. Not y itself: y's
    # grad_fn holds this context, and a context holding y makes a cycle that only Python's
    # garbage collector frees, so a forward without a backward (evaluation with autograd
    # on, benchmarks) would keep every pass's activations and cudaMalloc anew each call.
    output: Optional[tuple]
    leaves: tuple = ()       # reference: detached inputs the gradients are taken for
    graph: Optional[torch.Tensor] = None  # reference: y with its autograd graph
    saved: object = None     # kernel: kernel_backend.KernelSaved


@dataclasses.dataclass
class MoKGrads:
    dx: torch.Tensor
    d_topk_w: torch.Tensor
    dw1: torch.Tensor
    dw2: torch.Tensor
    d_shared_w1: Optional[torch.Tensor] = None
    d_shared_w2: Optional[torch.Tensor] = None
    db1: Optional[torch.Tensor] = None
    db2: Optional[torch.Tensor] = None


# The gradients of a pass's differentiable inputs (x, topk_w, w1, w2, shared_w1, shared_w2,
# b1, b2: MoKFunction's order), as MoKGrads names them.
_GRAD_NAMES = ("dx", "d_topk_w", "dw1", "dw2", "d_shared_w1", "d_shared_w2", "db1", "db2")


def _check_pass_inputs(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2,
                       b1=None, b2=None):
    topk_idx = sched.topk_idx_all[ws.ep_rank]
    check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2, ep_size=ws.ep_size,
                     check_values=False, fc1_rows_per_inter=config.activation.fc1_rows_per_inter)
    check_expert_biases(b1, b2, w1, w2, x)
    if (b1 is not None) != config.expert_bias:
        raise ValueError(f"megatron_mok: biases b1/b2 {'given' if b1 is not None else 'missing'}"
                         f" but MoKConfig.expert_bias is {config.expert_bias}; pass both "
                         f"biases with expert_bias=True, or neither")
    check_fp8_pass(config, hidden=x.shape[1], inter=w2.shape[2], biases=b1 is not None)
    if tuple(x.shape) != (ws.num_tokens, ws.hidden_size) or w1.shape[0] != ws.num_local_experts:
        raise ValueError(
            f"x {tuple(x.shape)} / w1 {tuple(w1.shape)} do not match the workspace "
            f"(T={ws.num_tokens}, H={ws.hidden_size}, E_loc={ws.num_local_experts})")
    return topk_idx


def recompute_forward_context(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule,
                              x, topk_w, w1, w2, shared_w1=None, shared_w2=None, b1=None,
                              b2=None, fp8_cache=None) -> MoKForwardContext:
    """Rebuild the forward context (activation recompute) without keeping the output."""
    _, ctx = _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2,
                      keep_ctx=True, fp8_cache=fp8_cache)
    return ctx


def forward(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, x, topk_w, w1, w2,
            shared_w1=None, shared_w2=None, b1=None, b2=None, fp8_cache=None
            ) -> tuple[torch.Tensor, MoKForwardContext]:
    """y [T, H] in x.dtype and the context backward needs. fp8_cache: an
    Fp8WeightCache for config.fp8 on the kernel backend (weights quantised per pass
    without one)."""
    return _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2,
                    keep_ctx=True, fp8_cache=fp8_cache)


def _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, b1=None, b2=None, *,
             keep_ctx, inputs_checked=False, fp8_cache=None):
    """inputs_checked: fused_moe checked these inputs and built ws and sched from them
    (the checks cost a layer call's host time twice otherwise)."""
    if inputs_checked:
        topk_idx = sched.topk_idx_all[ws.ep_rank]
    else:
        topk_idx = _check_pass_inputs(config, ws, sched, x, topk_w, w1, w2, shared_w1,
                                      shared_w2, b1, b2)
    backend = "kernel" if ws.arena is not None else "reference"
    if backend == "kernel":
        check_kernel_config(config, ws.ep_size)  # e.g. FP8 or biases on a kernel workspace
        y, saved = kernel_backend.forward(ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2,
                                          keep_ctx, config, b1, b2, fp8_cache)
        return y, MoKForwardContext(backend, _meta(y) if keep_ctx else None, saved=saved)
    sched.check_errors()  # the reference is not sync-free anyway
    leaves = tuple(None if t is None else t.detach().requires_grad_(True)
                   for t in (x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2))
    with torch.enable_grad() if keep_ctx else torch.no_grad():
        if config.fp8:  # the blockwise spec (SwiGLU, no biases: checked above)
            y = reference_fp8.moe_reference_fp8(leaves[0], topk_idx, *leaves[1:6],
                                                wgrad=config.fp8_wgrad, group=ws.group,
                                                topk_idx_all=sched.topk_idx_all)
        else:
            y = reference.moe_reference(leaves[0], topk_idx, *leaves[1:6], group=ws.group,
                                        check=False, topk_idx_all=sched.topk_idx_all,
                                        activation=config.activation, b1=leaves[6],
                                        b2=leaves[7])
    ctx = MoKForwardContext(backend, _meta(y) if keep_ctx else None, leaves=leaves,
                            graph=y if keep_ctx else None)
    return y.detach(), ctx


def backward(config: MoKConfig, ws: MoKWorkspace, sched: MoKSchedule, ctx: MoKForwardContext,
             grad_output: torch.Tensor, accumulators: Optional[tuple] = None) -> MoKGrads:
    """Gradients of every input; d_topk_w is fp32, weight grads in the weights' dtype.
    accumulators (w1's, w2's ExpertGradAccumulator or None): add that weight's gradient
    into its buffers and return a placeholder (never read) in its place."""
    if ctx.output is None:
        raise ValueError("the forward context holds no graph; rebuild it with "
                         "recompute_forward_context")
    shape, dtype = ctx.output
    if tuple(grad_output.shape) != shape or grad_output.dtype != dtype:
        raise ValueError(f"grad_output must be {shape} {dtype}, got "
                         f"{tuple(grad_output.shape)} {grad_output.dtype}")
    ctx.output = None  # the context is consumed
    if ctx.backend == "kernel":
        grads = kernel_backend.backward(ws, sched, ctx.saved, grad_output.contiguous(),
                                        accumulators)
        ctx.saved = None
        return MoKGrads(*grads)
    wanted = {name: t for name, t in zip(_GRAD_NAMES, ctx.leaves) if t is not None}
    grads = torch.autograd.grad(ctx.graph, list(wanted.values()), grad_output, allow_unused=True)
    grads = {name: torch.zeros_like(t) if g is None else g
             for (name, t), g in zip(wanted.items(), grads)}
    ctx.graph = None
    for name, acc in zip(("dw1", "dw2"), accumulators or ()):
        if acc is not None:
            acc.add_(grads[name])
            grads[name] = acc.finish(grads[name])
    return MoKGrads(**grads)


def synchronize(ws: MoKWorkspace, timeout_s: Optional[float] = None) -> None:
    """Wait for the device; if a watchdog trapped (a peer never arrived), raise a
    RuntimeError carrying where it was stuck instead of the bare CUDA error. The host
    waits at most timeout_s (default: twice the device watchdog's timeout plus 10 s):
    past it, a RuntimeError says so (with the watchdog record if one was written) rather
    than the host hanging on a device that never finishes."""
    if timeout_s is None and ws.arena is not None:
        timeout_s = 2 * ws.arena.WATCHDOG_TIMEOUT_MS / 1000 + 10
    try:
        if timeout_s is None:
            torch.cuda.synchronize(ws.device)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(ws.device))
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                report = ws.arena.watchdog_report() if ws.arena is not None else None
                raise RuntimeError(
                    f"megatron_mok watchdog: rank {ws.ep_rank}: the device did not finish "
                    f"within {timeout_s:.0f} s" + (f"; {report}" if report else
                                                  " (no device watchdog record)"))
            time.sleep(0.001)
        torch.cuda.synchronize(ws.device)
    except RuntimeError as err:
        if str(err).startswith("megatron_mok watchdog"):
            raise
        report = ws.arena.watchdog_report() if ws.arena is not None else None
        if report:
            raise RuntimeError(report) from err
        raise


class MoKFunction(torch.autograd.Function):
    """Autograd over forward / backward. With recompute=True only the inputs are saved
    and backward rebuilds the context first (activation checkpointing)."""

    @staticmethod
    def forward(fctx, x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2, config, ws, sched,
                recompute, accumulators=None, inputs_checked=False, fp8_cache=None):
        y, ctx = _forward(config, ws, sched, x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2,
                          keep_ctx=not recompute, inputs_checked=inputs_checked,
                          fp8_cache=fp8_cache)
        fctx.mok = (config, ws, sched, ctx if not recompute else None, accumulators,
                    fp8_cache)
        if recompute:
            fctx.save_for_backward(x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2)
        return y

    @staticmethod
    def backward(fctx, dy):
        config, ws, sched, ctx, accumulators, fp8_cache = fctx.mok
        if ctx is None:
            ctx = recompute_forward_context(config, ws, sched, *fctx.saved_tensors,
                                            fp8_cache=fp8_cache)
        # Only for weights that want a gradient (a frozen weight's buffers stay untouched).
        wanted = fctx.needs_input_grad[2:4]
        accumulators = tuple(a if want else None
                             for a, want in zip(accumulators or (None, None), wanted))
        g = backward(config, ws, sched, ctx, dy.contiguous(), accumulators)
        fctx.mok = None
        return (g.dx, g.d_topk_w, g.dw1, g.dw2, g.d_shared_w1, g.d_shared_w2, g.db1, g.db2,
                None, None, None, None, None, None, None)


def fused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, shared_w1: Optional[torch.Tensor] = None,
              shared_w2: Optional[torch.Tensor] = None, *, group=None,
              config: Optional[MoKConfig] = None, recompute: bool = False,
              accumulators: Optional[tuple] = None,
              fold_shared: Optional[bool] = None, b1: Optional[torch.Tensor] = None,
              b2: Optional[torch.Tensor] = None,
              fp8_cache: Optional[Fp8WeightCache] = None) -> torch.Tensor:
    """The fused MoE layer with autograd: x [T, H], topk_idx [T, K] (global ids, -1 = none),
    topk_w [T, K] fp32, w1 [E_loc, 2I, H] ([E_loc, I, H] for a non-gated
    config.activation), w2 [E_loc, H, I], optional shared expert.
    accumulators: (w1's, w2's) ExpertGradAccumulator, or None for either: backward adds
    that weight's gradient into the accumulator's buffers (Megatron's main_grad) and
    returns an uninitialized placeholder as its gradient. With MOK_SHARED_EXPERT=folded
    and accumulators of E_loc + 1 buffers, the last one takes the shared weight's.
    fold_shared: run a shared expert of the routed experts' width as local expert E_loc
    (megatron_mok.shared_fold); None: as MOK_SHARED_EXPERT says.
    b1 [E_loc, 2I] (or [E_loc, I]) and b2 [E_loc, H]: the routed experts' biases (GPT-OSS),
    both or neither; the routing weight scales b2 with the expert's output, as Megatron's
    experts do. They set config.expert_bias.
    config.fp8 = "blockwise": the routed experts in blockwise FP8 (reference_fp8; SwiGLU,
    no biases, H and I multiples of 128; the kernel backend at EP = 1), the shared expert
    in BF16; fp8_cache
    (megatron_mok.kernels.fp8_weight_cache) keeps the FP8 weights across the passes of
    one optimizer step, else the kernel backend quantises them every pass."""
    config = config or MoKConfig()
    check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1, shared_w2, check_values=False,
                     fc1_rows_per_inter=config.activation.fc1_rows_per_inter)
    check_expert_biases(b1, b2, w1, w2, x)
    if (b1 is not None) != config.expert_bias:
        config = dataclasses.replace(config, expert_bias=b1 is not None)
    if accumulators is not None:
        if not isinstance(accumulators, tuple) or len(accumulators) != 2 or not all(
                a is None or isinstance(a, ExpertGradAccumulator) for a in accumulators):
            raise TypeError("megatron_mok: accumulators must be a pair of "
                            "ExpertGradAccumulator or None (w1's, w2's)")
    if fp8_cache is not None and not isinstance(fp8_cache, Fp8WeightCache):
        raise TypeError(f"megatron_mok: fp8_cache must be an Fp8WeightCache or None, got "
                        f"{type(fp8_cache).__name__}")
    # The shared expert as local expert E_loc (shared_fold): one more route per token.
    # Accumulators then hold E_loc + 1 buffers, the shared weight's last.
    if fold_shared is None:
        fold_shared = shared_fold.mode() == "folded"
    check_fp8_pass(config, hidden=x.shape[1], inter=w2.shape[2], biases=b1 is not None)
    # (FP8 keeps the shared expert in BF16, as MoK does: never folded into the FP8 experts.)
    if fold_shared and b1 is None and not config.fp8 \
            and shared_fold.foldable(w1, w2, shared_w1, shared_w2) \
            and all(a is None or a.shape[0] == w1.shape[0] + 1 for a in accumulators or ()):
        ep_rank = torch.distributed.get_rank(group) if group is not None else 0
        topk_idx, topk_w = shared_fold.fold_routing(topk_idx, topk_w, w1.shape[0], ep_rank)
        w1 = shared_fold.append_expert(w1, shared_w1)
        w2 = shared_fold.append_expert(w2, shared_w2)
        shared_w1 = shared_w2 = None
    for acc, w, name in zip(accumulators or (), (w1, w2), ("w1", "w2")):
        if acc is not None:
            acc.check(w, name)
    ws = get_workspace(config, group, device=x.device, num_local_tokens=x.shape[0],
                       hidden_size=x.shape[1], topk=topk_idx.shape[1],
                       num_local_experts=w1.shape[0], dtype=x.dtype)
    if ws.arena is not None:  # before the schedule's launches
        rows_per_inter = config.activation.fc1_rows_per_inter
        check_kernel_dims(intermediate_size=w1.shape[1] // rows_per_inter)
    sched = build_schedule(ws, config, topk_idx)
    return MoKFunction.apply(x, topk_w, w1, w2, shared_w1, shared_w2, b1, b2, config, ws, sched,
                             recompute, accumulators, True, fp8_cache)
