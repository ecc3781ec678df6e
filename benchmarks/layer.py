"""EP=1 MoE layer benchmark: the fused `mok` pass vs `torch-unfused` and Megatron-Core's
`alltoall` MoE layer, on the ep8-proxy shapes of docs/benchmarks.md.

    python -m benchmarks.layer [--shapes a,b] [--tokens 4096,8192] [--routing balanced]
        [--backends mok,torch-unfused,megatron-alltoall] [--pass fwd,bwd]
        [--warmup 20] [--iters 50] [--out benchmarks/results] [--quick]
        [--mok-backend auto] [--check-tokens auto|full|N] [--seed 0] [--device cuda]

For each (shape, T, routing) the inputs are built once (bf16 x, expert weights
w1 [E_loc, 2I, H] / w2 [E_loc, H, I] and the shared expert with std 0.02, fixed top-K
routing) and every backend sees the same tensors. Before timing, each backend's
forward output and gradients are checked against `megatron_mok.reference.moe_reference`
(relative L2 <= 1e-2; `mok-fp8`, the blockwise-FP8 experts, <= 0.1: the quantisation's
error; its speedup over `mok` BF16 is recorded as speedup["mok"]). Forward timing covers the whole layer call (the schedule build
for mok); backward timing covers only `autograd.backward(y, dy)`. Times are CUDA-event
medians over --iters after --warmup, with a 256 MB L2-flushing write before every
iteration. The dense BF16 peak (8192^3 matmul) is measured in the same run.

Results: benchmarks/results/<YYYY-MM-DD>-<gpu>-layer-ep1.json (rewritten after every
case, so a run cut short keeps what it measured); `python -m benchmarks.report` plots
them and regenerates the README table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from benchmarks import shapes as S
from megatron_mok.reference import rel_l2

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("mok", "sonicmoe", "megatron-te", "torch-unfused", "megatron-alltoall", "mok-fp8",
            "mok-fp8-reuse", "torch-fp8", "megatron-te-fp8")
# The FP8 layers (not in the default list: the FP8 kernels are opt-in); torch-fp8 is the
# unfused row-wise FP8 baseline (benchmarks/torch_fp8.py), megatron-te-fp8 Megatron's own
# FP8 MoE layer (megatron-te with --fp8-format e4m3 --fp8-recipe blockwise: TE's
# Float8BlockScaling, 1 x 128 / 128 x 128 as ours).
FP8_BACKENDS = ("mok-fp8", "mok-fp8-reuse", "torch-fp8", "megatron-te-fp8")
BASELINES = ("sonicmoe", "megatron-te", "torch-unfused", "megatron-alltoall", "torch-fp8",
             "megatron-te-fp8")
HOST_CALLS = 5  # layer calls timed on the host alone (each after a sync, none inside)
PASSES = ("fwd", "bwd")
CHECK_TOL = 1e-2
# mok-fp8 (blockwise FP8 experts; weights quantised every pass, as at one micro-batch per
# step) and mok-fp8-reuse (weights quantised once per step, as a step's later micro-batches
# run) are checked against the BF16 spec too: the quantisation moves y and the gradients
# by a few % (docs/fp8.md), so their bound is looser.
FP8_CHECK_TOL = 0.1
WEIGHT_STD = 0.02
BIAS_STD = 0.1  # the experts' biases, where a shape has them
FLUSH_BYTES = 256 * 1024 * 1024
# Correctness check at the full T while the reference's forward stays this cheap;
# otherwise on the first AUTO_CHECK_TOKENS tokens (a fresh run at reduced T).
AUTO_CHECK_MAX_FLOPS = 2e12
AUTO_CHECK_TOKENS = 512
PEAK_N = 8192


# ----------------------------------------------------------------------------------------
# torch-unfused: argsort permute -> grouped GEMM fc1 -> SwiGLU -> grouped GEMM fc2 ->
# unpermute -> fp32 weighted sum (+ shared expert)
# ----------------------------------------------------------------------------------------

_CPU_GROUPED_MM_OK: dict = {}


def _cpu_grouped_mm_works(dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs (forward and backward) on the CPU for `dtype`.
    MOK_BENCH_GROUPED_MM_LOOP=1 forces the per-expert loop (tests)."""
    if os.environ.get("MOK_BENCH_GROUPED_MM_LOOP") == "1" or dtype != torch.bfloat16:
        return False
    if dtype not in _CPU_GROUPED_MM_OK:
        try:
            with torch.enable_grad():
                g = torch.Generator().manual_seed(0)
                a = torch.randn(6, 16, generator=g).to(dtype).requires_grad_(True)
                w = torch.randn(2, 8, 16, generator=g).to(dtype).requires_grad_(True)
                offs = torch.tensor([2, 6], dtype=torch.int32)
                out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
                out.backward(torch.randn(out.shape, generator=g).to(dtype))
                ref = torch.cat([a[:2] @ w[0].t(), a[2:] @ w[1].t()])
                ok = bool(torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-1))
                ok = ok and a.grad is not None and w.grad is not None
        except Exception:  # no CPU kernel / no autograd formula: use the loop
            ok = False
        _CPU_GROUPED_MM_OK[dtype] = ok
    return _CPU_GROUPED_MM_OK[dtype]


def grouped_mm_impl(device, dtype: torch.dtype = torch.bfloat16) -> str:
    device = torch.device(device)
    if device.type == "cuda" or _cpu_grouped_mm_works(dtype):
        return "torch._grouped_mm"
    return "per-expert loop"


