"""The expert activations of the spec, each written once.

fc1 writes h along its last dimension. For gated experts (GLU, Megatron's
`--gated-linear-unit` / `--swiglu`) w1 = [gate; up] stacked, h = [g; u] with 2I columns,
and the activation is

    act = f(clamp(g, max=c)) * (clamp(u, -c, c) + offset)

with f = silu for SwiGLU (c = None, offset = 0: the default, and the only one the kernel
backend runs), f = quick_gelu (x * sigmoid(1.702 x)) with c = 7, offset = 1 for GPT-OSS
(Megatron's `--activation-func-clamp-value 7 --glu-linear-offset 1` with quick_gelu).
Non-gated experts (squared-ReLU: Nemotron-style MoE; GeLU) have w1 [I, H] and act = f(h).

Every function computes in fp32 and returns fp32; callers round where the precision
contract says (the reference rounds the activation to the model dtype before fc2, the
kernels' epilogues do the same in registers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) (GPT-OSS's gate function, Megatron's quick_gelu)."""
    return x * torch.sigmoid(1.702 * x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Megatron's squared_relu)."""
    return torch.pow(F.relu(x), 2)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh,
    "squared_relu": squared_relu, "relu": F.relu,
}


@dataclasses.dataclass(frozen=True)
class ExpertActivation:
    """What an expert computes between fc1 and fc2 (see the module docstring)."""

    function: str = "silu"
    gated: bool = True
    clamp: Optional[float] = None      # GLU only: gate clamped above, linear part to +-c
    linear_offset: float = 0.0         # GLU only: added to the linear part

    def __post_init__(self):
        if self.function not in FUNCTIONS:
            raise ValueError(f"megatron_mok: unknown expert activation {self.function!r}; "
                             f"known: {', '.join(FUNCTIONS)}")
        if not self.gated and (self.clamp is not None or self.linear_offset):
            raise ValueError("megatron_mok: activation clamp and linear offset apply to gated "
                             "(GLU) experts only")
        if self.clamp is not None and not self.clamp > 0:
            raise ValueError(f"megatron_mok: activation clamp must be positive, got {self.clamp}")

    @property
    def fc1_rows_per_inter(self) -> int:
        """Rows of w1 per intermediate column: 2 for GLU ([gate; up]), else 1."""
        return 2 if self.gated else 1

    @property
    def is_swiglu(self) -> bool:
        return self == SWIGLU

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gated) or [..., I] -> [..., I] fp32 (differentiable)."""
        f = FUNCTIONS[self.function]
        h = h.float()
        if not self.gated:
            return f(h)
        gate, up = h.chunk(2, dim=-1)
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
            up = up.clamp(min=-self.clamp, max=self.clamp)
        # (No + 0.0 for plain GLUs: a pass over [.., I] fp32 for nothing.)
        return f(gate) * (up + self.linear_offset if self.linear_offset else up)

    @property
    def kernel_glu(self) -> Optional[tuple[float, float, float]]:
        """(alpha, limit, offset) of the kernels' general GLU epilogue for a gated silu or
        quick_gelu (f(x) = x sigmoid(alpha x)) with its clamp (limit inf: none) and linear
        offset; None for SwiGLU itself (its own epilogue) and for what the kernels do not run
        (see kernel_runs)."""
        if self.is_swiglu or not self.gated or not self.kernel_runs:
            return None
        limit = float("inf") if self.clamp is None else float(self.clamp)
        return GLU_ALPHA[self.function], limit, float(self.linear_offset)

    @property
    def kernel_act(self) -> Optional[tuple[int, float]]:
        """(act_fn, alpha) of the kernels' non-gated epilogues (grouped_fc1_act /
        grouped_dgrad_act: KERNEL_ACT_FNS, alpha for x sigmoid(alpha x)); None for GLUs."""
        if self.gated:
            return None
        return KERNEL_ACT_FNS[self.function], GLU_ALPHA.get(self.function, 1.0)

    @property
    def kernel_runs(self) -> bool:
        """The kernel backend's epilogues compute this activation: GLUs of silu or
        quick_gelu, clamped or not, with or without a linear offset, and every non-gated
        function of the spec (squared-ReLU, GeLU, ...; launch chain only)."""
        return self.function in GLU_ALPHA if self.gated else self.function in KERNEL_ACT_FNS

    def describe(self) -> str:
        if self.is_swiglu:
            return "SwiGLU"
        parts = [f"{self.function}{' GLU' if self.gated else ''}"]
        if self.clamp is not None:
            parts.append(f"clamp {self.clamp:g}")
        if self.linear_offset:
            parts.append(f"linear offset {self.linear_offset:g}")
        return ", ".join(parts)


# f(x) = x * sigmoid(alpha * x): the gate functions of the kernels' GLU epilogues.
GLU_ALPHA = {"silu": 1.0, "quick_gelu": 1.702}

# The non-gated epilogues' act_fn codes (csrc/gemm/tile.cuh, ActFn): 4 is x sigmoid(alpha x).
KERNEL_ACT_FNS = {"relu": 0, "squared_relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4,
                  "quick_gelu": 4}

SWIGLU = ExpertActivation()
GPT_OSS = ExpertActivation("quick_gelu", gated=True, clamp=7.0, linear_offset=1.0)
SQUARED_RELU = ExpertActivation("squared_relu", gated=False)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I] fp32: silu(gate) * up for h = [gate; up] (differentiable)."""
    return SWIGLU(h)


