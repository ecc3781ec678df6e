"""Benchmark shapes (docs/benchmarks.md) and routing workloads.

A shape is one model's MoE layer (H, I, E, K, shared I). The EP=1 layer benchmark runs
its "ep8 proxy": one rank's share of an EP8 run, E_loc = E / 8 local experts and T
tokens routed top-K among them (mixtral-8x7b runs at EP=1, so E_loc = E there).

Routing generators return GPU-side (or any device) `topk_idx` [T, K] int32 (distinct
experts per token, global ids) and `topk_w` [T, K] fp32 (softmax of random logits over
the K picks), seeded and deterministic for a given (seed, device).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

EP8 = 8


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int              # H
    inter: int               # I, per expert
    num_experts: int         # E, whole model
    topk: int                # K
    shared_inter: int = 0    # I of the shared expert (0 = none)
    ep_size: int = EP8       # EP of the proxied run (E_loc = E / ep_size)
    source: str = ""
    activation: str = "swiglu"  # the experts': a key of ACTIVATIONS
    expert_bias: bool = False   # fc1 and fc2 biases (GPT-OSS)

    @property
    def has_shared(self) -> bool:
        return self.shared_inter > 0


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8, 0, EP8, "Qwen3-30B-A3B"),
    Shape("deepseek-v3", 7168, 2048, 256, 8, 2048, EP8, "DeepSeek-V3"),
    Shape("dsv4-pro", 7168, 3072, 384, 6, 3072, EP8, "MoK's default benchmark shape"),
    Shape("qwen3.5-like", 4096, 1024, 512, 10, 0, EP8, "MoK fork benchmark"),
    Shape("gpt-oss-120b", 2880, 2880, 128, 4, 0, EP8, "GPT-OSS-120B"),
    Shape("mixtral-8x7b", 4096, 14336, 8, 2, 0, 1, "Mixtral 8x7B (EP=1)"),
)}

# The same layers with their models' own expert activation and biases, where those differ
# from plain SwiGLU (not in the default set: `--shapes gpt-oss-120b-glu`).
VARIANT_SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("gpt-oss-120b-glu", 2880, 2880, 128, 4, 0, EP8,
          "GPT-OSS-120B experts as published: clamped quick_gelu GLU (clamp 7, offset 1), "
          "fc1 and fc2 biases", activation="gpt-oss", expert_bias=True),
    Shape("qwen3-30b-a3b-relu2", 2048, 768, 128, 8, 0, EP8,
          "Qwen3-30B-A3B's layer with non-gated squared-ReLU experts (Nemotron-style; fc1 "
          "[I, H]: 2/3 of the SwiGLU layer's FLOPs)", activation="squared-relu"),
)}


def activation_of(name: str):
    """The megatron_mok ExpertActivation of a shape's activation key."""
    from megatron_mok import activations
    return {"swiglu": activations.SWIGLU, "gpt-oss": activations.GPT_OSS,
            "squared-relu": activations.SQUARED_RELU}[name]


def fc1_rows_per_inter(activation: str) -> int:
    """Rows of w1 per intermediate column of a shape's activation: 2 (GLU), 1 (non-gated)."""
    return 2 if activation in ("swiglu", "gpt-oss") else 1


# Not a benchmark shape: a tiny one for CPU smoke runs and tests (`--shapes tiny`).
TEST_SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tiny", 64, 32, 32, 2, 48, EP8, "CPU smoke test"),
    Shape("tiny-noshared", 64, 32, 16, 2, 0, EP8, "CPU smoke test"),
    Shape("tiny-glu", 64, 32, 16, 2, 0, EP8, "CPU smoke test", activation="gpt-oss",
          expert_bias=True),
    Shape("tiny-relu2", 64, 32, 16, 2, 0, EP8, "CPU smoke test", activation="squared-relu"),
)}

DEFAULT_TOKENS = (4096, 8192)
ROUTINGS = ("balanced", "skewed", "adversarial", "blocked")
ZIPF_S = 1.2


