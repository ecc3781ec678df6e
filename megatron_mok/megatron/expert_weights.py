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

from typing import Optional, Sequence

import torch


def _uniform(params: Sequence[torch.Tensor]) -> bool:
    """Plain dense tensors (no DTensor or other subclass: their storage is not theirs) of
    one shape, dtype and device."""
    first = params[0]
    return all(type(p.data) is torch.Tensor and p.layout == torch.strided
               and p.shape == first.shape and p.dtype == first.dtype
               and p.device == first.device and p.is_contiguous() for p in params)


def share_one_storage(params: Sequence[torch.nn.Parameter]) -> bool:
    """Move the parameters' data into one [E, ...] tensor (each a view of its slice).
    False, and nothing changed, if they differ in shape, dtype or device."""
    if len(params) < 2 or not _uniform(params):
        return False
    with torch.no_grad():
        stacked = torch.stack([p.detach() for p in params])
        for e, p in enumerate(params):
            p.data = stacked[e]
    return True


def stacked_alias(params: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, *shape] tensor over the parameters' own memory if they lie back to back in
    expert order in one storage (as share_one_storage leaves them), else None."""
    if not params or not _uniform(params):
        return None
    first = params[0]
    storage = first.untyped_storage()
    step = first.numel()
    for e, p in enumerate(params):
        if p.untyped_storage().data_ptr() != storage.data_ptr() or \
                p.storage_offset() != first.storage_offset() + e * step:
            return None
    out = first.new_empty(0)
    out.set_(storage, first.storage_offset(), (len(params), *first.shape),
             (step, *first.stride()))
    return out


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
