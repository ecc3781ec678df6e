"""The forward megakernel (csrc/megakernel/, docs/megakernel.md): pull dispatch, fc1 with
SwiGLU, fc2 and push combine of one layer in one persistent launch.

Movers pull the routed rows of x into row-table order (comm CTAs, or in spread mode three
idle producer warps of every CTA) and finished expert rows go to their owners' (token, k)
slots (pushed by the comm CTAs, or stored by fc2's epilogue), or stay in place for the
EP = 1 combine; compute CTAs run the grouped-GEMM core's fc1 and fc2 tiles in a fixed
topological order, waiting on per-tile readiness counters. The combine epilogue (and the
EP barrier before it) stays a separate launch. The backward megakernel (moe_backward)
runs the data gradients the same way and, optionally, the weight gradients after them.

Spread mode is the EP = 1 default (autotune.forward_plan; measured 1.05-1.17x faster than
the launch chain on 5 of 6 shapes: docs/megakernel.md, "Measured"). MOK_FORWARD selects
a path explicitly, and a cached autotune plan overrides the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from megatron_mok import knobs
from megatron_mok.kernels import grouped_gemm, ops
from megatron_mok.config import TILE_M

# megakernel: direct mode at EP = 1 (no comm CTAs: fc1 gathers its rows, fc2 scatters into
# the slots), comm CTAs at EP > 1; megakernel-comm: comm CTAs at every EP (benchmarks);
# megakernel-spread: no comm CTAs, the producer warps of every CTA pull the rows.
FORWARD_PATHS = ("megakernel", "megakernel-comm", "megakernel-spread", "launches")
# Comm CTAs stage rows in the shared memory of a GEMM CTA (csrc/megakernel/row_mover.cuh):
# at H = 8192 (16 KB rows) 13 slots with one mover warp, 9 with four.
MAX_HIDDEN = 8192


def available() -> bool:
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "moe_forward")


def runnable(hidden: int) -> bool:
    """The megakernel is built and supports this hidden size."""
    return available() and hidden <= MAX_HIDDEN


def forward_path(hidden: Optional[int] = None) -> str:
    """The path MOK_FORWARD asks for ("launches" when unset), or "launches" when a
    megakernel path is asked for but not built or H > MAX_HIDDEN. (Without MOK_FORWARD
    the default comes from autotune.forward_plan: spread at EP = 1.)"""
    path = knobs.get("MOK_FORWARD") or "launches"
    if path.startswith("megakernel") and not runnable(hidden or 0):
        return "launches"
    return path


def counters_size(capacity: int) -> int:
    """int32 readiness counters of the forward megakernel for a row table of `capacity`."""
    return 2 + 3 * (capacity // TILE_M)


def moe_forward(ws, sched, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                save_h: bool, num_comm_sms: int, minibatch_rows: int,
                direct: Optional[bool] = None, hold_tile: int = -1,
                timeout_ms: Optional[int] = None, probe: Optional[torch.Tensor] = None,
                scatter: bool = True, ring_rows: Optional[int] = None,
                b1: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                glu: Optional[tuple] = None):
    """(x_rows, act, h, y_rows) of the routed expert pass; y rows land in the (token, k)
    slots of the arena of the rank that owns each route.

    direct (default at EP = 1): no comm CTAs; fc1 gathers its rows from x and fc2 writes
    the slots itself; x_rows is then None, and y_rows and h are only written with save_h
    (the backward's inputs). Otherwise comm CTAs pull the rows (from x at EP = 1, from the
    peers' published arena "x" at EP > 1) and push y rows; num_comm_sms of them.
    num_comm_sms=0 without direct is spread mode: no comm CTAs; three producer warps of
    every CTA pull the rows into x_rows (fc1 then loads them by TMA, as in comm mode) and
    fc2's epilogue writes the slots (as in direct mode; y_rows only with save_h).

    scatter=False (direct and spread mode): fc2 writes y_rows and no slots; the combine
    reads the rows in place (ops.combine_rows).

    ring_rows (comm mode only): pull into a ring of this many x rows (whole tiles, at least
    one minibatch), tile m into slot m mod ring tiles once fc1 has read the slot's previous
    tile; x_rows is then not returned (None): the backward must gather it again.

    probe: an int64 [num_SMs, PROBE_SLOTS] CUDA tensor (new_probe) to which every CTA adds
    its cycle counts (read with probe_summary); None: no probing.

    b1 [E, 2I] / b2 [E, H]: the experts' biases, added in fc1's and fc2's epilogues; glu:
    the general GLU's (alpha, limit, offset) instead of SwiGLU (grouped_gemm's module doc)."""
    arena = ws.arena
    if direct is None:
        direct = ws.ep_size == 1
    if direct and ws.ep_size != 1:
        raise ValueError("megatron_mok: the direct megakernel runs at EP = 1 only")
    spread = not direct and num_comm_sms == 0
    if not scatter and (not (direct or spread) or ws.ep_size != 1):
        raise ValueError("megatron_mok: only the direct and spread megakernels at EP = 1 can "
                         "skip the slots (the combine reads the rows in place)")
    if ring_rows is not None and (direct or spread or ring_rows % TILE_M
                                  or ring_rows < minibatch_rows or ring_rows > ws.capacity):
        raise ValueError(f"megatron_mok: an x_rows ring needs comm CTAs and whole tiles between "
                         f"the minibatch ({minibatch_rows}) and the capacity ({ws.capacity}), "
                         f"got {ring_rows} rows")
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if not direct and not 0 <= num_comm_sms < num_sms:
        raise ValueError(f"megatron_mok: the forward megakernel needs 0 (spread mode) to "
                         f"{num_sms - 1} comm SMs on this GPU, got {num_comm_sms}")
    if minibatch_rows < TILE_M or minibatch_rows % TILE_M:
        raise ValueError(f"megatron_mok: minibatch_rows must be a positive multiple of {TILE_M}, "
                         f"got {minibatch_rows}")
    rows, hidden = ws.capacity, x.shape[1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"megatron_mok: the forward megakernel supports H <= {MAX_HIDDEN}, "
                         f"got {hidden}")
    inter = w1.shape[1] // 2
    grouped_gemm.check_multiple_of_8(hidden=hidden, inter=inter)
    grouped_gemm.check_bias("b1", b1, w1.shape[0], 2 * inter, x)
    grouped_gemm.check_bias("b2", b2, w1.shape[0], hidden, x)
    glu_on, alpha, limit, offset = grouped_gemm.glu_args(
        glu, biased=b1 is not None or b2 is not None)  # the bias adds: general epilogues
    act = x.new_empty(rows, inter)
    h = x.new_empty(rows, 2 * inter) if save_h else None
    y_rows = x.new_empty(rows, hidden)
    # direct: a placeholder only; ring: ring_rows rows reused tile by tile
    x_rows = y_rows if direct else x.new_empty(ring_rows or rows, hidden)
    torch.ops.megatron_mok.moe_forward(
        arena.peer_base, arena.offset("x"), x if ws.ep_size == 1 else None, arena.offset("slots"),
        sched.peer_rank, sched.peer_token, sched.peer_k, sched.expert_offsets, sched.num_rows,
        ws.topk, w1, w2, x_rows, act, h, y_rows, ws.forward_counters, arena.watchdog,
        arena.WATCHDOG_TIMEOUT_MS if timeout_ms is None else timeout_ms, ws.ep_rank,
        0 if direct else num_comm_sms, minibatch_rows, direct, save_h, hold_tile, probe,
        scatter, b1=b1, b2=b2, glu=glu_on, glu_alpha=alpha, glu_limit=limit, glu_offset=offset)
    if direct:
        return None, act, h, (y_rows if save_h or not scatter else None)
    ring = ring_rows is not None and ring_rows < rows
    return ((None if ring else x_rows), act, h,
            (None if spread and scatter and not save_h else y_rows))


# MOK_BACKWARD: "launches" (v1's chain, the default until the megakernel is measured) or
# "megakernel" (the dgrad half in one launch).
BACKWARD_PATHS = ("launches", "megakernel")


def backward_available() -> bool:
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "moe_backward")


def backward_path(ws, dtype: torch.dtype, in_place: bool) -> str:
    """"megakernel" when MOK_BACKWARD asks for it and it can run here (built, bf16
    gradients; at EP = 1 with the combine reading rows in place, at EP > 1 with the slots),
    else "launches". (Its row movers use registers, not shared memory: no limit on H.)"""
    path = knobs.get("MOK_BACKWARD") or "launches"
    return path if path == "megakernel" and backward_runnable(ws, dtype, in_place) \
        else "launches"


def backward_runnable(ws, dtype: torch.dtype, in_place: bool) -> bool:
    """The backward megakernel can run here: built, bf16 gradients, and at EP = 1 the
    combine reading rows in place, at EP > 1 the slots."""
    return backward_available() and dtype == torch.bfloat16 and in_place == (ws.ep_size == 1)


@dataclass
class WgradTargets:
    """The backward megakernel's phase 2: dw2 [E, H, I] = dy_rows^T act_scaled and dw1
    [E, 2I, H] = d_h^T x_rows per expert (tokens in row-table order; dy_rows and act_scaled
    are the launch's own outputs), bf16 outputs written, or fp32 planes (Megatron's
    main_grad: dense [M, N] planes, 16-byte aligned apart) added into with `accumulate`;
    reverse2 / reverse1: expert e's into plane E - 1 - e."""
    x_rows: torch.Tensor
    dw2: torch.Tensor
    dw1: torch.Tensor
    accumulate: bool = False
    reverse2: bool = False
    reverse1: bool = False

    def check(self, rows: int, hidden: int, inter: int, experts: int,
              device: Optional[torch.device] = None) -> None:
        """Shapes and dtypes first (each with its own message), then placement: CUDA, on
        `device`, contiguous / dense planes, 16-byte aligned (TMA)."""
        if (self.reverse2 or self.reverse1) and not self.accumulate:
            raise ValueError("megatron_mok: reversed planes need accumulate (main_grad)")
        out_dtype = torch.float32 if self.accumulate else torch.bfloat16
        tensors = (("x_rows", self.x_rows, (rows, hidden), torch.bfloat16),
                   ("dw2", self.dw2, (experts, hidden, inter), out_dtype),
                   ("dw1", self.dw1, (experts, 2 * inter, hidden), out_dtype))
        for name, t, shape, dtype in tensors:
            if tuple(t.shape) != shape:
                raise ValueError(f"megatron_mok: {name} must be {list(shape)}, got "
                                 f"{list(t.shape)}")
            if t.dtype != dtype:
                why = " (main_grad accumulation)" if self.accumulate and name[:2] == "dw" else ""
                raise TypeError(f"megatron_mok: {name} must be {dtype}{why}, got {t.dtype}")
        for name, t, _, _ in tensors:
            if not t.is_cuda or (device is not None and t.device != device):
                raise ValueError(f"megatron_mok: {name} must be on {device or 'a CUDA device'}, "
                                 f"got {t.device}")
            rows_operand = name == "x_rows"
            dense = t.is_contiguous() if rows_operand else grouped_gemm.planes_accumulable(t)
            if not dense or t.data_ptr() % 16:
                layout = "contiguous" if rows_operand else "dense [M, N] planes 16 bytes apart"
                raise ValueError(f"megatron_mok: {name} must be {layout} and 16-byte aligned "
                                 f"(TMA)")

    def op_args(self) -> tuple:
        return (self.x_rows, self.dw2, self.dw1, self.accumulate, self.reverse2, self.reverse1)


