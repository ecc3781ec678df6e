"""Tests for megatron_mok.fp8_formats (MXFP8 quantise / dequantise, reference GEMM).

Error bound used throughout (derived in the module docstring): with block scale
s = 2^e and y = x / s, E4M3 keeps 3 mantissa bits, so round-to-nearest-even is
off by at most half an ulp:
  * normal range |y| in [2^-6, 448]: ulp = 2^(E-3) with 2^E <= |y|, so the error
    is <= 2^(E-4) <= 2^-4 * |y|          (relative error <= 2^-4);
  * subnormal range |y| < 2^-6: ulp = 2^-9, error <= 2^-10 (in units of s).
Multiplying by s is exact, so per element
    |x - deq| <= max(2^-4 * |x|, 2^-10 * s).
(The looser "scale * 2^-9" absolute bound for the subnormal range also holds.)
"""

from __future__ import annotations

import pytest
import torch

from megatron_mok.fp8_formats import (
    BLOCK_SIZE,
    E4M3_MAX,
    E8M0_BIAS,
    MXFP8Tensor,
    dequantize_mxfp8,
    mxfp8_matmul_reference,
    quantize_mxfp8,
    quantize_mxfp8_both,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
REL_BOUND = 2.0 ** -4
SUB_BOUND = 2.0 ** -10


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _e4m3_values() -> torch.Tensor:
    """All finite, non-zero E4M3 values (float64), positive and negative."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return v[torch.isfinite(v) & (v != 0)]


# exact 2^(byte - 127) for every E8M0 byte (Python powers of two are exact; device
# exp2/log2 need not be, e.g. on CUDA)
_E8M0_TABLE = torch.tensor([2.0 ** (b - E8M0_BIAS) for b in range(255)] + [float("nan")],
                           dtype=torch.float64)


def _scales64(q: MXFP8Tensor) -> torch.Tensor:
    """Per-block scale 2^e (float64), [..., R, K/32]."""
    return _E8M0_TABLE.to(q.scale.device)[q.scale.long()]


def _block_scales(q: MXFP8Tensor) -> torch.Tensor:
    """Per-element block scale 2^e (float64), in the stored layout."""
    return _scales64(q).repeat_interleave(BLOCK_SIZE, dim=-1)


def _check_bound(x: torch.Tensor, q: MXFP8Tensor) -> None:
    """x is the source in the stored orientation; asserts the per-element bound."""
    x64 = x.to(torch.float64)
    deq = q.dequantize(torch.float64)
    err = (x64 - deq).abs()
    bound = torch.maximum(REL_BOUND * x64.abs(), SUB_BOUND * _block_scales(q))
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} elements break the bound; worst excess "
        f"{(err - bound).max().item():.3e}")


def _check_scale_minimal(x: torch.Tensor, q: MXFP8Tensor) -> None:
    """amax / s <= 448 (no overflow) and > 224 (the smallest such power of two)."""
    x64 = x.to(torch.float64)
    *lead, k = x64.shape
    amax = x64.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1)
    r = amax / _scales64(q)
    assert (r <= E4M3_MAX).all()
    nz = amax > 0
    assert (r[nz] > E4M3_MAX / 2).all()


def _check_data_sane(q: MXFP8Tensor) -> None:
    d = q.data.to(torch.float32)
    assert torch.isfinite(d).all()
    assert d.abs().max() <= E4M3_MAX
    assert (q.scale != 255).all()  # 0xFF is E8M0 NaN
    assert q.data.is_contiguous() and q.scale.is_contiguous()


def _random_tensor(shape, seed, device="cpu", exp_range=(-30, 30), dtype=torch.float32):
    """randn with a random power-of-two magnitude per row-block, plus a wide spread
    inside each block (so that some elements fall in E4M3's subnormal range)."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    # per-element spread inside blocks: 2^[-14, 0]
    x = x * torch.exp2(torch.randint(-14, 1, shape, generator=g).to(torch.float64))
    # per-row magnitude
    row_shape = tuple(shape[:-1]) + (1,)
    x = x * torch.exp2(torch.randint(exp_range[0], exp_range[1] + 1, row_shape,
                                     generator=g).to(torch.float64))
    return x.to(dtype).to(device)


def _representable_tensor(shape, seed, device="cpu"):
    """Blocks (along the last dim) of random E4M3 values times a per-block 2^k; the
    first block of every row has amax exactly 448 * 2^k."""
    g = _gen(seed)
    vals = _e4m3_values()
    *lead, n = shape
    nb = n // BLOCK_SIZE
    idx = torch.randint(0, vals.numel(), tuple(shape), generator=g)
    m = vals[idx].reshape(*lead, nb, BLOCK_SIZE)
    m[..., 0, 0] = E4M3_MAX * torch.where(
        torch.rand(tuple(lead), generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    k = torch.randint(-20, 21, (*lead, nb, 1), generator=g)
    x = (m * _E8M0_TABLE[k.long() + E8M0_BIAS]).reshape(shape)
    return x.to(torch.float32).to(device)


# --------------------------------------------------------------------------- #
# round trip
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(64, 256), (3, 96, 128)])
def test_exact_round_trip_for_representable_values(device, shape):
    x = _representable_tensor(shape, seed=1, device=device)
    q = quantize_mxfp8(x)
    assert q.data.shape == x.shape and not q.transposed
    assert q.scale.shape == (*shape[:-1], shape[-1] // BLOCK_SIZE)
    assert torch.equal(q.dequantize(), x)
    assert torch.equal(dequantize_mxfp8(q), x)
    # the block with amax exactly 448 * 2^k has scale exactly 2^k and data +-448
    first = x[..., :BLOCK_SIZE]
    mant, p = torch.frexp(first.abs().amax(-1).double() / E4M3_MAX)
    assert (mant == 0.5).all()  # amax / 448 is exactly 2^k, k = p - 1
    assert torch.equal(q.scale[..., 0].long() - E8M0_BIAS, p.long() - 1)
    assert (q.data[..., 0].float().abs() == E4M3_MAX).all()
    _check_data_sane(q)


@pytest.mark.parametrize("device", DEVICES)
def test_exact_round_trip_transposed(device):
    x = _representable_tensor((128, 64), seed=2, device=device).t().contiguous()
    # x is [64, 128] with blocks along dim -2 representable
    q = quantize_mxfp8(x, transposed=True)
    assert q.transposed and q.data.shape == (128, 64)
    assert torch.equal(q.dequantize(), x.t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_error_bound(device, dtype):
    exp_range = (-30, 30) if dtype != torch.float16 else (-2, 2)
    x = _random_tensor((96, 512), seed=3, device=device, exp_range=exp_range, dtype=dtype)
    q = quantize_mxfp8(x)
    _check_data_sane(q)
    _check_bound(x, q)
    _check_scale_minimal(x, q)
    # the bound is not vacuous: the worst relative error on normal-range elements
    # gets close to 2^-4, and some elements do sit in the subnormal range
    y = x.double().abs() / _block_scales(q)
    normal = y >= 2.0 ** -6
    rel = ((x.double() - q.dequantize(torch.float64)).abs() / x.double().abs())[normal]
    assert rel.max() > 0.5 * REL_BOUND
    assert (~normal).any()


def test_scale_matches_log2_formula():
    x = _random_tensor((64, 1024), seed=4)
    q = quantize_mxfp8(x)
    amax = x.double().reshape(64, -1, BLOCK_SIZE).abs().amax(-1)
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-127, 127)
    assert torch.equal(q.scale.to(torch.float64) - E8M0_BIAS, e)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dequantize_dtype(out_dtype):
    x = _random_tensor((32, 64), seed=5)
    q = quantize_mxfp8(x)
    d = q.dequantize(out_dtype)
    assert d.dtype == out_dtype
    assert torch.equal(d, q.dequantize(torch.float64).to(out_dtype))


# --------------------------------------------------------------------------- #
# overflow edge cases
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
def test_no_overflow_at_amax_edges(device):
    g = _gen(6)
    rows = []
    expected_e = []
    expected_top = []
    for k in (-20, -3, 0, 5, 30):
        base = torch.rand(BLOCK_SIZE, generator=g, dtype=torch.float64) * 200 + 1
        sgn = torch.where(torch.rand(BLOCK_SIZE, generator=g) < 0.5, -1.0, 1.0).double()
        # amax / scale lands exactly on 448
        r = base.clone(); r[7] = E4M3_MAX
        rows.append(sgn * r * 2.0 ** k); expected_e.append(k); expected_top.append(448.0)
        # amax just above 448 * 2^k: next scale up, top element ~224
        r = base.clone(); r[3] = E4M3_MAX * (1 + 2.0 ** -20)
        rows.append(sgn * r * 2.0 ** k); expected_e.append(k + 1); expected_top.append(224.0)
        # amax just below 448 * 2^k: same scale, rounds to 448 (not past it)
        r = base.clone(); r[11] = E4M3_MAX * (1 - 2.0 ** -20)
        rows.append(sgn * r * 2.0 ** k); expected_e.append(k); expected_top.append(448.0)
        # amax just above a plain power of two (2^(k+8) = 256 * 2^k)
        r = base.clone(); r[0] = 256 * (1 + 2.0 ** -20)
        rows.append(sgn * r * 2.0 ** k); expected_e.append(k); expected_top.append(256.0)
        # amax in (448, 512) * 2^k: rounding would overflow at scale 2^k
        r = base.clone(); r[5] = 470.0
        rows.append(sgn * r * 2.0 ** k); expected_e.append(k + 1); expected_top.append(240.0)
    x = torch.stack(rows).to(torch.float32).to(device)
    q = quantize_mxfp8(x)
    _check_data_sane(q)
    _check_bound(x, q)
    _check_scale_minimal(x, q)
    assert (q.scale[:, 0].long() - E8M0_BIAS).tolist() == expected_e
    assert q.data.float().abs().amax(-1).tolist() == expected_top


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_magnitudes(device):
    # near the fp32 range limits; exponents stay within [-127, 127]
    g = _gen(7)
    x = torch.randn(4, 64, generator=g)
    x[0] *= 1e38 / x[0].abs().max()
    x[1] *= 1e-38 / x[1].abs().max()
    x[2] *= 1e-44  # fp32 subnormals (amax below 448 * 2^-127 -> clamped to 2^-127)
    x = x.to(device)
    q = quantize_mxfp8(x)
    _check_data_sane(q)
    _check_bound(x, q)
    assert q.scale[2].tolist() == [0, 0]
    assert q.scale[0].max() <= 254


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_block(device):
    x = _random_tensor((4, 128), seed=8, device=device)
    x[1, 32:64] = 0
    x[3] = 0
    q = quantize_mxfp8(x)
    _check_data_sane(q)
    assert q.scale[1, 1].item() == 0 and (q.scale[3] == 0).all()
    d = q.dequantize()
    assert not torch.isnan(d).any()
    assert (d[1, 32:64] == 0).all() and (d[3] == 0).all()
    _check_bound(x, q)
    # transposed as well
    qt = quantize_mxfp8(torch.zeros(64, 32, device=device), transposed=True)
    assert (qt.scale == 0).all() and (qt.dequantize() == 0).all()


# --------------------------------------------------------------------------- #
# orientations, 3-D
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
def test_both_orientations(device):
    x = _random_tensor((96, 160), seed=9, device=device)
    normal, trans = quantize_mxfp8_both(x)
    assert not normal.transposed and trans.transposed
    assert normal.data.shape == (96, 160) and normal.scale.shape == (96, 5)
    assert trans.data.shape == (160, 96) and trans.scale.shape == (160, 3)
    assert trans.data.is_contiguous() and trans.scale.is_contiguous()
    _check_bound(x, normal)
    _check_bound(x.t(), trans)            # transposed copy ~ transpose of the original
    _check_scale_minimal(x.t(), trans)
    # identical to quantising the materialised transpose, and to the keyword form
    ref = quantize_mxfp8(x.t().contiguous())
    assert torch.equal(trans.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(trans.scale, ref.scale)
    kw = quantize_mxfp8(x, transposed=True)
    assert torch.equal(kw.data.view(torch.uint8), trans.data.view(torch.uint8))
    assert torch.equal(normal.data.view(torch.uint8), quantize_mxfp8(x).data.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_3d_per_expert(device):
    e, m, n = 4, 64, 96
    x = _random_tensor((e, m, n), seed=10, device=device)
    x = x * torch.exp2(torch.tensor([-10.0, 0.0, 7.0, 20.0], device=device)).view(e, 1, 1)
    normal, trans = quantize_mxfp8_both(x)
    assert normal.data.shape == (e, m, n) and normal.scale.shape == (e, m, n // 32)
    assert trans.data.shape == (e, n, m) and trans.scale.shape == (e, n, m // 32)
    _check_bound(x, normal)
    _check_bound(x.transpose(1, 2), trans)
    for i in range(e):  # per expert == the 2-D quantisation of that expert
        q2n = quantize_mxfp8(x[i])
        q2t = quantize_mxfp8(x[i], transposed=True)
        assert torch.equal(normal.data[i].view(torch.uint8), q2n.data.view(torch.uint8))
        assert torch.equal(normal.scale[i], q2n.scale)
        assert torch.equal(trans.data[i].view(torch.uint8), q2t.data.view(torch.uint8))
        assert torch.equal(trans.scale[i], q2t.scale)


# --------------------------------------------------------------------------- #
# reference GEMM
# --------------------------------------------------------------------------- #
def _gemm_tol(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # fp32 accumulation of K exact products: |err| <= K * 2^-24 * sum_k |a||b|
    k = a.shape[-1]
    return k * 2.0 ** -23 * torch.matmul(a.abs(), b.abs().transpose(-1, -2)) + 1e-30


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_reference(device):
    a = _random_tensor((48, 256), seed=11, device=device, exp_range=(-4, 4))
    w = _random_tensor((80, 256), seed=12, device=device, exp_range=(-4, 4))
    aq, wq = quantize_mxfp8(a), quantize_mxfp8(w)
    out = mxfp8_matmul_reference(aq, wq)
    assert out.dtype == torch.float32 and out.shape == (48, 80)
    ad, wd = aq.dequantize(torch.float64), wq.dequantize(torch.float64)
    exact = ad @ wd.t()
    assert ((out.double() - exact).abs() <= _gemm_tol(ad, wd)).all()
    # a weight stored [K, N] goes in through its transposed copy
    wq_t = quantize_mxfp8(w.t().contiguous(), transposed=True)
    out_t = mxfp8_matmul_reference(aq, wq_t)
    wtd = wq_t.dequantize(torch.float64)
    assert ((out_t.double() - ad @ wtd.t()).abs() <= _gemm_tol(ad, wtd)).all()
    # and the result approximates the unquantised product
    full = a.double() @ w.double().t()
    rel = (out.double() - full).norm() / full.norm()
    assert rel < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_reference_batched(device):
    a = _random_tensor((3, 16, 64), seed=13, device=device, exp_range=(-3, 3))
    w = _random_tensor((3, 32, 64), seed=14, device=device, exp_range=(-3, 3))
    aq, wq = quantize_mxfp8(a), quantize_mxfp8(w)
    out = mxfp8_matmul_reference(aq, wq)
    assert out.shape == (3, 16, 32)
    ad, wd = aq.dequantize(torch.float64), wq.dequantize(torch.float64)
    assert ((out.double() - ad @ wd.transpose(1, 2)).abs() <= _gemm_tol(ad, wd)).all()


def test_matmul_reference_shape_errors():
    aq = quantize_mxfp8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="K"):
        mxfp8_matmul_reference(aq, quantize_mxfp8(torch.randn(8, 96)))
    with pytest.raises(ValueError, match="rank"):
        mxfp8_matmul_reference(aq, quantize_mxfp8(torch.randn(2, 8, 64)))
    with pytest.raises(TypeError, match="b_q"):
        mxfp8_matmul_reference(aq, torch.randn(8, 64))


# --------------------------------------------------------------------------- #
# bad inputs
# --------------------------------------------------------------------------- #
def test_bad_inputs():
    with pytest.raises(TypeError, match=r"\bt\b"):
        quantize_mxfp8(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"\bt\b"):
        quantize_mxfp8([[1.0] * 32])
    with pytest.raises(TypeError, match=r"\bt\b"):
        quantize_mxfp8_both(torch.ones(32, 32, dtype=torch.complex64))
    for bad_rank in [(64,), (2, 2, 4, 32)]:
        with pytest.raises(ValueError, match="2-D"):
            quantize_mxfp8(torch.randn(bad_rank))
    with pytest.raises(ValueError, match=r"multiple of 32"):
        quantize_mxfp8(torch.randn(32, 48))
    with pytest.raises(ValueError, match=r"multiple of 32"):
        quantize_mxfp8(torch.randn(48, 32), transposed=True)
    with pytest.raises(ValueError, match=r"multiple of 32"):
        quantize_mxfp8_both(torch.randn(48, 32))
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = torch.randn(4, 32)
        x[2, 5] = bad
        with pytest.raises(ValueError, match="finite"):
            quantize_mxfp8(x)
        with pytest.raises(ValueError, match="finite"):
            quantize_mxfp8_both(torch.randn(32, 32).index_put_((torch.tensor([0]),), torch.tensor(bad)))
    # the blocked dim of the *other* orientation may be anything
    quantize_mxfp8(torch.randn(48, 32))
    quantize_mxfp8(torch.randn(32, 48), transposed=True)


def test_container_validation():
    data = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale"):
        MXFP8Tensor(data=data, scale=torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scale"):
        MXFP8Tensor(data=data, scale=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="data"):
        MXFP8Tensor(data=data.float(), scale=torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="q"):
        dequantize_mxfp8(data)