def get_shape(name: str) -> Shape:
    for table in (SHAPES, VARIANT_SHAPES, TEST_SHAPES):
        if name in table:
            return table[name]
    raise KeyError(f"unknown shape {name!r}; known: "
                   f"{', '.join([*SHAPES, *VARIANT_SHAPES, *TEST_SHAPES])}")


@dataclasses.dataclass(frozen=True)
class LocalShape:
    """What one rank runs: E_loc experts, routing ids in [0, E_loc)."""

    name: str
    hidden: int
    inter: int
    num_local_experts: int
    topk: int
    shared_inter: int
    activation: str = "swiglu"
    expert_bias: bool = False


def ep8_proxy(shape: Shape) -> LocalShape:
    """One rank's share of the shape's EP run: E_loc = E / 8 (mixtral: E_loc = E, EP=1)."""
    if shape.num_experts % shape.ep_size:
        raise ValueError(f"{shape.name}: E={shape.num_experts} is not divisible by "
                         f"EP={shape.ep_size}")
    e_loc = shape.num_experts // shape.ep_size
    if shape.topk > e_loc:
        raise ValueError(f"{shape.name}: top-{shape.topk} needs at least {shape.topk} local "
                         f"experts, E_loc={e_loc}")
    return LocalShape(shape.name, shape.hidden, shape.inter, e_loc, shape.topk,
                      shape.shared_inter, shape.activation, shape.expert_bias)


# ----------------------------------------------------------------------------------------
# FLOPs and floors
# ----------------------------------------------------------------------------------------

def forward_flops(num_tokens: int, hidden: int, inter: int, topk: int,
                  shared_inter: int = 0) -> float:
    """6·(T·K·I + T·I_shared)·H: fc1 (2 GEMMs worth, gate and up) + fc2, 2 FLOPs per MAC."""
    return 6.0 * (num_tokens * topk * inter + num_tokens * shared_inter) * hidden


def backward_flops(num_tokens: int, hidden: int, inter: int, topk: int,
                   shared_inter: int = 0) -> float:
    """Backward counts twice the forward (dgrad + wgrad)."""
    return 2.0 * forward_flops(num_tokens, hidden, inter, topk, shared_inter)


def pass_flops(local: LocalShape, num_tokens: int, which: str) -> float:
    """The pass's FLOPs; non-gated experts' fc1 is one GEMM of [I, H], not two."""
    f = forward_flops(num_tokens, local.hidden, local.inter, local.topk, local.shared_inter)
    if fc1_rows_per_inter(local.activation) == 1:  # the shared expert's fc1 too
        f -= 2.0 * num_tokens * (local.topk * local.inter + local.shared_inter) * local.hidden
    if which == "fwd":
        return f
    if which == "bwd":
        return 2.0 * f
    raise ValueError(f"pass must be 'fwd' or 'bwd', got {which!r}")


def gemm_floor_ms(flops: float, peak_tflops: float) -> float:
    """Time the pass would take at the measured dense GEMM rate."""
    return flops / (peak_tflops * 1e12) * 1e3


# ----------------------------------------------------------------------------------------
# Routing workloads
# ----------------------------------------------------------------------------------------

def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def _weights(num_tokens: int, topk: int, gen: torch.Generator, device) -> torch.Tensor:
    logits = torch.randn(num_tokens, topk, generator=gen, device=device, dtype=torch.float32)
    return torch.softmax(logits, dim=-1).contiguous()


