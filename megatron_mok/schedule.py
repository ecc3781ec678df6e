"""Routing -> row table (DESIGN.md section 4, step 3), with tensor ops only: no host sync.

Every rank sees all peers' routing [P, T, K]. The routes that land on this rank's
local experts are laid out expert by expert, each expert's segment padded to the
GEMM tile height (TILE_M) so a tile never spans two experts:

    row j of the table -> (source rank, token, k), or -1 for padding / unused rows

Inside a segment rows keep (source rank, token, k) order, and placement uses
prefix sums only, so the table is deterministic. The table has a static capacity
(launch shapes never depend on the counts, so the pass is CUDA-graph capturable);
`overflow` is a device flag, set when the padded rows exceed it.

This module is the executable form of the schedule; the kernel backend's GPU
schedule op must produce the same table.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_mok import knobs
from megatron_mok.config import TILE_M


@dataclasses.dataclass
class MoKSchedule:
    """Row table of one rank for one routing (reused by forward, backward and recompute)."""

    peer_rank: torch.Tensor         # [capacity] int32, source rank of row j (-1: padding)
    peer_token: torch.Tensor        # [capacity] int32, token index on that rank (-1: padding)
    peer_k: torch.Tensor            # [capacity] int32, route slot k of that token (-1: padding)
    tokens_per_expert: torch.Tensor  # [E_loc] int32, routed rows per local expert (unpadded)
    expert_offsets: torch.Tensor    # [E_loc + 1] int32, padded segment starts; last = num_rows
    num_rows: torch.Tensor          # [1] int32, padded rows in use
    overflow: torch.Tensor          # [1] int32, 1 when the routing did not fit the capacity
    invalid_ids: torch.Tensor       # [1] int32, 1 when some expert id was outside [-1, E)
    topk_idx_all: torch.Tensor      # [P, T, K] routing of every EP rank (global expert ids)
    # [T, K] int32 at EP = 1 (None at EP > 1): the row of route (t, k), -1 when it has none
    # (dropped, id -1); the in-place combine reads it.
    route_row: Optional[torch.Tensor] = None
    # [1 + P T K] int32 (kernel backend, EP > 1): dropped[0] routes left out for lack of
    # room, their flat ids of topk_idx_all in dropped[1:]; each pass zeroes their slots.
    dropped: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        return self.peer_rank.numel()

    def check_errors(self) -> None:
        """Turn the device error flags into exceptions: a host sync, at a point the caller
        chooses (the kernel pass itself never syncs)."""
        invalid, overflow = int(self.invalid_ids.item()), int(self.overflow.item())
        if invalid or overflow:
            # Reported here, after the sync of .item(): the device latch's copy of the same
            # error must not resurface at the next pass's poll.
            from megatron_mok import routing_errors
            routing_errors.clear(self.overflow.device)
        if invalid:
            raise ValueError("megatron_mok: topk_idx holds expert ids outside [-1, num_experts)")
        if overflow:
            raise RuntimeError(
                f"megatron_mok: routing needs {int(self.num_rows.item())} padded rows on this rank "
                f"but the row table holds {self.capacity}; raise "
                f"MoKConfig.schedule_capacity_multiplier (--mok-capacity-multiplier)")


# The CUDA op's limits (csrc/comm/schedule.cu): past them the tensor ops build the table.
KERNEL_MAX_LOCAL_EXPERTS = 512


def schedule_kernel_enabled(topk_idx_all: torch.Tensor, num_local_experts: int = 1,
                            capacity: int = TILE_M) -> bool:
    """MOK_SCHEDULE=kernel (the default): build the table with the three-launch CUDA op
    (csrc/comm/schedule.cu) instead of ~60 tensor ops, where it applies (CUDA routing, the
    extension built, <= 512 local experts, whole 128-row tiles); same integers. Measured
    (H200, 1792cfb, T = 8192): layer forward qwen3-30b-a3b 1.475 -> 1.243 ms, qwen3.5-like
    4.185 -> 4.058 ms. `torch` keeps the ops."""
    if knobs.get("MOK_SCHEDULE") != "kernel" or not topk_idx_all.is_cuda:
        return False
    if num_local_experts > KERNEL_MAX_LOCAL_EXPERTS or capacity % TILE_M:
        return False
    from megatron_mok.kernels import ops  # loads the extension (its ops register on import)
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "build_row_table")


def build_row_table(topk_idx_all: torch.Tensor, ep_rank: int, num_local_experts: int,
                    capacity: int, num_experts: Optional[int] = None,
                    status: Optional[torch.Tensor] = None,
                    list_dropped: bool = False) -> MoKSchedule:
    """Row table of rank `ep_rank` from the routing of all ranks, topk_idx_all [P, T, K].
    status: the device's sticky routing status (routing_errors), which latches the first
    overflow / invalid id; list_dropped: also list the routes the table left out."""
    if num_experts is None:
        num_experts = topk_idx_all.shape[0] * num_local_experts
    if schedule_kernel_enabled(topk_idx_all, num_local_experts, capacity):
        return _build_row_table_kernel(topk_idx_all, ep_rank, num_local_experts, capacity,
                                       num_experts, status, list_dropped)
    ep_size, num_tokens, topk = topk_idx_all.shape
    device = topk_idx_all.device
    flat = topk_idx_all.reshape(-1).long()
    num_routes = flat.numel()
    local = flat - ep_rank * num_local_experts
    is_local = (flat >= 0) & (local >= 0) & (local < num_local_experts)
    # Non-local routes go to a dummy bin E_loc that sorts last.
    bins = torch.where(is_local, local, torch.full_like(local, num_local_experts))

    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    counts = counts[:num_local_experts]
    padded = (counts + TILE_M - 1) // TILE_M * TILE_M
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    unpadded_starts = torch.cumsum(counts, 0) - counts

    # Stable order by (expert, route id): position of each route inside its expert.
    order = torch.argsort(bins * num_routes + torch.arange(num_routes, device=device))
    sorted_bins = bins[order]
    is_local_sorted = sorted_bins < num_local_experts
    safe_bins = torch.where(is_local_sorted, sorted_bins, torch.zeros_like(sorted_bins))
    rank_in_expert = torch.arange(num_routes, device=device) - unpadded_starts[safe_bins]
    row = row_unclamped = offsets[safe_bins] + rank_in_expert
    keep = is_local_sorted & (row < capacity)
    # Rows that are not kept are written to a scratch slot past the end, then dropped.
    row = torch.where(keep, row, torch.full_like(row, capacity))

    route_src = torch.full((capacity + 1,), -1, dtype=torch.long, device=device)
    route_src.scatter_(0, row, torch.where(keep, order, torch.full_like(order, -1)))
    route_src = route_src[:capacity]
    valid = route_src >= 0
    peer_rank = torch.where(valid, route_src // max(1, num_tokens * topk), -1)
    peer_token = torch.where(valid, route_src // topk % max(1, num_tokens), -1)
    peer_k = torch.where(valid, route_src % topk, -1)
    num_rows = offsets[-1:]
    invalid_routes = (flat < -1) | (flat >= num_experts)
    invalid = invalid_routes.any().reshape(1)
    if status is not None:
        _latch_errors(status, num_rows, capacity, counts, padded, offsets, flat,
                      invalid_routes, ep_rank, topk_idx_all.shape)
    dropped = None
    if list_dropped:  # in stable order (the kernel's is any order: only the set matters)
        lost = is_local_sorted & (row_unclamped >= capacity)
        slot = torch.where(lost, torch.cumsum(lost.long(), 0), num_routes + 1)
        dropped = torch.full((num_routes + 2,), -1, dtype=torch.long, device=device)
        dropped.scatter_(0, slot, order)
        dropped[0] = lost.sum()
        dropped = dropped[:-1].int()
    route_row = None
    if ep_size == 1:  # the inverse map: route `order[i]` sits in row `row[i]` when kept
        route_row = torch.empty(num_routes, dtype=torch.int32, device=device)
        route_row.scatter_(0, order, torch.where(keep, row, -1).int())
        route_row = route_row.view(num_tokens, topk)
    return MoKSchedule(
        peer_rank=peer_rank.int(), peer_token=peer_token.int(), peer_k=peer_k.int(),
        tokens_per_expert=counts.int(), expert_offsets=offsets.int(),
        num_rows=num_rows.int(), overflow=(num_rows > capacity).int(),
        invalid_ids=invalid.int(), topk_idx_all=topk_idx_all, route_row=route_row,
        dropped=dropped)


def _latch_errors(status, num_rows, capacity, counts, padded, offsets, flat, invalid_routes,
                  ep_rank, shape) -> None:
    """The kernel's latch_errors (csrc/comm/schedule.cu) in tensor ops, no host sync: the
    first overflow / invalid id since the host cleared `status` keeps its details."""
    from megatron_mok import routing_errors as rs

    ep_size, num_tokens, topk = shape
    num_local = counts.numel()
    over = (num_rows > capacity).reshape(())
    kept = torch.minimum((capacity - offsets[:-1]).clamp(min=0), counts)
    busiest = torch.argmax(counts)  # the first of the largest, as the kernel's strict >
    overflow_record = torch.stack([
        torch.full_like(busiest, ep_rank), num_rows.reshape(()).long(),
        torch.full_like(busiest, capacity), busiest + ep_rank * num_local, counts[busiest],
        (counts - kept).sum(), torch.full_like(busiest, ep_size),
        torch.full_like(busiest, num_tokens), torch.full_like(busiest, topk),
        torch.full_like(busiest, num_local)]).int()
    bad = invalid_routes.sum()
    # The lowest invalid route (a spare valid entry keeps argmax defined with no routes).
    first = torch.argmax(torch.cat([invalid_routes.int(), invalid_routes.new_ones(1).int()]))
    first = torch.minimum(first, torch.tensor(max(flat.numel() - 1, 0), device=flat.device))
    invalid_record = torch.stack([
        first // max(1, num_tokens * topk), first // max(1, topk) % max(1, num_tokens),
        first % max(1, topk), flat[first] if flat.numel() else first, bad]).int()
    bits = status[rs.BITS]
    new_over = over & (bits & rs.OVERFLOW == 0)
    new_invalid = (bad > 0) & (bits & rs.INVALID_IDS == 0)
    status[rs.OVERFLOW_RANK:rs.INVALID_RANK] = torch.where(
        new_over, overflow_record, status[rs.OVERFLOW_RANK:rs.INVALID_RANK])
    status[rs.INVALID_RANK:] = torch.where(new_invalid, invalid_record,
                                           status[rs.INVALID_RANK:])
    status[rs.BITS] = bits | over.int() * rs.OVERFLOW | (bad > 0).int() * rs.INVALID_IDS


def _build_row_table_kernel(topk_idx_all: torch.Tensor, ep_rank: int, num_local_experts: int,
                            capacity: int, num_experts: int, status: Optional[torch.Tensor],
                            list_dropped: bool) -> MoKSchedule:
    """build_row_table's table from the CUDA op: the same integers, three launches."""
    ids = topk_idx_all.to(torch.int32).contiguous()
    device = ids.device
    # One allocation for the table's int32 arrays (a layer call's host time is mostly
    # such small ops), each array starting on a 256-byte boundary as its own would.
    sizes = [capacity] * 3 + [num_local_experts, num_local_experts + 1, 1, 1, 1]
    sizes += [ids.numel()] if ids.shape[0] == 1 else []
    sizes += [1 + ids.numel()] if list_dropped else []
    pieces = [part for n in sizes for part in (n, -n % 64)]  # each array, then its padding
    arrays = iter(torch.empty(sum(pieces), dtype=torch.int32, device=device)
                  .split(pieces)[::2])

    def ints(n):  # the next array of `sizes`, in order
        array = next(arrays)
        assert array.numel() == n
        return array

    sched = MoKSchedule(peer_rank=ints(capacity), peer_token=ints(capacity),
                        peer_k=ints(capacity), tokens_per_expert=ints(num_local_experts),
                        expert_offsets=ints(num_local_experts + 1), num_rows=ints(1),
                        overflow=ints(1), invalid_ids=ints(1), topk_idx_all=topk_idx_all)
    if ids.shape[0] == 1:
        sched.route_row = ints(ids.numel()).view(ids.shape[1], ids.shape[2])
    if list_dropped:
        sched.dropped = ints(1 + ids.numel())
    if status is None:  # the caller does not report errors: a scratch word
        from megatron_mok.routing_errors import STATUS_SIZE
        status = torch.zeros(STATUS_SIZE, dtype=torch.int32, device=device)
    torch.ops.megatron_mok.build_row_table(
        ids, ep_rank, num_local_experts, num_experts, sched.peer_rank, sched.peer_token,
        sched.peer_k, sched.tokens_per_expert, sched.expert_offsets, sched.num_rows,
        sched.overflow, sched.invalid_ids, sched.route_row, status, sched.dropped)
    return sched
