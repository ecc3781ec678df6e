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


def stacked_alias(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, *shape] tensor over the tensors' own memory if they lie back to back in expert
    order in one storage, else None."""
    if not tensors or not uniform_dense(tensors):
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    step = first.numel()
    for e, t in enumerate(tensors):
        if t.untyped_storage().data_ptr() != storage.data_ptr() or \
                t.storage_offset() != first.storage_offset() + e * step:
            return None
    out = first.new_empty(0)
    out.set_(storage, first.storage_offset(), (len(tensors), *first.shape),
             (step, *first.stride()))
    return out