class DataGradients(NamedTuple):
    """What the routed experts' data gradients leave for the weight gradients and the
    combine, in row-table order (the backward megakernel and the launch chain alike):
    dy_rows: the dy rows, unscaled; row_w: their router weights (0: padding);
    dots_part [rows, ceil(I / 256)]: <dy, y_row> per column tile of fc2's dgrad (their sum
    is d_topk_w's row); act_scaled: row_w * SwiGLU(h) (dW2 = dy_rows^T act_scaled);
    d_h: the SwiGLU backward's [d_gate, d_up]; dx_rows: fc1's dgrad (None when the
    megakernel scattered them into the owners' slots, EP > 1)."""
    dy_rows: torch.Tensor
    row_w: torch.Tensor
    dots_part: torch.Tensor
    act_scaled: torch.Tensor
    d_h: torch.Tensor
    dx_rows: Optional[torch.Tensor]

    def dots(self) -> torch.Tensor:
        """[rows] fp32 <dy, y_row>: the partials summed in column-tile order."""
        return self.dots_part.sum(1)


def moe_backward(ws, sched, dy: torch.Tensor, topk_w: Optional[torch.Tensor],
                 w1: torch.Tensor, w2: torch.Tensor, h: torch.Tensor, *,
                 minibatch_rows: int, hold_tile: int = -1,
                 timeout_ms: Optional[int] = None,
                 wgrad: Optional["WgradTargets"] = None,
                 glu: Optional[tuple] = None) -> DataGradients:
    """The routed experts' data gradients in one persistent launch
    (csrc/megakernel/backward.cuh), bitwise those of the launch chain: dy rows and their
    router weights pulled (ops.pull_rows), fc2 dgrad with the router weight and the SwiGLU
    backward in its epilogue (from the saved h; it also emits the <dy, y_row> partials and
    act_scaled), fc1 dgrad. With `wgrad` the same launch then computes the weight
    gradients into wgrad.dw2 / wgrad.dw1 (phase 2: the bits of grouped_gemm.wgrad on
    dy_rows, act_scaled and d_h, x_rows), else they are left to the core's wgrad launches.

    EP = 1: reads dy and topk_w directly; the combine reads dx_rows in place
    (ops.combine_rows). EP > 1: every rank has published its dy and router weights in the
    arena ("dy", "topk_w") and passed a barrier; the kernel pulls from the peers and writes
    dx rows into their owners' "slots" (as push_rows does); dx_rows is then None and
    topk_w is unused; the caller pushes the dots (DataGradients.dots) to d_topk_w.
    glu: the general GLU's (alpha, limit, offset) backward instead of SwiGLU's."""
    if minibatch_rows < TILE_M or minibatch_rows % TILE_M:
        raise ValueError(f"megatron_mok: minibatch_rows must be a positive multiple of {TILE_M}, "
                         f"got {minibatch_rows}")
    rows, hidden = ws.capacity, dy.shape[1]
    for name, t in (("dy", dy), ("w1", w1), ("w2", w2), ("h", h)):
        if t.dtype != torch.bfloat16 or not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"megatron_mok: {name} must be a contiguous CUDA bfloat16 tensor")
    inter = w1.shape[1] // 2
    grouped_gemm.check_multiple_of_8(hidden=hidden, inter=inter)
    if h.shape != (rows, 2 * inter):
        raise ValueError(f"megatron_mok: h must be [{rows}, {2 * inter}], got {tuple(h.shape)}")
    if wgrad is not None:
        wgrad.check(rows, hidden, inter, w1.shape[0], dy.device)
    glu_on, alpha, limit, offset = grouped_gemm.glu_args(glu)
    arena, local = ws.arena, ws.ep_size == 1
    out = DataGradients(
        dy_rows=dy.new_empty(rows, hidden),
        row_w=torch.empty(rows, dtype=torch.float32, device=dy.device),
        dots_part=torch.empty(rows, grouped_gemm.dgrad_col_tiles(inter), dtype=torch.float32,
                              device=dy.device),
        act_scaled=dy.new_empty(rows, inter), d_h=dy.new_empty(rows, 2 * inter),
        dx_rows=dy.new_empty(rows, hidden) if local else None)  # EP > 1: into the slots
    torch.ops.megatron_mok.moe_backward(
        arena.peer_base, arena.offset("dy"), arena.offset("topk_w"), dy if local else None,
        topk_w.float().contiguous() if local else None, ws.topk, sched.peer_rank,
        sched.peer_token, sched.peer_k, sched.expert_offsets, sched.num_rows, w1, w2, h,
        out.dy_rows, out.row_w, out.dots_part, out.act_scaled, out.d_h, out.dx_rows,
        ws.forward_counters, arena.watchdog,
        arena.WATCHDOG_TIMEOUT_MS if timeout_ms is None else timeout_ms, ws.ep_rank,
        minibatch_rows, not local, arena.offset("slots"), hold_tile,
        *(wgrad.op_args() if wgrad is not None else (None, None, None, False, False, False)),
        glu=glu_on, glu_alpha=alpha, glu_limit=limit, glu_offset=offset)
    return out


