"""The FP8 expert weights, quantised once per optimizer step (docs/fp8.md).

The recipe quantises the weights once per step and reuses them across the step's
micro-batches (and an activation recompute): both layouts, 128 x 128 blocks
(fp8_gemm.quantize_weights). A cache is only as good as its invalidation, and the
weights' own version counters do not see every update (Megatron's optimizer writes
parameters through `.data` and its parameter all-gather straight into their buffer), so
reuse is opt-in: `advance_step()` must run between a step's last backward and the
optimizer's update. MokMoELayer installs it in Megatron's finalize_model_grads_func
(which runs right there every step); without that hook (the functional API, a training
loop of one's own) every pass quantises its weights.

    cache = Fp8WeightCache(reuse=True)
    w1_fp8, w2_fp8 = cache.weights(w1, w2)
    ...backward of the step's last micro-batch...
    advance_step()          # the next pass quantises again
"""

from __future__ import annotations

import weakref
from typing import Tuple

import torch

from megatron_mok.kernels import fp8_gemm

_step = 0
_caches: "weakref.WeakSet[Fp8WeightCache]" = weakref.WeakSet()


def advance_step() -> None:
    """The weights are about to change (the optimizer's step): every cache's entry is
    stale. Frees them, so the step's update does not run beside FP8 copies of the weights."""
    global _step
    _step += 1
    for cache in list(_caches):
        cache.clear()


def current_step() -> int:
    return _step


class Fp8WeightCache:
    """One layer's FP8 weights (w1's, w2's Fp8Weight) for the current step. reuse: keep
    them for the step's later passes (only where advance_step() runs every step)."""

    def __init__(self, reuse: bool = False):
        self.reuse = reuse
        self._key = None
        self._value = None
        self.quantisations = 0  # how many times weights() quantised (tests, benchmarks)
        _caches.add(self)

    def clear(self) -> None:
        self._key = self._value = None

    def weights(self, w1: torch.Tensor, w2: torch.Tensor
                ) -> Tuple[fp8_gemm.Fp8Weight, fp8_gemm.Fp8Weight]:
        """(w1's, w2's) Fp8Weight: with reuse, the entry quantised earlier in this step for
        the same tensors; else (or at the step's first pass) quantised now."""
        reuse = self.reuse
        # The step decides; storage, shape and version counters guard against a caller
        # passing other weights (or updating these in place) within one step.
        key = (_step,) + tuple((w.data_ptr(), tuple(w.shape), w.dtype, w.device, w._version)
                               for w in (w1, w2))
        if reuse and self._key == key:
            return self._value
        value = (fp8_gemm.quantize_weights(w1.contiguous()),
                 fp8_gemm.quantize_weights(w2.contiguous()))
        self.quantisations += 1
        self._key, self._value = (key, value) if reuse else (None, None)
        return value
