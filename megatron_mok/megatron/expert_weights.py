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
    """Forward: the stacked weights (an alias of their memory, or a copy), in expert order
    or backwards; backward: each parameter's slice of the stacked gradient."""

    @staticmethod
    def forward(ctx, reverse, *params):
        ctx.reverse = reverse
        ordered = params[::-1] if reverse else params
        alias = stacked_alias(ordered)
        return alias if alias is not None else torch.stack(ordered)

    @staticmethod
    def backward(ctx, grad):
        grads = grad.unbind(0)
        return (None, *(grads[::-1] if ctx.reverse else grads))


def stack_experts(params: Sequence[torch.Tensor], reverse: bool = False) -> torch.Tensor:
    """The per-expert weights as one [E, ...] tensor (no copy when their memory allows);
    with `reverse`, plane j is expert E - 1 - j (how Megatron's distributed optimizer lays
    out a TEGroupedMLP's weights: its buffers hold parameters backwards)."""
    return _StackExperts.apply(reverse, *params)


def reverse_local_experts(topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Global expert ids with every rank's local experts numbered backwards (-1 stays):
    the routing that matches weights stacked with `reverse` on every rank."""
    e = num_local_experts
    flipped = topk_idx + (e - 1) - 2 * torch.remainder(topk_idx, e)
    return torch.where(topk_idx >= 0, flipped, topk_idx)
