"""torch.library ops of the compiled extension (megatron_mok._C), with fake impls.

The extension registers the schemas and the CPU/CUDA kernels in C++
(TORCH_LIBRARY(megatron_mok, ...)); this module loads it, adds the fake (meta)
implementations that torch.compile and CUDA-graph capture need, and says whether
the kernel backend can run on a device.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_mok import knobs

try:
    from megatron_mok import _C  # noqa: F401  (registers torch.ops.megatron_mok.*)
    EXTENSION_ERROR: Optional[str] = None
except ImportError as exc:  # built without nvcc, or a torch/CUDA mismatch
    _C = None
    EXTENSION_ERROR = f"the compiled extension megatron_mok._C did not load ({exc})"


def extension_available() -> bool:
    return _C is not None


def has_op(name: str) -> bool:
    """The loaded extension registers torch.ops.megatron_mok.<name>."""
    return _C is not None and hasattr(torch.ops.megatron_mok, name)


if _C is not None:
    @torch.library.register_fake("megatron_mok::combine_epilogue")
    def _combine_epilogue_fake(slots, topk_idx, topk_w, shared):
        return slots.new_empty(slots.shape[0], slots.shape[2])

    if hasattr(torch.ops.megatron_mok, "combine_rows"):
        @torch.library.register_fake("megatron_mok::combine_rows")
        def _combine_rows_fake(rows, route_row, topk_w, shared):
            return rows.new_empty(route_row.shape[0], rows.shape[1])

    # The communication ops only write into their (a!) arguments.
    for _name in ("ep_barrier", "gather_from_peers", "pull_rows", "push_rows",
                  "zero_dropped_routes",
                  "grouped_fc1_swiglu", "grouped_gemm_rows", "grouped_dgrad_swiglu",
                  "grouped_wgrad", "grouped_fc1_act", "grouped_dgrad_act", "build_row_table",
                  "moe_forward", "moe_backward"):
        if hasattr(torch.ops.megatron_mok, _name):
            torch.library.register_fake(f"megatron_mok::{_name}")(lambda *args, **kwargs: None)


def combine_epilogue(slots: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                     shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[t] = shared[t] + sum_k w[t,k] * slots[t,k] (fp32, k ascending, one rounding)."""
    if _C is None:
        raise RuntimeError(f"megatron_mok: {EXTENSION_ERROR}")
    return torch.ops.megatron_mok.combine_epilogue(slots, topk_idx, topk_w, shared)


def combine_rows(rows: torch.Tensor, route_row: torch.Tensor, topk_w: torch.Tensor,
                 shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """combine_epilogue with slots[t, k] = rows[route_row[t, k]] read in place (route_row
    -1: not routed); bit-equal to pushing the rows into slots first (CUDA, bf16)."""
    if _C is None:
        raise RuntimeError(f"megatron_mok: {EXTENSION_ERROR}")
    return torch.ops.megatron_mok.combine_rows(rows, route_row, topk_w, shared)


def ep_barrier(peer_base, flag_offset: int, epoch, rank: int, watchdog, timeout_ms: int) -> None:
    torch.ops.megatron_mok.ep_barrier(peer_base, flag_offset, epoch, rank, watchdog, timeout_ms)


def gather_from_peers(peer_base, offset: int, out) -> None:
    torch.ops.megatron_mok.gather_from_peers(peer_base, offset, out)


def pull_rows(peer_base, src_offset: int, sched, topk: int, out, *, w_offset: int = -1,
              row_w=None) -> None:
    """out[j] = row sched.peer_token[j] of rank sched.peer_rank[j]'s buffer at src_offset
    (zeros for padding rows); with row_w, row_w[j] = that rank's router weight of the route
    at w_offset (0 for padding; the rows stay unscaled)."""
    torch.ops.megatron_mok.pull_rows(peer_base, src_offset, sched.peer_rank, sched.peer_token,
                                     sched.peer_k, sched.num_rows, topk, w_offset, out, row_w)


def push_rows(rows, peer_base, dst_offset: int, sched, topk: int, *, scalars=None,
              scalar_offset: int = 0) -> None:
    """rows[j] -> slot (token, k) of rank peer_rank[j]'s buffer at dst_offset, and scalars[j]
    to the same slot of its buffer at scalar_offset (rows None: the scalars only)."""
    torch.ops.megatron_mok.push_rows(rows, peer_base, dst_offset, sched.peer_rank,
                                     sched.peer_token, sched.peer_k, sched.num_rows, topk,
                                     scalars, scalar_offset)


def zero_dropped_routes(peer_base, slots_offset: int, scalar_offset: int, dropped,
                        num_tokens: int, topk: int, hidden: int) -> None:
    """Zero slot (t, k) (row and scalar) on the source rank of every route in `dropped`
    ([1 + P T K] int32: the count, then flat route ids of topk_idx_all)."""
    torch.ops.megatron_mok.zero_dropped_routes(peer_base, slots_offset, scalar_offset,
                                               dropped, num_tokens, topk, hidden)


# The v1 kernel backend needs the communication ops of csrc/comm/.
KERNEL_PASS_BUILT = _C is not None and hasattr(torch.ops.megatron_mok, "pull_rows")


@functools.lru_cache(maxsize=None)
def _device_status(device_type: str, index: Optional[int]) -> tuple[bool, str]:
    if device_type != "cuda":
        return False, f"the kernel backend runs on CUDA devices, not {device_type}"
    if not torch.cuda.is_available():
        return False, "no CUDA device is available"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return False, f"the kernel backend targets sm_90a (Hopper); this GPU is sm_{major}{minor}"
    if _C is None:
        return False, EXTENSION_ERROR
    if not KERNEL_PASS_BUILT:
        return False, "the extension was built without the communication ops"
    return True, ""


def kernel_backend_status(device, dtype: Optional[torch.dtype] = None) -> tuple[bool, str]:
    """(available, reason if not) for the kernel backend on `device` for activations of
    `dtype` (the kernel pass is BF16; fp32 models run the reference)."""
    device = torch.device(device)
    available, reason = _device_status(device.type, device.index)
    if available and dtype is not None and dtype != torch.bfloat16:
        return False, f"the kernel backend computes in bfloat16, not {dtype}"
    return available, reason


def _push_knobs(values: dict) -> None:
    """Hand the C++ launchers their MOK_* knobs (read and validated by megatron_mok.knobs)."""
    if not has_op("set_knobs"):
        return
    torch.ops.megatron_mok.set_knobs(
        values["MOK_GEMM_SCHEDULER"] == "static", int(values["MOK_GEMM_CLUSTER"]),
        values["MOK_GEMM_PINGPONG"] == "1", values["MOK_DGRAD_H"] == "global",
        ("lines", "tma", "rows").index(values["MOK_MEGAKERNEL_GATHER"]),
        int(values["MOK_MOVER_WARPS"]), values["MOK_FP8_PROMOTION"] == "overlap")


knobs.on_reload(_push_knobs)