def _grouped_linear_loop(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(a[start:end] @ w[g].t())
        start = end
    if start < a.shape[0]:  # rows of dropped (-1) routes, sorted last
        parts.append(a.new_zeros(a.shape[0] - start, w.shape[1]))
    return torch.cat(parts)


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group a_g @ w[g]^T: a [M, K] row-major with rows grouped by `offs` (int32
    cumulative group ends), w [G, N, K] (nn.Linear layout) -> [M, N].

    torch._grouped_mm takes mat_a [M, K] and mat_b [G, K, N]; w.transpose(-2, -1) is that
    [G, K, N] as a column-major view (strides (N·K, 1, K)): no copy. Rows past offs[-1]
    are not written by the grouped GEMM. On the GPU this is always torch._grouped_mm; on
    the CPU, a per-expert loop where torch._grouped_mm has no CPU kernel.
    """
    if a.is_cuda or _cpu_grouped_mm_works(a.dtype):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    return _grouped_linear_loop(a, w, offs)


def torch_unfused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor,
                      shared_w1: Optional[torch.Tensor] = None,
                      shared_w2: Optional[torch.Tensor] = None, *,
                      has_dropped_routes: bool = False, activation=None,
                      b1: Optional[torch.Tensor] = None,
                      b2: Optional[torch.Tensor] = None,
                      linear: Callable = None) -> torch.Tensor:
    """The unfused PyTorch MoE layer ("NCCL + PyTorch" at EP=1), differentiable.

    x [T, H]; topk_idx [T, K] expert ids in [0, E) (-1 only with has_dropped_routes);
    topk_w [T, K] fp32; w1 [E, 2I, H] = [gate; up]; w2 [E, H, I]; shared [2Is, H], [H, Is].
    activation: a megatron_mok ExpertActivation (None: SwiGLU); b1 [E, 2I] / b2 [E, H]: the
    experts' biases. linear: the experts' grouped GEMM (grouped_linear; torch-fp8's
    fp8_grouped_linear). No host synchronisation on the GPU.
    """
    linear = linear or grouped_linear
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    num_experts = w1.shape[0]
    flat = topk_idx.reshape(-1).long()
    key = torch.where(flat < 0, num_experts, flat) if has_dropped_routes else flat
    order = torch.argsort(key, stable=True)                      # routes sorted by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:num_experts].cumsum(0, dtype=torch.int32)    # group ends
    x_perm = x.index_select(0, order // topk)                     # permute
    h = linear(x_perm, w1, offs)                                  # fc1 [TK, 2I]
    expert_of = key.index_select(0, order).clamp(max=num_experts - 1) if b1 is not None else None
    if b1 is not None:  # in fp32: the bias gradients then sum in fp32 too
        h = h + b1.float().index_select(0, expert_of)
    if activation is None:
        gate, up = h.chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype)                     # SwiGLU
    else:
        act = activation(h).to(x.dtype)
    out = linear(act, w2, offs)                                   # fc2 [TK, H]
    if b2 is not None:
        out = out + b2.float().index_select(0, expert_of)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=x.device))
    slots = out.index_select(0, inverse).view(num_tokens, topk, hidden)  # unpermute
    weights = topk_w.float()
    if has_dropped_routes:
        valid = topk_idx >= 0
        weights = torch.where(valid, weights, torch.zeros_like(weights))
        slots = torch.where(valid.unsqueeze(-1), slots, torch.zeros_like(slots))
    y = (slots * weights.unsqueeze(-1)).sum(dim=1)                # fp32 weighted sum
    if shared_w1 is not None:
        sh = x @ shared_w1.t()
        if activation is None:
            sg, su = sh.chunk(2, dim=-1)
            shared_act = F.silu(sg) * su
        else:
            shared_act = activation(sh).to(x.dtype)
        y = y + (shared_act @ shared_w2.t()).float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Weights:
    w1: torch.Tensor
    w2: torch.Tensor
    shared_w1: Optional[torch.Tensor] = None
    shared_w2: Optional[torch.Tensor] = None
    b1: Optional[torch.Tensor] = None  # the experts' biases (shapes with expert_bias)
    b2: Optional[torch.Tensor] = None

    def tensors(self) -> tuple:
        return (self.w1, self.w2, self.shared_w1, self.shared_w2)

    def biases(self) -> dict:
        return {} if self.b1 is None else {"b1": self.b1, "b2": self.b2}

    def leaves(self) -> list:
        return [t for t in (*self.tensors(), self.b1, self.b2) if t is not None]


def make_weights(local: S.LocalShape, device, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> Weights:
    """Expert (and shared expert) weights with std WEIGHT_STD, leaves requiring grad."""
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 1)

    def rnd(*shape):
        t = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return t.mul_(WEIGHT_STD).requires_grad_(True)

    e, h, i = local.num_local_experts, local.hidden, local.inter
    fc1_rows = S.fc1_rows_per_inter(local.activation) * i  # w1 [E, 2I, H] or [E, I, H]
    if local.shared_inter == i and fc1_rows == 2 * i:
        # The shared weights right after the experts' in one storage, so that
        # MOK_SHARED_EXPERT=folded reads them stacked without a copy (megatron_mok.shared_fold).
        w1, w2 = rnd(e + 1, 2 * i, h).detach(), rnd(e + 1, h, i).detach()
        return Weights(*(t.requires_grad_(True) for t in (w1[:e], w2[:e], w1[e], w2[e])))
    w = Weights(rnd(e, fc1_rows, h), rnd(e, h, i))
    if local.shared_inter:
        w.shared_w1 = rnd(fc1_rows // i * local.shared_inter, h)
        w.shared_w2 = rnd(h, local.shared_inter)
    if local.expert_bias:  # BIAS_STD / WEIGHT_STD times the weights' std
        w.b1, w.b2 = (rnd(*shape).detach().mul_(BIAS_STD / WEIGHT_STD).requires_grad_(True)
                      for shape in ((e, fc1_rows), (e, h)))
    return w


@dataclasses.dataclass
class CaseInputs:
    x: torch.Tensor        # [T, H] bf16
    topk_idx: torch.Tensor  # [T, K] int32
    topk_w: torch.Tensor   # [T, K] fp32
    dy: torch.Tensor       # [T, H] bf16

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def head(self, n: int) -> "CaseInputs":
        if n >= self.num_tokens:
            return self
        return CaseInputs(*(t[:n].contiguous() for t in (self.x, self.topk_idx, self.topk_w,
                                                         self.dy)))


def make_case(local: S.LocalShape, num_tokens: int, routing: str, device, seed: int = 0,
              dtype: torch.dtype = torch.bfloat16) -> CaseInputs:
    # EP=1 proxy: the routing is over this rank's E_loc experts; "adversarial" (all tokens
    # on one rank's experts) is the same as balanced here (every local expert is on it).
    idx, w = S.make_routing(routing, num_tokens, local.num_local_experts, local.topk,
                            seed=seed + 2, device=device, ep_size=1)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed + 3)
    x = torch.randn(num_tokens, local.hidden, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(num_tokens, local.hidden, generator=gen, device=device, dtype=dtype)
    return CaseInputs(x, idx, w, dy)


# ----------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------

class Backend:
    """prepare() builds the per-call inputs (outside timing); run() is the timed layer call."""

    name = ""

    def __init__(self, weights: Weights):
        self.weights = weights
        self.info: dict = {}

    def prepare(self, case: CaseInputs) -> dict:
        return {"x": case.x.detach().requires_grad_(True), "topk_idx": case.topk_idx,
                "topk_w": case.topk_w.detach().requires_grad_(True)}

    def run(self, inp: dict) -> torch.Tensor:
        raise NotImplementedError

    def leaves(self, inp: dict) -> list:
        return [inp["x"], inp["topk_w"], *self.weights.leaves()]

    def grads(self, inp: dict) -> dict:
        w = self.weights
        out = {"dx": inp["x"].grad, "d_topk_w": inp["topk_w"].grad, "dw1": w.w1.grad,
               "dw2": w.w2.grad}
        if w.shared_w1 is not None:
            out["d_shared_w1"], out["d_shared_w2"] = w.shared_w1.grad, w.shared_w2.grad
        if w.b1 is not None:
            out["db1"], out["db2"] = w.b1.grad, w.b2.grad
        return out

    def close(self) -> None:
        pass


class TorchUnfusedBackend(Backend):
    name = "torch-unfused"

    def __init__(self, weights: Weights, device, activation=None, fp8: bool = False):
        super().__init__(weights)
        self.activation = activation
        self.linear = None
        self.info = {"grouped_gemm": grouped_mm_impl(device, weights.w1.dtype)}
        if fp8:  # the routed experts' GEMMs in row-wise FP8 (the shared expert stays BF16)
            from benchmarks.torch_fp8 import fp8_grouped_linear
            self.name, self.linear = "torch-fp8", fp8_grouped_linear
            self.info = {"grouped_gemm": "torch._scaled_grouped_mm (row-wise E4M3)"
                         if torch.device(device).type == "cuda" else "dequantised loop"}

    def run(self, inp):
        return torch_unfused_moe(inp["x"], inp["topk_idx"], inp["topk_w"], *self.weights.tensors(),
                                 activation=self.activation, **self.weights.biases(),
                                 linear=self.linear)


class MokBackend(Backend):
    name = "mok"

    def __init__(self, weights: Weights, device, mok_backend: str = "auto",
                 activation: str = "swiglu", fp8: bool = False, reuse_fp8_weights=False):
        super().__init__(weights)
        from megatron_mok import functional
        from megatron_mok.config import MoKConfig
        self.fused_moe = functional.fused_moe
        self.config = MoKConfig(backend=mok_backend, activation=S.activation_of(activation),
                                expert_bias=weights.b1 is not None,
                                fp8="blockwise" if fp8 else None, fp8_wgrad="bf16")
        if fp8:  # the kernel backend's FP8 path is opt-in
            from megatron_mok import knobs
            knobs.set_env("MOK_FP8_KERNELS", "1")
            self.name = "mok-fp8-reuse" if reuse_fp8_weights else "mok-fp8"
        self.fp8_cache = None
        if fp8 and reuse_fp8_weights:  # valid: the benchmark never updates the weights
            from megatron_mok.kernels.fp8_weight_cache import Fp8WeightCache
            self.fp8_cache = Fp8WeightCache(reuse=True)
        self.resolved = functional.resolve_backend(self.config, torch.device(device),
                                                   weights.w1.dtype)
        self.info = {"mok_backend": self.resolved, "mok_backend_requested": mok_backend}
        if self.resolved == "kernel":  # which expert-GEMM engine ran (MOK_GEMM_CORE)
            from megatron_mok.kernels.backend import gemm_core
            self.info["gemm_core"] = gemm_core()
            self.info["gemm_cluster"] = os.environ.get("MOK_GEMM_CLUSTER", "1")
            # Which forward path ran: MOK_FORWARD, else the autotune cache's plan, else the
            # launch chain (megatron_mok.kernels.autotune.forward_plan).
            from megatron_mok.kernels import autotune
            self.info["mok_forward"] = os.environ.get("MOK_FORWARD", "auto")
            self.info["mok_backward"] = os.environ.get("MOK_BACKWARD", "launches")
            self.info["mok_ep1_combine"] = os.environ.get("MOK_EP1_COMBINE", "rows")
            self.info["mok_wgrad_gather"] = os.environ.get("MOK_WGRAD_GATHER", "0")
            cache = autotune.cache_file()
            self.info["autotune_cache"] = str(cache) if cache.exists() else None

    def run(self, inp):
        extra = {"fp8_cache": self.fp8_cache} if self.fp8_cache is not None else {}
        return self.fused_moe(inp["x"], inp["topk_idx"], inp["topk_w"], *self.weights.tensors(),
                              config=self.config, **self.weights.biases(), **extra)

    def close(self):
        from megatron_mok.functional import clear_workspace_cache
        clear_workspace_cache()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MEGATRON_READY = False


def init_megatron_single_rank(device: torch.device, seed: int = 0) -> None:
    """torch.distributed with one rank (NCCL on the GPU, gloo on the CPU, rendezvous on
    127.0.0.1) and Megatron's parallel_state for TP = PP = EP = 1."""
    global _MEGATRON_READY
    if _MEGATRON_READY:
        return
    import torch.distributed as dist
    if device.type == "cpu":
        from megatron_mok.megatron.cpu_shims import apply_cpu_shims
        apply_cpu_shims()
    else:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                                world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    _MEGATRON_READY = True


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False


def init_megatron_ep(device: torch.device, ep_size: int, seed: int = 0) -> None:
    """Megatron's parallel_state with EP = the whole (already initialised) world."""
    global _MEGATRON_READY
    if _MEGATRON_READY:
        return
    if device.type == "cpu":
        from megatron_mok.megatron.cpu_shims import apply_cpu_shims
        apply_cpu_shims()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=ep_size)
    model_parallel_cuda_manual_seed(seed)
    _MEGATRON_READY = True