def balanced_routing(num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                     device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random distinct top-K experts per token."""
    _check(num_experts, topk)
    gen = _generator(seed, device)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    idx = scores.topk(topk, dim=1).indices.to(torch.int32).contiguous()
    return idx, _weights(num_tokens, topk, gen, device)


def zipf_probs(num_experts: int, s: float = ZIPF_S) -> torch.Tensor:
    """p(rank r) ∝ r^-s, r = 1..E (fp64 for exactness, normalised)."""
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    p = ranks.pow(-s)
    return p / p.sum()


def skewed_routing(num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                   device="cuda", s: float = ZIPF_S, shuffle: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-K per token drawn without replacement from a Zipf(s) law over experts.

    Expert 0 is the most popular unless `shuffle` (a seeded permutation of popularity);
    unshuffled, the hot experts sit on rank 0 under EP.
    """
    _check(num_experts, topk)
    gen = _generator(seed, device)
    p = zipf_probs(num_experts, s).to(device=device, dtype=torch.float32)
    idx = torch.multinomial(p.expand(num_tokens, num_experts).contiguous(), topk,
                            replacement=False, generator=gen)
    if shuffle:
        perm = torch.randperm(num_experts, generator=gen, device=device)
        idx = perm[idx]
    return idx.to(torch.int32).contiguous(), _weights(num_tokens, topk, gen, device)


def adversarial_routing(num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                        device="cuda", ep_size: int = EP8, hot_rank: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token routes (distinct, uniform) to experts of one rank: ids in
    [hot_rank·E/ep, (hot_rank+1)·E/ep). With ep_size = 1 this is balanced routing."""
    if num_experts % ep_size:
        raise ValueError(f"E={num_experts} is not divisible by ep_size={ep_size}")
    per_rank = num_experts // ep_size
    if not 0 <= hot_rank < ep_size:
        raise ValueError(f"hot_rank {hot_rank} not in [0, {ep_size})")
    idx, w = balanced_routing(num_tokens, per_rank, topk, seed=seed, device=device)
    return (idx + hot_rank * per_rank).contiguous(), w


def blocked_routing(num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                    device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Diagnostic, balanced load: every expert's tokens are topk runs of about T/E
    neighbouring tokens, so a row tile reads neighbouring rows of x. Against balanced
    routing (random rows) it isolates what gather locality costs (docs/perf-notes.md)."""
    _check(num_experts, topk)
    gen = _generator(seed, device)
    run = torch.arange(num_tokens, device=device) * num_experts // num_tokens
    spread = torch.arange(topk, device=device) * (num_experts // topk)  # distinct mod E
    idx = (run[:, None] + spread[None, :]) % num_experts
    perm = torch.randperm(num_experts, generator=gen, device=device)
    return perm[idx].to(torch.int32).contiguous(), _weights(num_tokens, topk, gen, device)


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, *, seed: int = 0,
                 device="cuda", ep_size: int = 1, hot_rank: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kind` in ROUTINGS. `ep_size` only matters for "adversarial" (which rank is hot)."""
    if kind == "balanced":
        return balanced_routing(num_tokens, num_experts, topk, seed=seed, device=device)
    if kind == "skewed":
        return skewed_routing(num_tokens, num_experts, topk, seed=seed, device=device)
    if kind == "blocked":
        return blocked_routing(num_tokens, num_experts, topk, seed=seed, device=device)
    if kind == "adversarial":
        return adversarial_routing(num_tokens, num_experts, topk, seed=seed, device=device,
                                   ep_size=ep_size, hot_rank=hot_rank)
    raise ValueError(f"unknown routing {kind!r}; known: {', '.join(ROUTINGS)}")


def _check(num_experts: int, topk: int) -> None:
    if not 0 < topk <= num_experts:
        raise ValueError(f"top-{topk} of {num_experts} experts: need 0 < K <= E")


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert, [E] int64 (-1 routes ignored)."""
    flat = topk_idx.reshape(-1).long()
    flat = flat[flat >= 0]
    return torch.bincount(flat, minlength=num_experts)


def describe(shape: Shape, local: Optional[LocalShape] = None) -> str:
    local = local or ep8_proxy(shape)
    shared = f", shared I={shape.shared_inter}" if shape.has_shared else ""
    return (f"{shape.name}: H={shape.hidden} I={shape.inter} E={shape.num_experts} "
            f"(E_loc={local.num_local_experts}) K={shape.topk}{shared}")