# Cycle probes (csrc/megakernel/forward.cuh, ProbeSlot): per CTA, summed by the first
# consumer warpgroup's thread 0 and the producer's thread 0.
PROBE_SLOTS = 16
_PROBE_FC1, _PROBE_FC2, _PROBE_QUEUE_WAIT, _PROBE_DEP_WAIT = 0, 4, 8, 9


def new_probe(device) -> torch.Tensor:
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(num_sms, PROBE_SLOTS, dtype=torch.int64, device=device)


def probe_summary(probe: torch.Tensor) -> dict:
    """Cycle counts of one probed launch, summed over the CTAs: per task kind, tasks, K
    steps, mainloop cycles (queue arrival to last WGMMA, including the wait for the first
    stage) and epilogue cycles, with per-K-step and per-task means; the consumers' waits
    for task ids and the producers' dependency waits."""
    total = probe.sum(0).tolist()
    out = {}
    for name, base in (("fc1", _PROBE_FC1), ("fc2", _PROBE_FC2)):
        tasks, k_steps, mainloop, epilogue = total[base:base + 4]
        out[name] = {"tasks": tasks, "k_steps": k_steps, "mainloop_cycles": mainloop,
                     "epilogue_cycles": epilogue,
                     "cycles_per_k_step": mainloop / k_steps if k_steps else 0.0,
                     "epilogue_cycles_per_task": epilogue / tasks if tasks else 0.0}
    out["queue_wait_cycles"] = total[_PROBE_QUEUE_WAIT]
    out["dependency_wait_cycles"] = total[_PROBE_DEP_WAIT]
    busy = sum(out[k]["mainloop_cycles"] + out[k]["epilogue_cycles"] for k in ("fc1", "fc2"))
    out["consumer_cycles"] = busy + out["queue_wait_cycles"]
    return out