def build_megatron_moe_layer(local: S.LocalShape, weights: Weights, device: torch.device, *,
                             use_te: bool, permute_fusion: bool, act_fusion: bool,
                             seed: int = 0, ep_size: int = 1, flex_backend: str = "",
                             fp8: bool = False):
    """Megatron-Core's MoELayer with the `alltoall` dispatcher (EP = ep_size over the
    whole world; 1: a one-rank world of its own), its experts module from Megatron's own
    spec (TEGroupedMLP with TE, else SequentialMLP), weights copied from the benchmark's.
    The router is built but bypassed (see MegatronBackend). flex_backend ("deepep",
    "hybridep"): the `flex` dispatcher with that backend instead of `alltoall`. fp8: the
    config of `--fp8-format e4m3 --fp8-recipe blockwise` (TEGroupedMLP then pads each
    expert's rows for FP8 itself; run the layer under Megatron's get_fp8_context)."""
    if ep_size == 1:
        init_megatron_single_rank(device, seed)
    else:
        init_megatron_ep(device, ep_size, seed)
    import megatron_mok.megatron  # noqa: F401  (the plugin; only expert_weight_list is used)
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_mok.megatron.layer import expert_weight_list

    h, e_loc = local.hidden, local.num_local_experts
    heads = 8 if h % 8 == 0 else 1
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=local.inter,
        moe_ffn_hidden_size=local.inter, num_moe_experts=e_loc * ep_size,
        moe_router_topk=local.topk,
        moe_shared_expert_intermediate_size=local.shared_inter or None,
        moe_token_dispatcher_type="flex" if flex_backend else "alltoall",
        **({"moe_flex_dispatcher_backend": flex_backend} if flex_backend else {}),
        moe_grouped_gemm=use_te,
        moe_permute_fusion=permute_fusion, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, bias_activation_fusion=act_fusion, bf16=True,
        params_dtype=torch.bfloat16, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        perform_initialization=False, use_cpu_initialization=device.type == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=1, expert_model_parallel_size=ep_size, sequence_parallel=False,
        **({"fp8": "e4m3", "fp8_recipe": "blockwise"} if fp8 else {}))
    builder = get_moe_module_spec(use_te=use_te, num_experts=e_loc * ep_size,
                                  moe_grouped_gemm=use_te)
    layer = builder(config=config, pg_collection=get_default_pg_collection())
    layer = layer.to(device).train()

    fc1, fc2 = expert_weight_list(layer.experts)
    if len(fc1) != e_loc:
        raise RuntimeError(f"Megatron built {len(fc1)} local experts, expected {e_loc}")
    with torch.no_grad():
        for e in range(e_loc):
            if fc1[e].shape != weights.w1[e].shape or fc2[e].shape != weights.w2[e].shape:
                raise RuntimeError(f"expert weight shapes {tuple(fc1[e].shape)}/"
                                   f"{tuple(fc2[e].shape)} differ from the benchmark's "
                                   f"{tuple(weights.w1[e].shape)}/{tuple(weights.w2[e].shape)}")
            fc1[e].copy_(weights.w1[e])
            fc2[e].copy_(weights.w2[e])
        if local.shared_inter:
            shared = layer.shared_experts
            shared.linear_fc1.weight.copy_(weights.shared_w1)
            shared.linear_fc2.weight.copy_(weights.shared_w2)
    info = {"experts_module": type(layer.experts).__name__, "transformer_engine": use_te,
            "fp8_recipe": "blockwise" if fp8 else None,
            "moe_permute_fusion": permute_fusion, "bias_activation_fusion": act_fusion,
            "dispatcher": type(layer.token_dispatcher).__name__}
    return layer, (fc1, fc2), info


