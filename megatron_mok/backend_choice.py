"""Which backend runs a pass: the compiled Hopper kernel or the pure-PyTorch reference.

"auto" picks the kernel where it can run and warns once, with the reason, when it falls
back to the reference on a CUDA device (a broken build or an unsupported GPU would
otherwise train many times slower without a word); "kernel" that cannot run raises.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from megatron_mok.kernels import ops
from megatron_mok.config import MoKConfig
from megatron_mok.validation import kernel_config_refusal


def resolve_backend(config: MoKConfig, device: torch.device,
                    dtype: Optional[torch.dtype] = None, ep_size: int = 1) -> str:
    """The backend that runs on `device` for activations of `dtype` at `ep_size`; forcing
    an unavailable one is an error."""
    available, reason = ops.kernel_backend_status(device, dtype)
    if available:
        refusal = kernel_config_refusal(config, ep_size)
        available, reason = refusal is None, refusal or ""
    if config.backend == "kernel" and not available:
        raise RuntimeError(f"megatron_mok: backend='kernel' is not available here: {reason}. "
                           f"Use backend='reference' or 'auto'.")
    if config.backend == "auto":
        if not available and torch.device(device).type == "cuda":
            _warn_reference_on_gpu(reason)
        return "kernel" if available else "reference"
    return config.backend


_WARNED: set = set()


def _warn_reference_on_gpu(reason: str) -> None:
    """backend='auto' on a GPU the kernel cannot serve runs the pure-PyTorch spec (host
    syncs, all-gathers: many times slower): say so once per reason."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"megatron_mok: backend='auto' runs the slow pure-PyTorch reference on this "
                  f"CUDA device because {reason}. Pass backend='kernel' "
                  f"(--mok-backend kernel) to make this an error, or 'reference' to silence it.",
                  RuntimeWarning, stacklevel=3)
