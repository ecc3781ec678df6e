"""Input checks of the fused MoE pass: clear Python errors before any kernel launch.

Shape, dtype, device and layout checks read only metadata. Routing *values*
(expert ids in [-1, E)) need the data: they are checked eagerly when the routing
lives on the CPU or when asked (`check_values`); on the GPU kernel backend the
schedule raises a device-side error flag instead, so the pass stays sync-free.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_mok import knobs

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, t, ndim: int, dtypes, device: Optional[torch.device] = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; all inputs must share "
                         f"one device")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}")


def check_moe_inputs(x, topk_idx, topk_w, w1, w2, shared_w1=None, shared_w2=None, *,
                     ep_size: int = 1, check_values: bool = True,
                     fc1_rows_per_inter: int = 2) -> None:
    """Validate the arguments of one fused MoE pass (see reference.moe_reference).
    fc1_rows_per_inter: 2 for gated experts (w1 = [gate; up]), 1 otherwise."""
    _check_tensor("x", x, 2, FLOAT_DTYPES)
    device = x.device
    num_tokens, hidden = x.shape
    _check_tensor("topk_idx", topk_idx, 2, INDEX_DTYPES, device)
    _check_tensor("topk_w", topk_w, 2, (torch.float32,), device)
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {num_tokens} tokens")
    if topk_w.shape != topk_idx.shape:
        raise ValueError(f"topk_w shape {tuple(topk_w.shape)} must equal topk_idx shape "
                         f"{tuple(topk_idx.shape)}")
    if topk_idx.shape[1] < 1:
        raise ValueError("topk_idx must have at least one route per token (K >= 1)")
    _check_tensor("w1", w1, 3, (x.dtype,), device)
    _check_tensor("w2", w2, 3, (x.dtype,), device)
    num_local_experts, fc1_rows, w1_hidden = w1.shape
    r = fc1_rows_per_inter
    layout = "[E_loc, 2I, H={}] ([gate; up] stacked)" if r == 2 else "[E_loc, I, H={}]"
    if w1_hidden != hidden or fc1_rows % r:
        raise ValueError(f"w1 must be {layout.format(hidden)}, got {tuple(w1.shape)}")
    if tuple(w2.shape) != (num_local_experts, hidden, fc1_rows // r):
        raise ValueError(f"w2 must be [E_loc={num_local_experts}, H={hidden}, I={fc1_rows // r}], "
                         f"got {tuple(w2.shape)}")
    if (shared_w1 is None) != (shared_w2 is None):
        raise ValueError("shared_w1 and shared_w2 must be given together")
    if shared_w1 is not None:
        _check_tensor("shared_w1", shared_w1, 2, (x.dtype,), device)
        _check_tensor("shared_w2", shared_w2, 2, (x.dtype,), device)
        rows = "2Is" if r == 2 else "Is"
        if shared_w1.shape[1] != hidden or shared_w1.shape[0] % r:
            raise ValueError(f"shared_w1 must be [{rows}, H={hidden}], got {tuple(shared_w1.shape)}")
        if tuple(shared_w2.shape) != (hidden, shared_w1.shape[0] // r):
            raise ValueError(f"shared_w2 must be [H={hidden}, Is={shared_w1.shape[0] // r}], got "
                             f"{tuple(shared_w2.shape)}")
    if check_values:
        check_expert_ids(topk_idx, num_local_experts * ep_size)


def check_expert_biases(b1, b2, w1, w2, x) -> None:
    """The routed experts' biases: both or neither; b1 [E_loc, fc1 rows], b2 [E_loc, H],
    in x's dtype, on x's device, contiguous."""
    if (b1 is None) != (b2 is None):
        raise ValueError("b1 and b2 must be given together")
    if b1 is None:
        return
    _check_tensor("b1", b1, 2, (x.dtype,), x.device)
    _check_tensor("b2", b2, 2, (x.dtype,), x.device)
    if tuple(b1.shape) != tuple(w1.shape[:2]) or tuple(b2.shape) != tuple(w2.shape[:2]):
        raise ValueError(f"b1 must be [E_loc, {w1.shape[1]}] and b2 [E_loc, {w2.shape[1]}], "
                         f"got {tuple(b1.shape)} and {tuple(b2.shape)}")


def kernel_config_refusal(config, ep_size: int = 1) -> Optional[str]:
    """Why the kernel backend cannot run `config` at `ep_size` (None: it can). It runs GLU
    experts of silu or quick_gelu (SwiGLU; GPT-OSS's clamped GLU with its linear offset)
    and non-gated experts of every function of the spec (squared-ReLU, GeLU, ...), with or
    without expert biases, in BF16; and blockwise FP8 at EP = 1 with BF16 weight gradients
    (check_fp8_pass says which layers)."""
    if not config.activation.kernel_runs:
        return (f"the kernel backend runs GLU experts of silu or quick_gelu (clamped or not) "
                f"and non-gated experts, not {config.activation.describe()}; use "
                f"backend='reference' (--mok-backend reference), or SwiGLU experts (--swiglu)")
    if config.fp8 and knobs.get("MOK_FP8_KERNELS") != "1":
        return ("the kernel backend's FP8 path is experimental and opt-in: set "
                "MOK_FP8_KERNELS=1 to run it (weight gradients in BF16), or run the spec "
                "(backend='reference', --mok-backend reference), or BF16 (no --mok-fp8)")
    if config.fp8 and ep_size > 1:
        return (f"the kernel backend's FP8 runs at EP = 1 (got EP = {ep_size}; its pulls of "
                f"quantised rows are not built): pass --expert-model-parallel-size 1, or "
                f"backend='reference' (--mok-backend reference), or BF16 (no --mok-fp8)")
    if config.fp8 and config.fp8_wgrad != "bf16":
        return ("the kernel backend's FP8 runs the weight gradients in BF16 (its FP8 wgrad "
                "GEMMs are not built): pass --mok-fp8-wgrad bf16 (MoKConfig.fp8_wgrad='bf16'), "
                "or backend='reference' (--mok-backend reference) for FP8 weight gradients")
    return None


def check_kernel_config(config, ep_size: int = 1) -> None:
    """Raise what kernel_config_refusal says: checked when a kernel workspace is made and
    again by every kernel pass (its config may differ from the workspace's), before any
    launch."""
    reason = kernel_config_refusal(config, ep_size)
    if reason is not None:
        raise ValueError(f"megatron_mok: {reason}")


def check_fp8_pass(config, *, hidden: int, inter: int, biases: bool) -> None:
    """What the blockwise FP8 spec covers so far: SwiGLU experts without biases, H and I
    multiples of 128 (the recipe's group size), at any EP size (the kernel backend's
    limits are kernel_config_refusal's)."""
    if not config.fp8:
        return
    wanted = [(config.activation.is_swiglu, f"SwiGLU experts (got "
               f"{config.activation.describe()}): pass --swiglu"),
              (not biases, "experts without biases: pass --disable-bias-linear"),
              (hidden % 128 == 0 and inter % 128 == 0, f"H and I multiples of 128 (got H = "
               f"{hidden}, I = {inter})")]
    for ok, what in wanted:
        if not ok:
            raise ValueError(f"megatron_mok: blockwise FP8 runs with {what}, or run the MoE "
                             f"layers in BF16 (no --mok-fp8 / --fp8-format)")


def check_kernel_dims(**sizes: int) -> None:
    """The kernel backend's sizes (H, I): positive multiples of 8 (TMA moves rows of
    16-byte multiples). Checked before its first launch."""
    for name, value in sizes.items():
        if value <= 0 or value % 8:
            raise ValueError(f"megatron_mok: the kernel backend needs {name} to be a positive "
                             f"multiple of 8, got {value}; use backend='reference' for "
                             f"other sizes")


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every id must be in [-1, num_experts). Reads the data (a host sync on GPU)."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"topk_idx holds expert ids in [{lo}, {hi}] but must be in "
                         f"[-1, {num_experts}) (-1 = no route)")


def check_same_shape_across_ranks(group, **dims: int) -> None:
    """Every EP rank must call the pass with identical T, H, K (one collective)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    local = torch.tensor(list(dims.values()), dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        local = local.cuda()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    table = torch.stack(parts).cpu()
    if not bool((table == table[0]).all()):
        per_rank = {name: table[:, i].tolist() for i, name in enumerate(dims)}
        raise ValueError(f"every EP rank must use the same shapes; per rank got {per_rank}")