class MegatronBackend(Backend):
    """Megatron-Core's MoELayer (`alltoall`), route() replaced by the benchmark's routing:
    probs [T, E_loc] fp32 (topk_w scattered; a leaf, so the probs gradient is computed as
    the router would receive it) and routing_map [T, E_loc] bool."""

    name = "megatron-alltoall"

    def __init__(self, local: S.LocalShape, weights: Weights, device, seed: int = 0,
                 ep_size: int = 1, flex_backend: str = "", require_te: bool = False,
                 fp8: bool = False):
        super().__init__(weights)
        if flex_backend:
            self.name = f"megatron-flex-{flex_backend}"
        if require_te:
            self.name = "megatron-te"
        if fp8:  # Megatron's FP8 layer: TE's blockwise recipe, TE required
            if not require_te:
                raise ValueError("Megatron's FP8 MoE layer needs Transformer Engine "
                                 "(require_te=True)")
            self.name = "megatron-te-fp8"
        self.fp8 = fp8
        self.local = local
        self.ep_size = ep_size
        self.device = torch.device(device)
        self._route = None
        # megatron-te: TEGroupedMLP + fused permute (Megatron-LM's defaults with TE), fused
        # SwiGLU if it builds; megatron-alltoall: the local spec (SequentialMLP). The first
        # variant that builds and runs a smoke forward + backward is used, and what failed
        # before it is recorded.
        attempts = [(True, True, True), (True, True, False), (True, False, True),
                    (False, False, True), (False, False, False)]
        if require_te:  # Megatron-LM users' default: TEGroupedMLP, fused permute, TE only
            if not te_available():
                raise RuntimeError("megatron-te needs Transformer Engine (import "
                                   "transformer_engine.pytorch failed); scripts/gpu_check.sh "
                                   "TE=1 unpacks it on the GPU machine")
            attempts = [a for a in attempts if a[0] and a[1]]
        else:  # Megatron without TE: the local spec's SequentialMLP
            attempts = [a for a in attempts if not a[0]]
        errors = []
        for use_te, permute_fusion, act_fusion in attempts:
            try:
                self.layer, (self.fc1, self.fc2), self.info = build_megatron_moe_layer(
                    local, weights, self.device, use_te=use_te, permute_fusion=permute_fusion,
                    act_fusion=act_fusion, seed=seed, ep_size=ep_size,
                    flex_backend=flex_backend, fp8=fp8)
                self.layer.route = self._fixed_route
                self._smoke_test(seed)
                break
            except Exception as err:  # e.g. torch.compile of the fused SwiGLU unavailable
                errors.append(f"te={use_te} permute_fusion={permute_fusion} "
                              f"bias_activation_fusion={act_fusion}: {_short_error(err)}")
                self.layer = self.fc1 = self.fc2 = None
                _free_memory(self.device)
        else:
            raise RuntimeError("; ".join(errors))
        if errors:
            self.info["construction_warnings"] = errors

    def _fixed_route(self, hidden_states, padding_mask=None):
        return self._route

    def _smoke_test(self, seed):
        case = make_case(self.local, min(256, 64 * self.local.topk), "balanced", self.device,
                         seed=seed + 100)
        inp = self.prepare(case)
        y = self.run(inp)
        torch.autograd.backward(y, case.dy)
        for t in self.leaves(inp):
            t.grad = None

    def prepare(self, case):
        t, e = case.num_tokens, self.local.num_local_experts * self.ep_size  # global ids
        idx = case.topk_idx.long()
        probs = torch.zeros(t, e, dtype=torch.float32, device=case.x.device)
        probs.scatter_(1, idx, case.topk_w.float())
        routing_map = torch.zeros(t, e, dtype=torch.bool, device=case.x.device)
        routing_map.scatter_(1, idx, True)
        x = case.x.detach().reshape(t, 1, -1).requires_grad_(True)  # [S, B, H]
        return {"x": x, "probs": probs.requires_grad_(True), "routing_map": routing_map,
                "topk_idx": idx}

    def run(self, inp):
        self._route = (inp["probs"], inp["routing_map"])
        with self._fp8_context():
            out, _ = self.layer(inp["x"])
        self._route = None
        return out.reshape(inp["x"].shape[0], -1)

    def _fp8_context(self):
        """What Megatron's TransformerBlock wraps each layer in: TE's autocast with the
        config's recipe (Float8BlockScaling) under megatron-te-fp8, else nothing."""
        if not self.fp8:
            return contextlib.nullcontext()
        from megatron.core.fp8_utils import get_fp8_context
        return get_fp8_context(self.layer.config)

    def leaves(self, inp):
        return [inp["x"], inp["probs"], *self.layer.parameters()]

    def grads(self, inp):
        def stack(params):
            return torch.stack([p.grad if p.grad is not None else torch.zeros_like(p)
                                for p in params])
        out = {"dx": inp["x"].grad.reshape(inp["x"].shape[0], -1),
               "d_topk_w": inp["probs"].grad.gather(1, inp["topk_idx"]),
               "dw1": stack(self.fc1), "dw2": stack(self.fc2)}
        if self.local.shared_inter:
            shared = self.layer.shared_experts
            out["d_shared_w1"] = shared.linear_fc1.weight.grad
            out["d_shared_w2"] = shared.linear_fc2.weight.grad
        return out

    def close(self):
        self.layer = self.fc1 = self.fc2 = None


