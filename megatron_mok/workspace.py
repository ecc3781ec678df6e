"""Per-(EP group, shapes) workspace of the fused pass, created once and cached.

Creation validates the shapes, checks that every EP rank uses the same T, H, K
(one collective, here and never again in the hot path) and sizes the row table.
For the kernel backend it also allocates the symmetric arena (x, dy, routing,
router weights, combine / dx slots, barrier flags) that every rank of the EP group
reads and writes over NVLink.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_mok.backend_choice import resolve_backend
from megatron_mok.config import MoKConfig, schedule_capacity
from megatron_mok.validation import check_kernel_config, check_kernel_dims, \
    check_same_shape_across_ranks


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
    dtype: torch.dtype = torch.bfloat16
    arena: Optional["SymmetricArena"] = None  # kernel backend only
    forward_counters: Optional[torch.Tensor] = None  # forward megakernel, kernel backend only
    _unit_weights: Optional[torch.Tensor] = None

    def unit_weights(self) -> torch.Tensor:
        """[T, K] fp32 ones: the backward's combine weights for dx rows read in place
        (unrouted routes are skipped by their row, not by their weight). Made once."""
        if self._unit_weights is None:
            self._unit_weights = torch.ones(self.num_tokens, self.topk, dtype=torch.float32,
                                            device=self.device)
        return self._unit_weights

    @property
    def num_experts(self) -> int:
        return self.num_local_experts * self.ep_size


class SymmetricArena:
    """One symmetric allocation per workspace, carved into named views at byte offsets
    that are identical on every rank, so a peer's view is its base address + offset.

    EP = 1 needs no symmetric memory: a plain allocation with one "peer" (itself).
    """

    MAX_RANKS = 64
    WATCHDOG_TIMEOUT_MS = 60_000

    def __init__(self, group, ep_size: int, ep_rank: int, device: torch.device,
                 num_tokens: int, hidden: int, topk: int, dtype: torch.dtype):
        tk = num_tokens * topk
        self.layout: dict[str, tuple[int, tuple, torch.dtype]] = {}
        self._views: dict[str, torch.Tensor] = {}
        size = 0
        for name, shape, view_dtype in (
                ("flags", (self.MAX_RANKS,), torch.int64),     # barrier arrivals, one per rank
                ("routing", (num_tokens, topk), torch.int32),  # topk_idx, published
                ("topk_w", (num_tokens, topk), torch.float32),  # router weights, published
                ("d_topk_w", (tk,), torch.float32),             # pushed router-weight grads
                ("x", (num_tokens, hidden), dtype),             # tokens, pulled by expert ranks
                ("dy", (num_tokens, hidden), dtype),            # output grads, pulled
                ("slots", (tk, hidden), dtype)):                # pushed rows: y (fwd) / dx (bwd)
            self.layout[name] = (size, shape, view_dtype)
            nbytes = math.prod(shape) * torch.empty((), dtype=view_dtype).element_size()
            size += -(-nbytes // 256) * 256
        if ep_size > 1:
            import torch.distributed._symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(size, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(self.buffer, group)
            peers = list(handle.buffer_ptrs)
        else:
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
            peers = [self.buffer.data_ptr()]
        self.buffer.zero_()
        self.peer_base = torch.tensor(peers, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        # Pinned so the device can fill it before a watchdog trap and the host can read it after.
        self.watchdog = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        self.ep_size, self.ep_rank = ep_size, ep_rank
        if ep_size > 1:  # every rank's flags are zero before anyone arrives
            torch.cuda.synchronize(device)
            dist.barrier(group)

    def offset(self, name: str) -> int:
        return self.layout[name][0]

    def view(self, name: str) -> torch.Tensor:
        """The named view of the buffer (made once: layer calls ask for it every pass)."""
        view = self._views.get(name)
        if view is None:
            offset, shape, view_dtype = self.layout[name]
            nbytes = math.prod(shape) * torch.empty((), dtype=view_dtype).element_size()
            view = self._views[name] = \
                self.buffer[offset:offset + nbytes].view(view_dtype).view(shape)
        return view

    def barrier(self, timeout_ms: Optional[int] = None) -> None:
        """EP-group barrier on the current stream (no host sync); no-op at EP 1."""
        if self.ep_size == 1:
            return
        from megatron_mok.kernels import ops
        ops.ep_barrier(self.peer_base, self.offset("flags"), self.epoch, self.ep_rank,
                       self.watchdog, self.WATCHDOG_TIMEOUT_MS if timeout_ms is None else timeout_ms)

    def watchdog_report(self) -> Optional[str]:
        """What the watchdog recorded before a trap, or None."""
        state, what, rank, peer, expected, seen, waited_ns, block = self.watchdog.tolist()
        if state == 0:
            return None
        if what == 1:
            return (f"megatron_mok watchdog: rank {rank} stuck in EP barrier (block {block}) "
                    f"waiting for peer {peer}: expected arrival {expected}, saw {seen} after "
                    f"{waited_ns / 1e6:.0f} ms")
        # Forward megakernel waits: [3] is the 128-row tile whose counter did not arrive.
        waits = {2: ("a fc1 task", "rows pulled"), 3: ("a fc2 task", "fc1 tile halves done"),
                 4: ("a comm CTA's push", "fc2 tile halves done"),
                 5: ("a comm CTA's pull into the x_rows ring", "fc1 tile halves done"),
                 6: ("a fc2-dgrad task", "dy rows pulled"),
                 7: ("a fc1-dgrad task", "d_h tile halves done")}
        role, counter = waits.get(what, (f"wait #{what}", "counter"))
        kernel = "backward" if what in (6, 7) else "forward"
        return (f"megatron_mok watchdog: rank {rank} stuck in the {kernel} megakernel (block "
                f"{block}, {role}) waiting for row tile {peer}: {counter} expected {expected}, "
                f"saw {seen} after {waited_ns / 1e6:.0f} ms")


# Most recently used last. Bounded: a run whose T changes call by call (evaluation,
# variable lengths) keeps at most this many arenas; the least recently used goes first.
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
MAX_CACHED_WORKSPACES = 8


def set_workspace_cache_limit(limit: int) -> None:
    """How many workspaces get_workspace keeps (default 8); the least recently used ones
    past it are dropped now."""
    global MAX_CACHED_WORKSPACES
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"the workspace cache limit must be a positive int, got {limit!r}")
    MAX_CACHED_WORKSPACES = limit
    _evict()


def _evict() -> None:
    """Drop the least recently used workspaces past the limit. Every EP rank calls with
    the same shapes in the same order, so all ranks drop the same one; they first wait
    for the device and for each other, so no peer still reads an arena that goes. (A
    workspace a pending backward still holds lives on until that backward is done.)"""
    while len(_CACHE) > MAX_CACHED_WORKSPACES:
        _, ws = _CACHE.popitem(last=False)
        if ws.arena is not None and ws.ep_size > 1:
            torch.cuda.synchronize(ws.device)
            dist.barrier(ws.group)


def _normalize_device(device) -> torch.device:
    """'cuda' -> 'cuda:<current>', so devices compare equal to tensors' devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _group_key(group) -> Any:
    if group is None or not dist.is_initialized():
        return None
    return getattr(group, "group_name", None) or id(group)


