"""The shared expert folded into the routed experts (opt-in: MOK_SHARED_EXPERT=folded).

Where the shared expert is as wide as the routed ones (deepseek-v3, dsv4-pro), it is
one more local expert: expert E_loc of every rank, reached by every token through one
more route of weight 1.0, placed first. The spec's combine starts from the shared output
and adds the routes in k order; starting from zero, 0 + 1.0 * shared is the shared output
exactly, so the sums and their rounding are the spec's. The pass then runs the shared
expert's GEMMs inside the expert pass (the same launches or megakernel, on the grouped
core) instead of as separate GEMMs beside it; its gradients come back as expert E_loc's.

Global expert ids are renumbered so that rank r owns E_loc + 1 consecutive ids:
g -> g + g // E_loc for routed experts, r * (E_loc + 1) + E_loc for rank r's shared one.
A shared expert's routes never leave its rank.

The stacked [E_loc + 1, ...] weights alias the caller's memory when the shared weight
lies right after the experts' (MokMoELayer and benchmarks.layer lay them out so), else
they are a copy per pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok import knobs

MODES = ("separate", "folded")


def mode() -> str:
    """MOK_SHARED_EXPERT (megatron_mok.knobs): "separate" or "folded"."""
    return knobs.get("MOK_SHARED_EXPERT")


def foldable(w1: torch.Tensor, w2: torch.Tensor, shared_w1: Optional[torch.Tensor],
             shared_w2: Optional[torch.Tensor]) -> bool:
    """A shared expert of the routed experts' width and dtype."""
    return (isinstance(shared_w1, torch.Tensor) and isinstance(shared_w2, torch.Tensor)
            and tuple(shared_w1.shape) == tuple(w1.shape[1:])
            and tuple(shared_w2.shape) == tuple(w2.shape[1:])
            and shared_w1.dtype == w1.dtype and shared_w2.dtype == w2.dtype)


def fold_routing(topk_idx: torch.Tensor, topk_w: torch.Tensor, num_local_experts: int,
                 ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K + 1] routes and weights: this rank's shared expert first (weight 1.0, no
    gradient to topk_w), then the routed ones renumbered (-1 stays -1)."""
    e = num_local_experts
    shared_id = torch.full((topk_idx.shape[0], 1), ep_rank * (e + 1) + e,
                           dtype=topk_idx.dtype, device=topk_idx.device)
    routed = torch.where(topk_idx >= 0, topk_idx + torch.div(topk_idx, e, rounding_mode="floor"),
                         topk_idx)
    ones = torch.ones(topk_w.shape[0], 1, dtype=topk_w.dtype, device=topk_w.device)
    return (torch.cat([shared_id, routed], dim=1).contiguous(),
            torch.cat([ones, topk_w], dim=1).contiguous())


def adjacent(w: torch.Tensor, shared: torch.Tensor) -> bool:
    """shared lies right after w's last expert in w's storage, both dense."""
    return (w.is_contiguous() and shared.is_contiguous()
            and w.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
            and shared.storage_offset() == w.storage_offset() + w.numel())


class _AppendExpert(torch.autograd.Function):
    """[E + 1, ...]: the experts' weights and the shared one (an alias where adjacent);
    backward splits the gradient."""

    @staticmethod
    def forward(ctx, w, shared):
        if adjacent(w, shared):
            return w.as_strided((w.shape[0] + 1, *w.shape[1:]), w.stride())
        return torch.cat([w, shared.unsqueeze(0)])

    @staticmethod
    def backward(ctx, grad):
        return grad[:-1], grad[-1]


def append_expert(w: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return _AppendExpert.apply(w, shared)