def make_backend(name: str, local: S.LocalShape, weights: Weights, device, args) -> Backend:
    if name == "mok":
        return MokBackend(weights, device, args.mok_backend, local.activation)
    if name == "mok-fp8":  # the routed experts in blockwise FP8 (weight gradients in BF16)
        return MokBackend(weights, device, args.mok_backend, local.activation, fp8=True)
    if name == "mok-fp8-reuse":  # the same, weights quantised once per step (reused)
        return MokBackend(weights, device, args.mok_backend, local.activation, fp8=True,
                          reuse_fp8_weights=True)
    if name == "torch-fp8":
        if local.activation != "swiglu" or local.expert_bias:
            raise ValueError("torch-fp8 runs plain SwiGLU experts without biases only")
        return TorchUnfusedBackend(weights, device, fp8=True)
    if name == "torch-unfused":
        plain = local.activation == "swiglu"
        return TorchUnfusedBackend(weights, device, None if plain else S.activation_of(local.activation))
    if local.activation != "swiglu" or local.expert_bias:
        raise ValueError(f"{name} runs plain SwiGLU experts without biases only")
    if name == "megatron-alltoall":
        return MegatronBackend(local, weights, device, seed=args.seed)
    if name == "megatron-te":
        return MegatronBackend(local, weights, device, seed=args.seed, require_te=True)
    if name == "megatron-te-fp8":
        return MegatronBackend(local, weights, device, seed=args.seed, require_te=True, fp8=True)
    if name == "sonicmoe":
        from benchmarks.sonicmoe_baseline import SonicMoEBackend
        return SonicMoEBackend(weights, device)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


# ----------------------------------------------------------------------------------------
# Reference and correctness gate
# ----------------------------------------------------------------------------------------

def reference_outputs(case: CaseInputs, weights: Weights, want_grads: bool,
                      activation: str = "swiglu") -> dict:
    """y and (optionally) every gradient of moe_reference on the case."""
    from megatron_mok.reference import moe_reference
    x = case.x.detach().requires_grad_(want_grads)
    w = case.topk_w.detach().requires_grad_(want_grads)
    ws = [None if t is None else t.detach().requires_grad_(want_grads)
          for t in (*weights.tensors(), weights.b1, weights.b2)]
    with torch.enable_grad() if want_grads else torch.no_grad():
        y = moe_reference(x, case.topk_idx, w, *ws[:4], check=True,
                          activation=S.activation_of(activation), b1=ws[4], b2=ws[5])
    out = {"y": y.detach()}
    if want_grads:
        names = ["dx", "d_topk_w", "dw1", "dw2", "d_shared_w1", "d_shared_w2", "db1", "db2"]
        leaves = [x, w, *ws]
        pairs = [(n, t) for n, t in zip(names, leaves) if t is not None]
        grads = torch.autograd.grad(y, [t for _, t in pairs], case.dy)
        out["grads"] = {n: g for (n, _), g in zip(pairs, grads)}
    return out


def check_backend(backend: Backend, case: CaseInputs, ref: dict) -> dict:
    """Forward (and backward, where ref has grads) relative L2 errors vs the reference."""
    inp = backend.prepare(case)
    for t in backend.leaves(inp):
        t.grad = None
    want_grads = "grads" in ref
    with torch.enable_grad() if want_grads else torch.no_grad():
        y = backend.run(inp)
    result = {"fwd_rel_l2": rel_l2(y, ref["y"]), "finite": bool(torch.isfinite(y).all())}
    if want_grads:
        torch.autograd.backward(y, case.dy)
        got = backend.grads(inp)
        errs = {}
        for name, want in ref["grads"].items():
            g = got.get(name)
            errs[name] = float("inf") if g is None else rel_l2(g, want)
        result["bwd_rel_l2"] = errs
        result["bwd_rel_l2_max"] = max(errs.values()) if errs else None
    for t in backend.leaves(inp):
        t.grad = None
    return result


