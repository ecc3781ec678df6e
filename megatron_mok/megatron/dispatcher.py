"""MokTokenDispatcher: metadata only. The fused pass does the real dispatch and combine,
so dispatch/combine are identities here; what remains is turning Megatron's dense
routing (probs and routing_map, [T, E]) into the pass's top-k form and back to the
caller's hidden-state shape."""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] routing_map/probs -> topk_idx [T, K] int32 (ascending expert id, -1 where a
    token has fewer than K routes, e.g. after capacity dropping) and topk_w [T, K] fp32.
    topk_w stays differentiable in probs, so the router receives its gradients."""
    not_routed = (~routing_map).to(torch.uint8)
    experts = torch.argsort(not_routed, dim=1, stable=True)[:, :topk]
    routed = routing_map.gather(1, experts)
    topk_idx = torch.where(routed, experts, torch.full_like(experts, -1)).to(torch.int32)
    weights = probs.gather(1, experts).float()
    topk_w = torch.where(routed, weights, torch.zeros_like(weights))
    return topk_idx.contiguous(), topk_w.contiguous()


class MokTokenDispatcher(MoETokenDispatcher):
    """Keeps the routing of the current call for MokMoELayer; moves no tokens itself."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.router_topk = config.moe_router_topk
        self.hidden_shape: Optional[torch.Size] = None
        self.routing_map: Optional[torch.Tensor] = None
        self.topk_idx: Optional[torch.Tensor] = None
        self.cudagraph_attrs = ["routing_map", "topk_idx"]

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        self.topk_idx, topk_w = routing_to_topk(routing_map, probs, self.router_topk)
        return hidden_states.reshape(-1, hidden_states.shape[-1]), topk_w

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, None, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)
