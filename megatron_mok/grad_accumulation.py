"""Weight gradients added into caller-owned buffers instead of returned: Megatron's
gradient-accumulation fusion (`param.main_grad`, usually fp32), for the experts' weights.

Without it the pass returns dw1 / dw2 in the weights' dtype and Megatron's DDP hook adds
each expert's gradient into its main_grad: a bf16 rounding before the fp32 accumulation,
a second pass over the gradient bytes and one add launch per expert and weight. With an
ExpertGradAccumulator the backward adds the fp32 weight gradient itself:

- where the fp32 buffers lie in one storage at equal distances (a multiple of 16 bytes),
  in expert order or backwards, the grouped wgrad adds into them in its epilogue (TMA
  reduce-add: one add per element, deterministic). Megatron's grad buffer holds
  parameters backwards: a TEGroupedMLP's experts back to back, a SequentialMLP's fc1 and
  fc2 interleaved. A bucket's padding between two experts, or a folded shared expert
  whose main_grad lies in the dense buffer, splits them into a few such runs: one
  launch per run (up to MAX_RUNS);
- otherwise (not fp32, misaligned) it computes the fp32 gradient and adds it with one
  multi-tensor add.

The pass then returns an uninitialized placeholder for the weight's gradient, as
Megatron's own fused layers do, so that the parameters' gradient hooks still run; the
caller's `on_added` marks the parameters (Megatron: `grad_added_to_main_grad`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_mok.stacked import uniform_dense

BUFFER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_RUNS = 8  # wgrad launches per weight before the multi-tensor add is the better deal


class ExpertGradAccumulator:
    """The gradient buffers of one expert weight, one [*shape] tensor per local expert."""

    def __init__(self, buffers: Sequence[torch.Tensor],
                 on_added: Optional[Callable[[], None]] = None, zero_placeholder: bool = False):
        buffers = list(buffers)
        if not buffers or not all(isinstance(b, torch.Tensor) for b in buffers):
            raise TypeError("megatron_mok: ExpertGradAccumulator needs one tensor per expert")
        if not uniform_dense(buffers):
            raise ValueError("megatron_mok: gradient buffers must be dense contiguous tensors "
                             "of one shape, dtype and device")
        if buffers[0].dtype not in BUFFER_DTYPES:
            raise TypeError(f"megatron_mok: gradient buffers must be one of {BUFFER_DTYPES}, "
                            f"got {buffers[0].dtype}")
        self.buffers = buffers
        self.on_added = on_added
        self.zero_placeholder = zero_placeholder  # for callers that add it anyway
        # Runs of buffers one wgrad launch each can add into: (first expert, count, planes
        # [count, *shape] over them, reversed: planes[j] is buffer first + count - 1 - j);
        # None: the fp32 gradient and one multi-tensor add instead.
        self.fused_runs = _equally_spaced_runs(buffers)
        runs = self.fused_runs
        # The whole set in one launch: (planes, reversed), else None.
        self.fused_target = (runs[0][2], runs[0][3]) if runs and len(runs) == 1 else None

    @property
    def shape(self) -> tuple:
        return (len(self.buffers), *self.buffers[0].shape)

    def check(self, weight: torch.Tensor, name: str) -> None:
        """The buffers must match the stacked weight [E, *shape] (before any launch)."""
        if self.shape != tuple(weight.shape) or self.buffers[0].device != weight.device:
            raise ValueError(f"megatron_mok: {name}'s gradient buffers are {list(self.shape)} on "
                             f"{self.buffers[0].device}, the weight {list(weight.shape)} on "
                             f"{weight.device}")

    def add_(self, grad: torch.Tensor) -> None:
        """buffers[e] += grad[e] for every expert (grad [E, *shape], any float dtype)."""
        if tuple(grad.shape) != self.shape:
            raise ValueError(f"megatron_mok: gradient {list(grad.shape)} does not match the "
                             f"buffers {list(self.shape)}")
        torch._foreach_add_(self.buffers, list(grad.unbind(0)))

    def finish(self, weight: torch.Tensor) -> torch.Tensor:
        """After the gradient went into the buffers: tell the caller, and return the
        placeholder the pass hands autograd for `weight` (uninitialized and never read,
        or zeros with zero_placeholder)."""
        if self.on_added is not None:
            self.on_added()
        return torch.zeros_like(weight) if self.zero_placeholder else torch.empty_like(weight)


def _equally_spaced_planes(buffers: Sequence[torch.Tensor]
                           ) -> Optional[tuple[torch.Tensor, bool]]:
    """fp32 buffers at equal distances in one storage (16-byte aligned, not overlapping):
    one [E, *shape] view over them, lowest address first, and whether that order is the
    experts' backwards; else None."""
    first = buffers[0]
    if first.dtype != torch.float32 or first.dim() != 2:  # wgrad's [E, M, N]
        return None
    storage = first.untyped_storage().data_ptr()
    if any(b.untyped_storage().data_ptr() != storage for b in buffers):
        return None
    offsets = [b.storage_offset() for b in buffers]  # in elements
    step = offsets[1] - offsets[0] if len(buffers) > 1 else first.numel()
    if any(o != offsets[0] + e * step for e, o in enumerate(offsets)):
        return None
    reverse = step < 0
    lowest = buffers[-1] if reverse else first
    step = abs(step)
    if step < first.numel() or step * first.element_size() % 16 or lowest.data_ptr() % 16:
        return None
    planes = lowest.as_strided((len(buffers), *first.shape), (step, *first.stride()))
    return planes, reverse


def _equally_spaced_runs(buffers: Sequence[torch.Tensor]) -> Optional[list]:
    """Split the buffers, in expert order, into maximal runs of equally spaced planes:
    [(first, count, planes, reverse)], or None when a buffer cannot be a plane or there
    are more than MAX_RUNS runs."""
    n = len(buffers)
    storages = [b.untyped_storage().data_ptr() for b in buffers]
    offsets = [b.storage_offset() for b in buffers]
    runs, e = [], 0
    while e < n:
        end = e + 1
        if end < n and storages[end] == storages[e]:
            step = offsets[end] - offsets[e]
            while end < n and storages[end] == storages[e] and \
                    offsets[end] - offsets[end - 1] == step:
                end += 1
        run = _equally_spaced_planes(buffers[e:end])
        if run is None and end - e > 1:  # e.g. planes overlapping: take e alone
            end = e + 1
            run = _equally_spaced_planes(buffers[e:end])
        if run is None or len(runs) == MAX_RUNS:
            return None
        runs.append((e, end - e, *run))
        e = end
    return runs