def resolve_check_tokens(spec: str, local: S.LocalShape, num_tokens: int) -> int:
    if spec == "full":
        return num_tokens
    if spec == "auto":
        flops = S.forward_flops(num_tokens, local.hidden, local.inter, local.topk,
                                local.shared_inter)
        return num_tokens if flops <= AUTO_CHECK_MAX_FLOPS else min(num_tokens, AUTO_CHECK_TOKENS)
    return max(1, min(int(spec), num_tokens))


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------

class Timer:
    """CUDA-event timing (wall clock on the CPU); an L2-flushing write of FLUSH_BYTES is
    enqueued before every iteration's start event."""

    def __init__(self, device: torch.device, flush_bytes: int = FLUSH_BYTES):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush_buf = (torch.empty(flush_bytes, dtype=torch.uint8, device=device)
                          if self.cuda and flush_bytes else None)

    def measure(self, prepare: Callable[[], object], op: Callable[[object], object],
                warmup: int, iters: int) -> list[float]:
        """ms of op(prepare()) per timed iteration; prepare() is not timed."""
        pairs, times = [], []
        for i in range(warmup + iters):
            state = prepare()
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = op(state)
                end.record()
                if i >= warmup:
                    pairs.append((start, end))
            else:
                t0 = time.perf_counter()
                out = op(state)
                t1 = time.perf_counter()
                if i >= warmup:
                    times.append((t1 - t0) * 1e3)
            del out, state
        if self.cuda:
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in pairs]
        return times


def mok_on_shape(name: str, num_tokens: int, device: torch.device):
    """(case, MokBackend, its inputs) of the ep8-proxy share of shape `name`, balanced
    routing: the set-up of the host-side tools (benchmarks.host_sync, host_profile)."""
    local = S.ep8_proxy(S.get_shape(name))
    case = make_case(local, num_tokens, "balanced", device)
    backend = MokBackend(make_weights(local, device), device)
    return case, backend, backend.prepare(case)


def host_call_ms(device: torch.device, prepare: Callable[[], object],
                 op: Callable[[object], object], calls: int = HOST_CALLS) -> Optional[float]:
    """Median CPU wall time for op(prepare()) to return, each call issued on an idle GPU
    (a sync before it, none inside): the host cost of one layer call, which a model whose
    CPU does not run ahead pays in full (BENCHMARKS.md)."""
    if device.type != "cuda":
        return None
    times = []
    for _ in range(calls):
        state = prepare()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = op(state)
        times.append((time.perf_counter() - t0) * 1e3)
        del out, state
    torch.cuda.synchronize(device)
    return statistics.median(times)


