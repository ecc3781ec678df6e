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

try:
    from megatron_mok import _C  # noqa: F401  (registers torch.ops.megatron_mok.*)
    EXTENSION_ERROR: Optional[str] = None
except ImportError as exc:  # built without nvcc, or a torch/CUDA mismatch
    _C = None
    EXTENSION_ERROR = f"the compiled extension megatron_mok._C did not load ({exc})"


def extension_available() -> bool:
    return _C is not None


if _C is not None:
    @torch.library.register_fake("megatron_mok::combine_epilogue")
    def _combine_epilogue_fake(slots, topk_idx, topk_w, shared):
        return slots.new_empty(slots.shape[0], slots.shape[2])


def combine_epilogue(slots: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                     shared: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[t] = shared[t] + sum_k w[t,k] * slots[t,k] (fp32, k ascending, one rounding)."""
    if _C is None:
        raise RuntimeError(f"megatron_mok: {EXTENSION_ERROR}")
    return torch.ops.megatron_mok.combine_epilogue(slots, topk_idx, topk_w, shared)


# The fused Hopper pass (dispatch + grouped GEMMs + combine) is not part of this
# build yet; the functional layer refuses backend="kernel" with this reason.
KERNEL_PASS_BUILT = False


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
        return False, "this build has no fused MoE kernels yet (only the combine epilogue op)"
    return True, ""


def kernel_backend_status(device) -> tuple[bool, str]:
    """(available, reason if not) for the kernel backend on `device`."""
    device = torch.device(device)
    return _device_status(device.type, device.index)
