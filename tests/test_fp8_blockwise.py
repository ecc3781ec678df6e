"""The blockwise FP8 format (Hopper's recipe: 1 x 128 groups, 128 x 128 blocks, FP32 scales)
of megatron_mok.fp8_formats: its scales and error bound, the GEMM contract, bad input."""

import pytest
import torch

from megatron_mok.fp8_formats import (GROUP_SIZE, BlockwiseFP8Tensor, blockwise_matmul_reference,
                                      dequantize_blockwise, quantize_blockwise)


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-group scales must follow them
    mags = torch.exp2(torch.randint(-8, 8, (*shape[:-1], 1), generator=g).float())
    return torch.randn(*shape, generator=g) * mags * scale


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_scales_map_each_group_amax_into_e4m3(block_rows, pow2):
    t = _rand(256, 384)
    q = quantize_blockwise(t, block_rows=block_rows, pow2_scales=pow2)
    groups = t.reshape(256 // block_rows, block_rows, 3, GROUP_SIZE)
    amax = groups.abs().amax(dim=(1, 3))
    assert q.scale.shape == amax.shape and q.data.dtype == torch.float8_e4m3fn
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)  # powers of two
        assert bool((amax / q.scale <= 448).all()) and bool((amax / q.scale > 224).all())
    else:
        torch.testing.assert_close(q.scale, amax / 448)
    # the group's largest element lands at (or, with pow2, within 2x of) E4M3's max
    top = q.data.float().abs().reshape(groups.shape).amax(dim=(1, 3))
    assert bool((top <= 448).all()) and bool((top >= (224 if pow2 else 440)).all())


@pytest.mark.parametrize("block_rows", [1, 128])
def test_round_trip_error_bound(block_rows):
    """E4M3 keeps 3 mantissa bits: |x - dq(q(x))| <= 2^-4 |x| in the normal range, plus
    half the smallest subnormal step (2^-10 of the scale) below it."""
    t = _rand(256, 256, seed=1)
    q = quantize_blockwise(t, block_rows=block_rows)
    back = dequantize_blockwise(q)
    scale = q.scale.repeat_interleave(block_rows, 0).repeat_interleave(GROUP_SIZE, 1)
    bound = torch.maximum(t.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-6)
    assert bool(((back - t).abs() <= bound).all())
    assert (back - t).abs().max() > 0  # random values are not all E4M3-representable


def test_exact_for_representable_values():
    """Values that are E4M3 numbers times a power-of-two group scale come back exactly."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-448, 449, (128, 256), generator=g).float().to(torch.float8_e4m3fn)
    t = codes.float() * 2.0 ** -3
    t[:, ::GROUP_SIZE] = 448 * 2.0 ** -3  # each group's amax: scale 2^-3 exactly
    q = quantize_blockwise(t, pow2_scales=True)
    assert torch.equal(dequantize_blockwise(q), t)


def test_zero_group_and_3d_experts():
    t = _rand(4, 128, 256, seed=3)
    t[1, :, :128] = 0
    q = quantize_blockwise(t, block_rows=128)
    assert q.scale.shape == (4, 1, 2) and q.scale[1, 0, 0] == 1
    assert torch.equal(dequantize_blockwise(q)[1, :, :128], torch.zeros(128, 128))
    per_expert = [quantize_blockwise(t[e], block_rows=128) for e in range(4)]
    for e in range(4):
        assert torch.equal(q.data[e].float(), per_expert[e].data.float())


def test_matmul_contract_is_dequantise_then_fp32_gemm():
    a, b = _rand(64, 512, seed=4), _rand(256, 512, seed=5)
    a_q, b_q = quantize_blockwise(a), quantize_blockwise(b, block_rows=128)
    out = blockwise_matmul_reference(a_q, b_q)
    want = a_q.dequantize().double() @ b_q.dequantize().double().t()
    assert float((out.double() - want).norm() / want.norm()) < 1e-6  # fp32 rounding only
    rel = float((out.double() - a.double() @ b.double().t()).norm() / (a @ b.t()).norm())
    assert 1e-4 < rel < 5e-2  # FP8's error against the unquantised product: a few %


@pytest.mark.parametrize("shape, block_rows, match", [
    ((64, 100), 1, "K to be a multiple of 128"),
    ((100, 128), 128, "R"),
    ((128,), 1, "2-D"),
])
def test_bad_shapes(shape, block_rows, match):
    with pytest.raises(ValueError, match=match):
        quantize_blockwise(torch.randn(*shape), block_rows=block_rows)


def test_bad_inputs():
    with pytest.raises(TypeError):
        quantize_blockwise(torch.ones(128, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="finite"):
        quantize_blockwise(torch.full((128, 128), float("inf")))
    with pytest.raises(ValueError, match="block_rows"):
        quantize_blockwise(torch.randn(128, 128), block_rows=32)
    q = quantize_blockwise(torch.randn(128, 128))
    with pytest.raises(ValueError, match="scale must have shape"):
        BlockwiseFP8Tensor(q.data, q.scale[:, :0], 1)
    with pytest.raises(ValueError, match="share K"):
        blockwise_matmul_reference(q, quantize_blockwise(torch.randn(128, 256)))
