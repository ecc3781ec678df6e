"""The expert activation of the spec, written once: SwiGLU on Megatron's GLU layout.

fc1 writes h = [gate; up] along its last dimension (w1 = [gate; up] stacked, DESIGN.md
section 1); the activation is silu(gate) * up. Both functions compute in fp32 and return
fp32; callers round where the precision contract says (the reference rounds the
activation to the model dtype before fc2, the kernels' epilogues do the same in
registers). Every other module (reference, kernel fallbacks, benchmarks, tests) uses
these, so the function has one definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I] fp32: silu(gate) * up for h = [gate; up] (differentiable)."""
    gate, up = h.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(h: torch.Tensor, d_act: torch.Tensor) -> torch.Tensor:
    """[..., 2I] fp32: d[gate; up] of act = silu(gate) * up, given d_act [..., I]."""
    gate, up = h.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d = d_act.float()
    d_gate = d * up * sig * (1 + gate * (1 - sig))
    d_up = d * gate * sig
    return torch.cat([d_gate, d_up], dim=-1)

