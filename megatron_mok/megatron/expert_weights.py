"""Megatron's per-expert weights as one [E, ...] tensor for the fused pass, without a copy
where their memory allows it.

Megatron's expert modules (SequentialMLP, TEGroupedMLP) hold one parameter per expert,
and checkpoints name them so. The fused pass wants them stacked: `torch.stack` every
forward copies all expert weights (2.8 GB per layer for deepseek-v3's 32 local experts)
and keeps the copy alive until the backward. Instead:

- `share_one_storage(params)` (at layer construction) moves the parameters' data into
  one stacked tensor, each parameter a view of its slice: names, shapes, checkpoints and
  optimizers see the same parameters as before;
- `stack_experts(params)` returns a tensor over that memory when the parameters still lie
  back to back in expert order (nothing re-homed them since), else a `torch.stack` copy;
  either way the gradient flows back to every parameter.

Whatever later replaces a parameter's data (a dtype or device conversion, a DDP buffer
of the distributed optimizer) only costs the copy again, never correctness.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_mok.stacked import stacked_alias, uniform_dense


def share_one_storage(params: Sequence[torch.nn.Parameter]) -> bool:
    """Move the parameters' data into one [E, ...] tensor (each a view of its slice).
    False, and nothing changed, if they differ in shape, dtype or device."""
    if len(params) < 2 or not uniform_dense(params):
        return False
    with torch.no_grad():
        stacked = torch.stack([p.detach() for p in params])
        for e, p in enumerate(params):
            p.data = stacked[e]
    return True


class _StackExperts(torch.autograd.Function):
    """Forward: the stacked weights (an alias of their memory, or a copy); backward: each
    parameter's slice of the stacked gradient."""

    @staticmethod
    def forward(ctx, *params):
        alias = stacked_alias(params)
        return alias if alias is not None else torch.stack(params)

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.unbind(0))


def stack_experts(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The per-expert weights as one [E, ...] tensor (no copy when their memory allows)."""
    return _StackExperts.apply(*params)
