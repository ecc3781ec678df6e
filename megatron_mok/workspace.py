"""Per-(EP group, shapes) workspace of the fused pass, created once and cached.

Creation validates the shapes, checks that every EP rank uses the same T, H, K
(one collective, here and never again in the hot path) and sizes the row table.
The kernel backend adds its symmetric-memory buffers (x, combine slots, dy, dx
slots, routing, barrier pad) to the same object.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_mok.config import MoKConfig, schedule_capacity
from megatron_mok.validation import check_same_shape_across_ranks


@dataclasses.dataclass
class MoKWorkspace:
    group: Any                 # EP process group (None: EP 1)
    ep_size: int
    ep_rank: int
    device: torch.device
    num_tokens: int            # T, the same on every rank
    hidden_size: int           # H
    topk: int                  # K
    num_local_experts: int     # E_loc
    capacity: int              # rows of the row table
    buffers: dict = dataclasses.field(default_factory=dict)  # backend-owned buffers

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.ep_size


_CACHE: dict = {}


def _group_key(group) -> Any:
    if group is None or not dist.is_initialized():
        return None
    return getattr(group, "group_name", None) or id(group)


def create_workspace(config: MoKConfig, group, *, device, num_local_tokens: int,
                     hidden_size: int, topk: int, num_local_experts: int) -> MoKWorkspace:
    """Validate the shapes, agree on them across the EP group and size the row table."""
    for name, value in (("num_local_tokens", num_local_tokens), ("hidden_size", hidden_size),
                        ("topk", topk), ("num_local_experts", num_local_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if group is not None and dist.is_initialized():
        ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        ep_size, ep_rank = 1, 0
    check_same_shape_across_ranks(group, tokens=num_local_tokens, hidden=hidden_size, topk=topk,
                                  local_experts=num_local_experts)
    return MoKWorkspace(
        group=group if ep_size > 1 else None, ep_size=ep_size, ep_rank=ep_rank,
        device=torch.device(device), num_tokens=num_local_tokens, hidden_size=hidden_size,
        topk=topk, num_local_experts=num_local_experts,
        capacity=schedule_capacity(config, num_local_tokens, topk, ep_size, num_local_experts))


def get_workspace(config: MoKConfig, group, *, device, num_local_tokens: int, hidden_size: int,
                  topk: int, num_local_experts: int) -> MoKWorkspace:
    """Cached create_workspace, keyed by group, device, shapes and capacity multiplier."""
    key = (_group_key(group), str(torch.device(device)), num_local_tokens, hidden_size, topk,
           num_local_experts, config.schedule_capacity_multiplier)
    ws = _CACHE.get(key)
    if ws is None:
        ws = create_workspace(config, group, device=device, num_local_tokens=num_local_tokens,
                              hidden_size=hidden_size, topk=topk,
                              num_local_experts=num_local_experts)
        _CACHE[key] = ws
    return ws


def clear_workspace_cache(group: Optional[Any] = None) -> None:
    """Drop cached workspaces (all, or those of one group)."""
    if group is None:
        _CACHE.clear()
        return
    for key in [k for k in _CACHE if k[0] == _group_key(group)]:
        del _CACHE[key]