def swiglu_backward(h: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    """[..., 2I] fp32: d[gate; up] of act = silu(gate) * up, given d_act [..., I] (the
    closed form the kernels' epilogues compute)."""
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d = d_act.float()
    d_gate = d * up * sig * (1 + gate * (1 - sig))
    d_up = d * gate * sig
    return torch.cat([d_gate, d_up], dim=-1)


def glu_backward(activation: ExpertActivation, h: torch.Tensor, d_act: torch.Tensor
                 ) -> torch.Tensor:
    """[..., 2I] fp32: d[gate; up] of a kernel GLU (activation.kernel_runs) at h given d_act,
    the closed form the kernels' epilogues compute: with g' = min(g, c), u' = clamp(u, -c, c),
    s = sigmoid(alpha g'): d_gate = d_act (u' + offset) s (1 + alpha g' (1 - s)) where g <= c,
    d_up = d_act g' s where -c <= u <= c (torch.clamp's gradient, bounds included)."""
    if not (activation.gated and activation.kernel_runs):
        raise ValueError(f"megatron_mok: no closed-form GLU backward for "
                         f"{activation.describe()} (activation_backward has the non-gated)")
    if activation.is_swiglu:
        return swiglu_backward(h, d_act)
    alpha, limit, offset = activation.kernel_glu
    gate, up = h.float().chunk(2, dim=-1)
    gc, uc = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(alpha * gc)
    d = d_act.float()
    d_gate = torch.where(gate <= limit, d * (uc + offset) * sig * (1 + alpha * gc * (1 - sig)), 0.0)
    d_up = torch.where((up >= -limit) & (up <= limit), d * gc * sig, 0.0)
    return torch.cat([d_gate, d_up], dim=-1)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def act_derivative(function: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) in fp32 for a non-gated function of the spec (the closed forms the kernels'
    kActBwd epilogue computes; relu and squared-ReLU take 0 at x = 0, as torch's autograd)."""
    x = x.float()
    if function == "relu":
        return (x > 0).float()
    if function == "squared_relu":
        return 2 * F.relu(x)
    if function == "gelu":
        return 0.5 * (1 + torch.erf(x * math.sqrt(0.5))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if function == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
    if function in GLU_ALPHA:
        alpha = GLU_ALPHA[function]
        s = torch.sigmoid(alpha * x)
        return s * (1 + alpha * x * (1 - s))
    raise ValueError(f"megatron_mok: no closed-form derivative for {function!r}")


def activation_backward(activation: ExpertActivation, h: torch.Tensor, d_act: torch.Tensor
                        ) -> torch.Tensor:
    """d_h in fp32 of any activation the kernels run: glu_backward for GLUs, f'(h) d_act for
    the non-gated ones."""
    if activation.gated:
        return glu_backward(activation, h, d_act)
    return act_derivative(activation.function, h) * d_act.float()


def from_megatron(config) -> ExpertActivation:
    """The expert activation a Megatron TransformerConfig asks for (activation_func,
    gated_linear_unit, activation_func_clamp_value, glu_linear_offset); ValueError naming
    the flag for a function the spec does not have."""
    func = config.activation_func
    name = getattr(func, "__name__", repr(func))
    by_object = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu"}
    function = by_object.get(func)
    if function is None:
        aliases = {"silu": "silu", "quick_gelu": "quick_gelu", "squared_relu": "squared_relu",
                   "gelu": "gelu", "relu": "relu", "fast_gelu": "gelu_tanh",
                   "openai_gelu": "gelu_tanh", "erf_gelu": "gelu"}
        function = aliases.get(name)
    if function is None:
        raise ValueError(f"--moe-token-dispatcher-type mok: no expert activation {name!r} in "
                         f"the spec (known: {', '.join(FUNCTIONS)}); pass --swiglu, or "
                         f"another dispatcher (--moe-token-dispatcher-type alltoall)")
    gated = bool(config.gated_linear_unit)
    clamp = getattr(config, "activation_func_clamp_value", None)
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    return ExpertActivation(function, gated, clamp if gated else None, offset if gated else 0.0)