def saved_bytes(device: torch.device, backend: Backend, inp: dict) -> Optional[int]:
    """Device bytes one training forward leaves allocated besides its output: what the
    layer keeps for its backward (after warm-up, so persistent workspaces and caches are
    not counted)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with torch.enable_grad():
        y = backend.run(inp)
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - y.numel() * y.element_size()
    del y
    return int(kept)


def time_forward(timer: Timer, backend: Backend, case: CaseInputs, warmup: int,
                 iters: int) -> tuple[list[float], Optional[float], Optional[int]]:
    """Training forward (autograd on): the whole layer call, schedule build included.
    (GPU ms per timed iteration, host ms of one call, bytes kept for the backward)."""
    inp = backend.prepare(case)

    def prepare():
        for t in backend.leaves(inp):
            t.grad = None
        return inp

    with torch.enable_grad():
        times = timer.measure(prepare, backend.run, warmup, iters)
        host = host_call_ms(timer.device, prepare, backend.run)
    return times, host, saved_bytes(timer.device, backend, prepare())


def time_backward(timer: Timer, backend: Backend, case: CaseInputs, warmup: int,
                  iters: int) -> tuple[list[float], Optional[float], None]:
    """autograd.backward(y, dy) only; the forward runs (untimed) before each iteration.
    (GPU ms per timed iteration, host ms of one backward call, None)."""
    inp = backend.prepare(case)
    dy = case.dy

    def prepare():
        for t in backend.leaves(inp):
            t.grad = None
        with torch.enable_grad():
            return backend.run(inp)

    def op(y):
        torch.autograd.backward(y, dy)

    times = timer.measure(prepare, op, warmup, iters)
    host = host_call_ms(timer.device, prepare, op)
    for t in backend.leaves(inp):
        t.grad = None
    return times, host, None


def measure_dense_peak(device: torch.device, n: int = PEAK_N, warmup: int = 5,
                       iters: int = 20) -> float:
    """Dense BF16 n^3 matmul TFLOP/s (median)."""
    if device.type != "cuda":
        n, warmup, iters = min(n, 1024), 1, 3
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    timer = Timer(device, flush_bytes=0)
    times = timer.measure(lambda: None, lambda _: torch.mm(a, b, out=c), warmup, iters)
    return 2.0 * n ** 3 / (statistics.median(times) * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------
# Run metadata, records, output
# ----------------------------------------------------------------------------------------

def gpu_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    low = name.lower()
    m = re.search(r"\b(gb\d{3}|[abhlt]\d{2,3}[a-z]?|rtx\s?\d{4})\b", low)
    if m:
        return re.sub(r"\s+", "", m.group(1))
    words = [w for w in re.split(r"[^a-z0-9]+", low) if w and w != "nvidia"]
    return words[0] if words else "unknown"


def git_info() -> tuple[Optional[str], Optional[bool]]:
    """(commit, dirty) of the tree that runs (benchmarks.provenance: from the carried
    stamp on the GPU machine, from git here)."""
    from benchmarks.provenance import source_state
    commit, dirty, _ = source_state()
    return commit, dirty


def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:
        return None


def run_metadata(device: torch.device, args) -> dict:
    commit, dirty = git_info()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        gpu = {"gpu": name, "gpu_short": gpu_short_name(name),
               "sm": f"{props.major}.{props.minor}", "num_sms": props.multi_processor_count,
               "gpu_memory_gib": round(props.total_memory / 2 ** 30, 1)}
    else:
        gpu = {"gpu": "cpu", "gpu_short": "cpu", "sm": None, "num_sms": None,
               "gpu_memory_gib": None}
    return {
        "date": datetime.date.today().isoformat(),
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        **gpu,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "megatron_core": _version("megatron-core"),
        "transformer_engine": _version("transformer-engine") or _version("transformer_engine"),
        "git_commit": commit, "git_dirty": dirty,
        # The tree's commit when the copy that runs has stale git metadata (device runs).
        "source_commit": os.environ.get("MOK_SOURCE_COMMIT"),
        # The MOK_* knobs set for the run (which kernel variants ran).
        "mok_env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("MOK_") and k != "MOK_SOURCE_COMMIT"},
        "argv": sys.argv[1:], "warmup": args.warmup, "iters": args.iters,
        "flush_bytes": FLUSH_BYTES if device.type == "cuda" else 0,
        "check_tol": CHECK_TOL, "weight_std": WEIGHT_STD, "seed": args.seed,
    }


RUN_FIELDS = ("gpu", "gpu_short", "torch", "cuda", "git_commit", "git_dirty", "date")


def make_record(meta: dict, shape: S.Shape, local: S.LocalShape, num_tokens: int,
                routing: str, backend: str, which: str, peak: float, *,
                times: Optional[list] = None, check: Optional[dict] = None,
                check_tokens: Optional[int] = None, info: Optional[dict] = None,
                error: Optional[str] = None, warmup: int = 0,
                host_ms: Optional[float] = None, saved_bytes: Optional[int] = None) -> dict:
    flops = S.pass_flops(local, num_tokens, which)
    floor_ms = S.gemm_floor_ms(flops, peak)
    rec = {
        "shape": shape.name, "T": num_tokens, "routing": routing, "backend": backend,
        "pass": which,
        "correct": None, "rel_l2": None, "check_tokens": check_tokens,
        "ms": None, "ms_min": None, "ms_p90": None, "iters": 0, "warmup": warmup,
        "host_ms": host_ms, "saved_bytes": saved_bytes,
        "tflops": None, "frac_peak": None, "floor_ms": floor_ms, "time_over_floor": None,
        "speedup": {}, "flops": flops, "peak_tflops": peak,
        "H": local.hidden, "I": local.inter, "E": shape.num_experts,
        "E_loc": local.num_local_experts, "K": local.topk, "shared_I": local.shared_inter,
        "activation": local.activation, "expert_bias": local.expert_bias,
        "info": info or {}, "check": check or {}, "error": error,
        **{k: meta.get(k) for k in RUN_FIELDS},
    }
    if check:
        err = check.get("fwd_rel_l2") if which == "fwd" else check.get("bwd_rel_l2_max")
        if err is not None:
            rec["rel_l2"] = err
            tol = FP8_CHECK_TOL if backend in FP8_BACKENDS else CHECK_TOL
            rec["correct"] = bool(err <= tol and check.get("finite", True))
    if times:
        ms = statistics.median(times)
        rec.update(ms=ms, ms_min=min(times), iters=len(times),
                   ms_p90=sorted(times)[min(len(times) - 1, int(math.ceil(0.9 * len(times))) - 1)],
                   tflops=flops / (ms * 1e-3) / 1e12)
        rec["frac_peak"] = rec["tflops"] / peak
        rec["time_over_floor"] = ms / floor_ms
    return rec


def fill_speedups(records: list) -> None:
    """speedup[b] = ms(b) / ms(this) for every baseline b measured on the same case."""
    by_case: dict = {}
    for r in records:
        by_case.setdefault((r["shape"], r["T"], r["routing"], r["pass"]), []).append(r)
    for group in by_case.values():
        base_ms = {r["backend"]: r["ms"] for r in group
                   if r["backend"] in BASELINES and r["ms"]}
        bf16_mok = next((r["ms"] for r in group if r["backend"] == "mok" and r["ms"]), None)
        for r in group:
            r["speedup"] = {b: ms / r["ms"] for b, ms in base_ms.items()
                            if b != r["backend"] and r["ms"]}
            if r["backend"] in FP8_BACKENDS and bf16_mok and r["ms"]:  # FP8 over our BF16
                r["speedup"]["mok"] = bf16_mok / r["ms"]


def output_path(out_dir: Path, meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['date']}-{meta['gpu_short']}-layer-ep1"
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    return path


def write_results(path: Path, meta: dict, records: list, complete: bool) -> None:
    fill_speedups(records)
    doc = {"benchmark": "layer-ep1", "complete": complete, "meta": meta, "records": records}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------

class Progress:
    """tqdm when importable, else a one-line printer on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()
        self.tty = sys.stderr.isatty()
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
        except Exception:
            self.bar = None

    def step(self, desc: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_description_str(desc[:60])
            self.bar.update(n)
            return
        elapsed = time.time() - self.t0
        if not self.tty:  # logs: one short line per step
            sys.stderr.write(f"[{self.done}/{self.total} {elapsed:.0f}s] {desc}\n")
            sys.stderr.flush()
            return
        width = 24
        filled = int(width * self.done / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.0f}s  {desc[:70]:<70}")
        sys.stderr.flush()

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            sys.stderr.write(("\r" + " " * 120 + "\r" if self.tty else "") + msg + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


# ----------------------------------------------------------------------------------------
# Main loop
# ----------------------------------------------------------------------------------------

def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(S.SHAPES),
                   help="comma list of shapes (default: all six)")
    p.add_argument("--tokens", default=None,
                   help="comma list of tokens per rank (default 4096,8192; --quick: 4096)")
    p.add_argument("--routing", default="balanced",
                   help=f"comma list of {', '.join(S.ROUTINGS)} (default balanced)")
    p.add_argument("--backends", default=",".join(b for b in BACKENDS if b not in FP8_BACKENDS),
                   help="comma list (mok-fp8: the blockwise-FP8 experts, H and I multiples "
                        "of 128, weights quantised every pass; mok-fp8-reuse: once per "
                        "step, as a step's later micro-batches; neither in the default "
                        "list)")
    p.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd or fwd,bwd")
    p.add_argument("--warmup", type=int, default=None, help="default 20 (--quick: 3)")
    p.add_argument("--iters", type=int, default=None, help="default 50 (--quick: 10)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--quick", action="store_true",
                   help="smoke run: warmup 3, iters 10, T=4096, checks on 256 tokens")
    p.add_argument("--mok-backend", default="auto", choices=("auto", "reference", "kernel"))
    p.add_argument("--check-tokens", default=None,
                   help="tokens of the correctness check: auto (full T while the reference "
                        "is cheap, else the first 512), full, or a number")
    p.add_argument("--no-check-bwd", action="store_true",
                   help="check only the forward output against the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (smoke)")
    args = p.parse_args(argv)
    args.shapes = _csv(args.shapes)
    args.tokens = [int(t) for t in _csv(args.tokens)] if args.tokens else \
        ([4096] if args.quick else list(S.DEFAULT_TOKENS))
    args.routing = _csv(args.routing)
    args.backends = _csv(args.backends)
    args.passes = _csv(args.passes)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 20)
    args.iters = args.iters if args.iters is not None else (10 if args.quick else 50)
    args.check_tokens = args.check_tokens or ("256" if args.quick else "auto")
    for name in args.shapes:
        S.get_shape(name)
    for r in args.routing:
        if r not in S.ROUTINGS:
            p.error(f"unknown routing {r!r}; known: {', '.join(S.ROUTINGS)}")
    for b in args.backends:
        if b not in BACKENDS:
            p.error(f"unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    for w in args.passes:
        if w not in PASSES:
            p.error(f"unknown pass {w!r}; known: fwd, bwd")
    if args.check_tokens not in ("auto", "full") and not args.check_tokens.isdigit():
        p.error("--check-tokens must be auto, full or a number")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def _short_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:500] if str(err).strip() else ''}"


