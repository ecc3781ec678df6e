"""Per-expert tensors (weights, gradient buffers) seen as one [E, ...] tensor without a
copy, where their memory allows it."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def uniform_dense(tensors: Sequence[torch.Tensor]) -> bool:
    """Plain dense contiguous tensors (no DTensor or other subclass: their storage is not
    theirs) of one shape, dtype and device."""
    first = tensors[0]
    return all(type(t.data) is torch.Tensor and t.layout == torch.strided
               and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device and t.is_contiguous() for t in tensors)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter over a DTensor has its type


def stacked_alias(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, *shape] tensor over the tensors' own memory if they lie back to back in expert
    order in one storage, else None. Runs every forward, so it checks addresses rather than
    storages: consecutive addresses that all lie inside the first tensor's storage can only
    be that storage (tensors' storages do not overlap)."""
    if not tensors:
        return None
    first = tensors[0]
    shape, dtype, stride = first.shape, first.dtype, first.stride()
    if not all(type(t) in _PLAIN and t.shape == shape and t.dtype == dtype
               and t.stride() == stride for t in tensors) or not first.is_contiguous():
        return None
    step = first.numel() * first.element_size()
    base = first.data_ptr()
    if any(t.data_ptr() != base + e * step for e, t in enumerate(tensors)):
        return None
    storage = first.untyped_storage()
    if (first.storage_offset() * first.element_size() + len(tensors) * step
            > storage.nbytes()):
        return None  # the next expert lies past this storage: a neighbouring allocation
    out = first.new_empty(0)
    out.set_(storage, first.storage_offset(), (len(tensors), *shape),
             (first.numel(), *stride))
    return out
