"""Fp8WeightCache: the FP8 expert weights quantised once per optimizer step. The caching
rules, on the CPU (the quantiser replaced by a counting one); test_fp8_layer_gpu shows a
pass that reuses them gives the bits of one that quantises."""

import pytest
import torch

from megatron_mok.kernels import fp8_gemm
from megatron_mok.kernels.fp8_weight_cache import Fp8WeightCache, advance_step


@pytest.fixture
def counted(monkeypatch):
    seen = []

    def quantize(w):
        seen.append(w.clone())
        return ("fp8", w.clone())

    monkeypatch.setattr(fp8_gemm, "quantize_weights", quantize)
    return seen


def _weights():
    return torch.randn(2, 256, 128), torch.randn(2, 128, 128)


def test_reuse_within_a_step_and_requantise_after_it(counted):
    w1, w2 = _weights()
    cache = Fp8WeightCache(reuse=True)
    first = cache.weights(w1, w2)
    assert cache.weights(w1, w2) is first and len(counted) == 2  # one quantisation
    advance_step()  # the optimizer is about to update the weights
    with torch.no_grad():
        w1.add_(1.0)
    second = cache.weights(w1, w2)
    assert second is not first and cache.quantisations == 2
    assert torch.equal(second[0][1], w1)


def test_advance_step_frees_the_entries(counted):
    cache = Fp8WeightCache(reuse=True)
    cache.weights(*_weights())
    assert cache._value is not None
    advance_step()
    assert cache._value is None


def test_other_tensors_or_an_in_place_update_are_quantised_again(counted):
    w1, w2 = _weights()
    cache = Fp8WeightCache(reuse=True)
    first = cache.weights(w1, w2)
    other = cache.weights(w1.clone(), w2)  # other storage, same step
    assert other is not first
    w1_again = cache.weights(w1, w2)
    with torch.no_grad():
        w1.mul_(2.0)  # an in-place update the version counter sees
    updated = cache.weights(w1, w2)
    assert updated is not w1_again and torch.equal(updated[0][1], w1)
    assert cache.quantisations == 4


def test_without_reuse_every_call_quantises_and_nothing_is_kept(counted):
    w1, w2 = _weights()
    cache = Fp8WeightCache()
    a, b = cache.weights(w1, w2), cache.weights(w1, w2)
    assert a is not b and cache.quantisations == 2 and cache._value is None


def test_fused_moe_rejects_another_cache_type():
    from megatron_mok.config import MoKConfig
    from megatron_mok.functional import fused_moe

    x = torch.randn(8, 128, dtype=torch.bfloat16)
    idx = torch.randint(0, 2, (8, 1))
    w = torch.rand(8, 1)
    w1 = torch.randn(2, 256, 128, dtype=torch.bfloat16)
    w2 = torch.randn(2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_cache must be an Fp8WeightCache"):
        fused_moe(x, idx, w, w1, w2, config=MoKConfig(fp8="blockwise"), fp8_cache={})