def create_workspace(config: MoKConfig, group, *, device, num_local_tokens: int,
                     hidden_size: int, topk: int, num_local_experts: int,
                     dtype: torch.dtype = torch.bfloat16, symmetric: bool = False) -> MoKWorkspace:
    """Validate the shapes, agree on them across the EP group and size the row table;
    with `symmetric`, allocate the kernel backend's arena (a collective)."""
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
    device = _normalize_device(device)
    arena = counters = None
    capacity = schedule_capacity(config, num_local_tokens, topk, ep_size, num_local_experts)
    if symmetric:
        from megatron_mok.kernels.megakernel import counters_size

        check_kernel_dims(hidden_size=hidden_size)
        check_kernel_config(config, ep_size)
        arena = SymmetricArena(group, ep_size, ep_rank, device, num_local_tokens, hidden_size,
                               topk, dtype)
        counters = torch.zeros(counters_size(capacity), dtype=torch.int32, device=device)
    return MoKWorkspace(
        group=group if ep_size > 1 else None, ep_size=ep_size, ep_rank=ep_rank,
        device=device, num_tokens=num_local_tokens, hidden_size=hidden_size,
        topk=topk, num_local_experts=num_local_experts,
        capacity=capacity, dtype=dtype, arena=arena, forward_counters=counters)


def get_workspace(config: MoKConfig, group, *, device, num_local_tokens: int, hidden_size: int,
                  topk: int, num_local_experts: int, dtype: torch.dtype = torch.bfloat16
                  ) -> MoKWorkspace:
    """Cached create_workspace, keyed by group, device, shapes, dtype and capacity
    multiplier; allocates the symmetric arena when the kernel backend will run. The cache
    keeps the MAX_CACHED_WORKSPACES most recently used (set_workspace_cache_limit)."""
    device = _normalize_device(device)
    ep_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    symmetric = resolve_backend(config, device, dtype, ep_size) == "kernel"
    key = (_group_key(group), str(device), num_local_tokens, hidden_size, topk,
           num_local_experts, dtype, config.schedule_capacity_multiplier, symmetric)
    ws = _CACHE.get(key)
    if ws is None:
        ws = create_workspace(config, group, device=device, num_local_tokens=num_local_tokens,
                              hidden_size=hidden_size, topk=topk,
                              num_local_experts=num_local_experts, dtype=dtype,
                              symmetric=symmetric)
        _CACHE[key] = ws
        _evict()
    else:
        _CACHE.move_to_end(key)
    return ws


def clear_workspace_cache(group: Optional[Any] = None) -> None:
    """Drop cached workspaces (all, or those of one group)."""
    if group is None:
        _CACHE.clear()
        return
    for key in [k for k in _CACHE if k[0] == _group_key(group)]:
        del _CACHE[key]
