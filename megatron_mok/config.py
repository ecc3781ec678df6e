"""MoKConfig: the knobs of one fused MoE pass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_mok.activations import SWIGLU, ExpertActivation

BACKENDS = ("auto", "reference", "kernel")
MAIN_GRAD_FUSION = ("auto", "on", "off")
FP8_RECIPES = ("blockwise",)  # Hopper's (1 x 128 / 128 x 128); MXFP8 is Blackwell's
FP8_WGRAD = ("fp8", "bf16")

# Row-table padding unit: the GEMM tile height of the Hopper kernels (one
# 128-row WGMMA tile per expert segment start).
TILE_M = 128


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Tuning knobs of the fused MoE layer.

    fwd_num_comm_sms: SMs that run the communication CTAs (pull dispatch, push combine)
        in the forward megakernel's comm mode, when no autotuned plan says otherwise.
    minibatch_size: rows per readiness counter of the forward megakernel, the unit of
        comm/compute overlap, when no autotuned plan says otherwise.
    bwd_num_comm_sms, macrobatch_size: MoK's backward comm SMs and ring size, kept so
        MoK-shaped code and upstream Megatron-LM launch scripts run; the Hopper backend
        does not use them (its backward pulls in every CTA's producer warps, and it keeps
        every routed row for the backward instead of reusing a ring). macrobatch_size
        must still be a multiple of minibatch_size.
    schedule_capacity_multiplier: worst-case fraction of all EP tokens x top-k that
        may land on one rank; sizes the static row table (overflow is an error).
    backend: "auto" (kernel where the GPU supports it, reference otherwise),
        "reference" (pure PyTorch spec) or "kernel" (the compiled Hopper backend).
    debug_checks: validate routing values eagerly (host sync) even on the kernel
        backend, instead of only through the device-side error flag.
    autotune: use the cached per-(GPU, shape) forward plan of megatron_mok.kernels.autotune
        (path, comm SMs, minibatch) when there is one, instead of the knobs above.
    main_grad_fusion: in Megatron, add the expert weights' gradients straight into their
        `main_grad` (megatron_mok.grad_accumulation): "auto" follows Megatron's
        --gradient-accumulation-fusion, "on" whenever the parameters have a main_grad,
        "off" never (Megatron's DDP hook adds the returned gradients).
    activation: the experts' activation (megatron_mok.activations): SwiGLU by default, the
        only one the kernel backend runs; the others (GPT-OSS's clamped GLU,
        squared-ReLU, GeLU) run on the reference backend.
    expert_bias: the routed experts have fc1 and fc2 biases (Megatron's --add-bias-linear,
        GPT-OSS); the reference backend runs them, the kernel backend does not yet.
    fp8: None (BF16) or "blockwise": the routed experts' GEMMs in E4M3 with 1 x 128 / 128 x
        128 FP32 scales (megatron_mok.reference_fp8 states every quantisation point); the
        reference backend at any EP size, the kernel backend at EP = 1 (the launch chain
        on the FP8 grouped GEMMs).
    fp8_wgrad: "bf16" (the default: the weight gradients' GEMMs in BF16, as the kernel
        backend runs them) or "fp8" (in FP8 too, 1 x 128 groups along the tokens; the
        reference backend only: the FP8 wgrad kernels are not built).
    """

    fwd_num_comm_sms: int = 24
    bwd_num_comm_sms: int = 20
    minibatch_size: int = 4096
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    backend: str = "auto"
    debug_checks: bool = False
    autotune: bool = True
    main_grad_fusion: str = "auto"
    activation: ExpertActivation = SWIGLU
    expert_bias: bool = False
    fp8: Optional[str] = None
    fp8_wgrad: str = "bf16"

    def __post_init__(self):
        if not isinstance(self.activation, ExpertActivation):
            raise ValueError(f"MoKConfig.activation must be a megatron_mok.activations."
                             f"ExpertActivation, got {self.activation!r}")
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoKConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.minibatch_size, int) or self.minibatch_size < TILE_M or \
                self.minibatch_size % TILE_M:
            raise ValueError(
                f"MoKConfig.minibatch_size must be a positive multiple of {TILE_M} "
                f"(the GEMM tile height), got {self.minibatch_size!r}")
        if not isinstance(self.macrobatch_size, int) or self.macrobatch_size < self.minibatch_size \
                or self.macrobatch_size % self.minibatch_size:
            raise ValueError(
                f"MoKConfig.macrobatch_size must be a positive multiple of minibatch_size "
                f"({self.minibatch_size}), got {self.macrobatch_size!r}")
        m = self.schedule_capacity_multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m:
            raise ValueError(
                f"MoKConfig.schedule_capacity_multiplier must be a positive number, got {m!r}")
        if not isinstance(self.expert_bias, bool):
            raise ValueError(f"MoKConfig.expert_bias must be a bool, got {self.expert_bias!r}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"MoKConfig.fp8 must be None or one of {FP8_RECIPES} (Hopper's "
                             f"FP8 recipe; MXFP8 is Blackwell's), got {self.fp8!r}")
        if self.fp8_wgrad not in FP8_WGRAD:
            raise ValueError(f"MoKConfig.fp8_wgrad must be one of {FP8_WGRAD}, got "
                             f"{self.fp8_wgrad!r}")
        if not isinstance(self.autotune, bool):
            raise ValueError(f"MoKConfig.autotune must be a bool, got {self.autotune!r}")
        if self.main_grad_fusion not in MAIN_GRAD_FUSION:
            raise ValueError(f"MoKConfig.main_grad_fusion must be one of {MAIN_GRAD_FUSION}, "
                             f"got {self.main_grad_fusion!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"MoKConfig.backend must be one of {BACKENDS}, got {self.backend!r}")

    def check_num_sms(self, num_sms: int) -> None:
        """Comm CTAs must leave at least one compute SM on the device that runs the pass."""
        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            if getattr(self, name) >= num_sms:
                raise ValueError(
                    f"MoKConfig.{name}={getattr(self, name)} leaves no compute SM on a GPU "
                    f"with {num_sms} SMs")


def schedule_capacity(config: MoKConfig, num_tokens: int, topk: int, ep_size: int,
                      num_local_experts: int) -> int:
    """Rows of the static row table on one rank.

    The worst case a rank can see is ep_size * T * K routes (every route of every
    rank); the multiplier bounds the expected fraction. Each local expert may add up
    to TILE_M - 1 rows of padding.
    """
    routes = num_tokens * topk
    fraction = max(2.0, ep_size * config.schedule_capacity_multiplier)
    rows = min(int(routes * fraction), ep_size * routes)
    rows = max(rows, routes)
    padded = rows + num_local_experts * (TILE_M - 1)
    return -(-padded // TILE_M) * TILE_M