def _free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> tuple[Path, list]:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --device cpu for a (slow) smoke run")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    meta = run_metadata(device, args)
    path = output_path(Path(args.out), meta)
    peak = measure_dense_peak(device)
    meta["peak_tflops"] = peak
    meta["peak_what"] = f"dense BF16 {PEAK_N}^3 torch.mm, median" if device.type == "cuda" \
        else "dense BF16 1024^3 torch.mm on the CPU"
    print(f"{meta['gpu']}: dense BF16 peak {peak:.1f} TFLOP/s; torch {meta['torch']} "
          f"CUDA {meta['cuda']}; commit {(meta['git_commit'] or '?')[:12]}"
          f"{'+dirty' if meta['git_dirty'] else ''}; results -> {path}", flush=True)
    if "adversarial" in args.routing:
        print("note: at EP=1 every local expert is on the one rank, so 'adversarial' routing "
              "is balanced routing over the E_loc experts", flush=True)

    timer = Timer(device)
    records: list = []
    steps_per_case = len(args.backends) * (1 + len(args.passes))
    progress = Progress(len(args.shapes) * len(args.tokens) * len(args.routing) * steps_per_case)
    want_bwd_check = "bwd" in args.passes and not args.no_check_bwd

    for shape_name in args.shapes:
        shape = S.get_shape(shape_name)
        local = S.ep8_proxy(shape)
        weights = make_weights(local, device, seed=args.seed)
        backends, build_errors = {}, {}
        for name in args.backends:
            try:
                backends[name] = make_backend(name, local, weights, device, args)
            except Exception as err:
                build_errors[name] = _short_error(err)
                progress.write(f"{shape.name}: {name} unavailable: {build_errors[name]}")
                if os.environ.get("MOK_BENCH_TRACEBACK"):
                    traceback.print_exc()
        for num_tokens in args.tokens:
            for routing in args.routing:
                case = make_case(local, num_tokens, routing, device, seed=args.seed)
                check_tokens = resolve_check_tokens(args.check_tokens, local, num_tokens)
                ref = reference_outputs(case.head(check_tokens), weights, want_bwd_check,
                                        local.activation)
                label = f"{shape.name} T={num_tokens} {routing}"
                for name in args.backends:
                    common = dict(check_tokens=check_tokens, warmup=args.warmup)
                    if name in build_errors:
                        for which in args.passes:
                            records.append(make_record(meta, shape, local, num_tokens, routing,
                                                       name, which, peak,
                                                       error=build_errors[name], **common))
                        progress.step(f"{label} {name} (unavailable)", 1 + len(args.passes))
                        continue
                    backend = backends[name]
                    warmup, iters = args.warmup, args.iters
                    if name == "mok" and backend.resolved == "reference" and device.type == "cuda":
                        warmup, iters = min(warmup, 1), min(iters, 5)
                        common["warmup"] = warmup
                    try:
                        check = check_backend(backend, case.head(check_tokens), ref)
                    except Exception as err:
                        check = {"error": _short_error(err)}
                        progress.write(f"{label} {name}: check failed: {check['error']}")
                    progress.step(f"{label} {name} check")
                    for which in args.passes:
                        try:
                            fn = time_forward if which == "fwd" else time_backward
                            times, host_ms, kept = fn(timer, backend, case, warmup, iters)
                            rec = make_record(meta, shape, local, num_tokens, routing, name,
                                              which, peak, times=times, check=check,
                                              info=dict(backend.info), host_ms=host_ms,
                                              saved_bytes=kept, **common)
                        except Exception as err:
                            rec = make_record(meta, shape, local, num_tokens, routing, name,
                                              which, peak, check=check, info=backend.info,
                                              error=_short_error(err), **common)
                            progress.write(f"{label} {name} {which}: {rec['error']}")
                            if os.environ.get("MOK_BENCH_TRACEBACK"):
                                traceback.print_exc()
                            _free_memory(device)
                        records.append(rec)
                        progress.step(f"{label} {name} {which}")
                        # after every pass: a run cut by a time limit keeps what it timed
                        write_results(path, meta, records, complete=False)
                write_results(path, meta, records, complete=False)
                del case, ref
                _free_memory(device)
        for backend in backends.values():
            backend.close()
        del backends, weights
        _free_memory(device)

    progress.close()
    write_results(path, meta, records, complete=True)
    return path, records


def main(argv=None) -> int:
    args = parse_args(argv)
    path, records = run(args)
    from benchmarks.report import console_table
    print(console_table(records))
    print(f"\nresults: {path}")
    bad = [r for r in records if r["correct"] is False]
    if bad:
        print(f"{len(bad)} record(s) FAILED the correctness check (rel L2 > {CHECK_TOL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
