"""The forward megakernel (csrc/megakernel/, docs/megakernel.md): pull dispatch, fc1 with
SwiGLU, fc2 and push combine of one layer in one persistent launch.

Comm CTAs pull the routed rows of x into row-table order and, tile by tile, push the
finished expert rows into their owners' (token, k) slots; compute CTAs run the grouped-GEMM
core's fc1 and fc2 tiles in a fixed topological order, waiting on per-tile readiness
counters. The combine epilogue (and the EP barrier before it) stays a separate launch.

Not yet the default: its comm CTAs copy rows more slowly than the launch chain's copy
kernels use the whole GPU (docs/megakernel.md, "Measured"), so at EP = 1 it is slower.
MOK_FORWARD=megakernel selects it; the default, MOK_FORWARD=launches, is the v1 chain.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_mok import grouped_gemm, ops
from megatron_mok.config import TILE_M

FORWARD_PATHS = ("megakernel", "launches")
# Comm CTAs stage 13 rows in the shared memory of a GEMM CTA (csrc/megakernel/row_mover.cuh).
MAX_HIDDEN = 8192


def available() -> bool:
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "moe_forward")


def forward_path(hidden: Optional[int] = None) -> str:
    """"launches" (v1: one launch per step, the default) or "megakernel" (when asked for
    with MOK_FORWARD=megakernel, built, and H <= MAX_HIDDEN)."""
    path = os.environ.get("MOK_FORWARD", "launches")
    if path not in FORWARD_PATHS:
        raise ValueError(f"megatron_mok: MOK_FORWARD must be one of {FORWARD_PATHS}, got {path!r}")
    if path == "megakernel" and (not available() or (hidden or 0) > MAX_HIDDEN):
        return "launches"
    return path


def counters_size(capacity: int) -> int:
    """int32 readiness counters of the forward megakernel for a row table of `capacity`."""
    return 2 + 3 * (capacity // TILE_M)


def moe_forward(ws, sched, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                save_h: bool, num_comm_sms: int, minibatch_rows: int, hold_tile: int = -1,
                timeout_ms: Optional[int] = None):
    """(x_rows, act, h or None, y_rows) of the routed expert pass; y rows are pushed into
    the (token, k) slots of the arena of the rank that owns each route.

    At EP = 1 the rows are pulled straight from x; at EP > 1 from the peers' published x
    (arena "x", written and fenced by a barrier before this call)."""
    arena = ws.arena
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if not 1 <= num_comm_sms < num_sms:
        raise ValueError(f"megatron_mok: the forward megakernel needs 1 to {num_sms - 1} comm "
                         f"SMs on this GPU, got {num_comm_sms}")
    if minibatch_rows < TILE_M or minibatch_rows % TILE_M:
        raise ValueError(f"megatron_mok: minibatch_rows must be a positive multiple of {TILE_M}, "
                         f"got {minibatch_rows}")
    rows, hidden = ws.capacity, x.shape[1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"megatron_mok: the forward megakernel supports H <= {MAX_HIDDEN}, "
                         f"got {hidden}")
    inter = w1.shape[1] // 2
    grouped_gemm._check_multiple_of_8(hidden=hidden, inter=inter)
    x_rows = x.new_empty(rows, hidden)
    act = x.new_empty(rows, inter)
    h = x.new_empty(rows, 2 * inter) if save_h else None
    y_rows = x.new_empty(rows, hidden)
    torch.ops.megatron_mok.moe_forward(
        arena.peer_base, arena.offset("x"), x if ws.ep_size == 1 else None, arena.offset("slots"),
        sched.peer_rank, sched.peer_token, sched.peer_k, sched.expert_offsets, sched.num_rows,
        ws.topk, w1, w2, x_rows, act, h, y_rows, ws.forward_counters, arena.watchdog,
        arena.WATCHDOG_TIMEOUT_MS if timeout_ms is None else timeout_ms, ws.ep_rank,
        num_comm_sms, minibatch_rows, hold_tile)
    return x_rows, act, h, y_rows
