"""MokTokenDispatcher, in one of two modes.

- fused (what MokMoELayer builds): metadata only. The fused pass does the real dispatch
  and combine, so dispatch/combine are identities here; what remains is turning
  Megatron's dense routing (probs and routing_map, [T, E]) into the pass's top-k form
  and back to the caller's hidden-state shape.
- contract (the default, what a stock MoELayer with `moe_token_dispatcher_type="mok"`
  builds): Megatron's MoETokenDispatcher contract in full, by delegating every step to a
  MoEAlltoAllTokenDispatcher built with the same arguments, so permutation,
  tokens_per_expert, permuted probs and the EP all-to-all are exactly alltoall's. It runs
  unfused and says so once per process.

Importing this module teaches MoELayer.__init__ the "mok" type (install_in_moe_layer).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import List, Optional

import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import (MoEAlltoAllTokenDispatcher,
                                                             MoETokenDispatcher)

from megatron_mok.megatron.args import DISPATCHER_TYPE

_UNFUSED_WARNED = False  # once per process


class MokUnfusedWarning(UserWarning):
    """A stock MoELayer runs `mok` as Megatron's unfused all-to-all dispatch."""


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


def _warn_unfused_once() -> None:
    global _UNFUSED_WARNED
    if _UNFUSED_WARNED:
        return
    _UNFUSED_WARNED = True
    warnings.warn(
        "megatron_mok: a stock MoELayer with --moe-token-dispatcher-type mok runs unfused "
        "(Megatron's all-to-all dispatch, permutation and expert modules); the fused fast path "
        "is MokMoELayer: build the layer spec with megatron_mok.megatron.gpt_decoder_block_spec "
        "or swap_moe_layers", MokUnfusedWarning, stacklevel=3)


class MokTokenDispatcher(MoETokenDispatcher):
    """fused=True: keeps the routing of the current call for MokMoELayer and moves no
    tokens. fused=False (default): Megatron's dispatcher contract via an internal
    MoEAlltoAllTokenDispatcher (`self.unfused`)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None, fused: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.fused = fused
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.router_topk = config.moe_router_topk
        self.unfused: Optional[MoEAlltoAllTokenDispatcher] = None
        if fused:
            self.hidden_shape: Optional[torch.Size] = None
            self.routing_map: Optional[torch.Tensor] = None
            self.topk_idx: Optional[torch.Tensor] = None
            self.cudagraph_attrs = ["routing_map", "topk_idx"]
            return
        _warn_unfused_once()
        self.unfused = MoEAlltoAllTokenDispatcher(num_local_experts, local_expert_indices,
                                                  config=config, pg_collection=pg_collection)
        self._follow_cudagraph_attrs()

    def _follow_cudagraph_attrs(self) -> None:
        # MoE CUDA-graph capture reads and writes these by dotted name from this object:
        # point them at the state the alltoall dispatcher keeps.
        self.cudagraph_attrs = [f"unfused.{a}" for a in self.unfused.cudagraph_attrs]

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """hidden_states [S, B, H] (or [T, H]), routing_map bool [T, E], probs [T, E].
        fused: -> (x [T, H], topk_w [T, K] fp32), topk_idx kept on self.
        contract: -> (tokens permuted by expert [N, H], their probs [N]), as alltoall."""
        if not self.fused:
            return self.unfused.dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        self.topk_idx, topk_w = routing_to_topk(routing_map, probs, self.router_topk)
        return hidden_states.reshape(-1, hidden_states.shape[-1]), topk_w

    def token_dispatch(self, hidden_states, probs):
        """fused: identity. contract: the EP all-to-all -> (tokens [N_recv, H], probs [N_recv])."""
        if not self.fused:
            return self.unfused.token_dispatch(hidden_states, probs)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """contract: -> (tokens sorted by local expert [N_loc, H], tokens_per_expert [E_loc]
        (int64, on the host, as alltoall hands it to the experts), permuted probs [N_loc]).
        fused (unused by MokMoELayer, which runs its own experts): (x, None, topk_w)."""
        if not self.fused:
            return self.unfused.dispatch_postprocess(hidden_states, probs)
        return hidden_states, None, probs

    def combine_preprocess(self, hidden_states):
        """contract: expert outputs [N_loc, H] back to all-to-all order. fused: identity."""
        if not self.fused:
            return self.unfused.combine_preprocess(hidden_states)
        return hidden_states

    def token_combine(self, hidden_states, *args, **kwargs):
        """contract: the reverse EP all-to-all -> [N, H]. fused: identity."""
        if not self.fused:
            return self.unfused.token_combine(hidden_states, *args, **kwargs)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """-> the shape handed to dispatch_preprocess; contract: un-permuted and summed over
        each token's routes, as alltoall."""
        if not self.fused:
            return self.unfused.combine_postprocess(hidden_states)
        return hidden_states.view(self.hidden_shape)

    def set_shared_experts(self, shared_experts):
        super().set_shared_experts(shared_experts)
        if not self.fused:  # the alltoall dispatcher runs the overlapped shared expert
            self.unfused.set_shared_experts(shared_experts)
            self._follow_cudagraph_attrs()

    def get_expert_zero_copy_buffers(self):
        if not self.fused:
            return self.unfused.get_expert_zero_copy_buffers()
        return super().get_expert_zero_copy_buffers()


def install_in_moe_layer() -> None:
    """Make a stock MoELayer build a MokTokenDispatcher (contract mode) for
    moe_token_dispatcher_type="mok" (idempotent). MoELayer.__init__ raises on types it
    does not know, so it runs with "allgather" (a constructor without communication or
    CUDA streams), then the dispatcher is swapped, as MokMoELayer does for its own."""
    init = MoELayer.__init__
    if getattr(init, "builds_mok_dispatcher", False):
        return
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        config = bound.arguments["config"]
        if config.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return init(self, *args, **kwargs)  # MokMoELayer arrives here with "allgather"
        # The dispatcher needs the same process groups MoELayer resolves for itself.
        pg_collection = bound.arguments.get("pg_collection") or get_default_pg_collection()
        bound.arguments["pg_collection"] = pg_collection
        config.moe_token_dispatcher_type = "allgather"
        try:
            init(*bound.args, **bound.kwargs)
        finally:
            config.moe_token_dispatcher_type = DISPATCHER_TYPE
        dispatcher = MokTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                        config=config, pg_collection=pg_collection)
        if self.shared_expert_overlap:  # was handed to the throwaway dispatcher
            dispatcher.set_shared_experts(self.shared_experts)
        if hasattr(self, "_training_token_dispatcher"):  # inference_optimized keeps both
            self._training_token_dispatcher = dispatcher
        self.token_dispatcher = dispatcher

    __init__.builds_mok_dispatcher = True
    MoELayer.__init__ = __init__


install_in_moe_layer()
