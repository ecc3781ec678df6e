"""The FP8 formats of the spec, quantise / dequantise in pure PyTorch (CPU and CUDA).

Two recipes, both with E4M3 elements (``torch.float8_e4m3fn``, max finite 448):

* **Blockwise** (Hopper's recipe: DeepSeek-V3's, Transformer Engine's
  ``Float8BlockScaling``, Megatron's ``--fp8-recipe blockwise``): activations and
  gradients in groups of 1 x 128 along the GEMM's K, weights in 128 x 128 blocks, one FP32
  scale per group or block (``amax / 448``, or with ``pow2_scales`` the power of two
  ``2^ceil(log2(amax / 448))``). The GEMM contract: dequantise, multiply with fp32
  accumulation (the kernels promote the FP8 WGMMA accumulators to fp32 every 128 of K and
  apply the scales there, equal up to fp32 rounding). See "Blockwise" below.
* **MXFP8** (MoK's Blackwell format; Hopper has no hardware path for it): blocks of 32
  along K with E8M0 power-of-two scales. Kept as the future Blackwell backend's numerics;
  nothing runs it on Hopper. Described next.

MXFP8 format (OCP microscaling, MXFP8 with E4M3 elements):

* A tensor is cut into blocks of ``BLOCK_SIZE = 32`` consecutive elements along
  the GEMM's K dimension, which is always the *last* dimension of the stored
  data.
* Each element is stored as ``torch.float8_e4m3fn`` (max finite 448, 3 mantissa
  bits, subnormals down to 2^-9).
* Each block has one E8M0 scale, a pure power of two ``2^e`` stored as a uint8
  with bias 127 (``byte = e + 127``).  ``e = ceil(log2(amax / 448))`` where
  ``amax`` is the block's largest magnitude, clamped to ``[-127, 127]``, so the
  byte is in ``[0, 254]`` (255 is E8M0's NaN and is never produced).  Rounding
  the exponent *up* guarantees ``amax / 2^e <= 448``: no element overflows.
  An all-zero block gets the smallest scale (``e = -127``, byte 0), no NaN.

Stored value of element ``x``: ``data = rne_e4m3(x / 2^e)``, and
``dequantize`` returns ``data * 2^e``.

Layouts
-------
* Tensors are 2-D ``[M, N]`` or 3-D ``[E, M, N]`` (per-expert weights).
* ``transposed=False`` (normal): blocks along the last dim ``N``;
  ``data`` is ``[..., M, N]``, ``scale`` is ``[..., M, N / 32]``.
* ``transposed=True``: the transpose is quantised, i.e. blocks run along the
  original second-to-last dim ``M``; ``data`` is the contiguous
  ``[..., N, M]`` tensor and ``scale`` is ``[..., N, M / 32]``.
* Scales are plain row-major (one byte per block, the blocks of a row next to
  each other).  A swizzled kernel layout is a later addition.

Error bound (per element, ``s = 2^e`` the block scale, ``y = x / s``): E4M3
has 3 stored mantissa bits, so for ``|y|`` in the normal range ``[2^-6, 448]``
round-to-nearest-even is off by at most half an ulp, ``2^(E-4) <= 2^-4 * |y|``
(``2^E <= |y|``); in the subnormal range ``|y| < 2^-6`` the ulp is ``2^-9`` and
the error is at most ``2^-10``.  Scaling by a power of two is exact, hence::

    |x - dequantize(quantize(x))| <= max(2^-4 * |x|, 2^-10 * s)

(exact whenever ``y`` is already E4M3-representable).  Scale arithmetic is
done by building the powers of two from their bits, so it is exact; inputs
are processed in fp32 (fp64 inputs in fp64).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "E8M0_BIAS",
    "MXFP8Tensor",
    "quantize_mxfp8",
    "quantize_mxfp8_both",
    "dequantize_mxfp8",
    "mxfp8_matmul_reference",
    "GROUP_SIZE",
    "BlockwiseFP8Tensor",
    "quantize_blockwise",
    "dequantize_blockwise",
    "blockwise_matmul_reference",
]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127
_EXP_MIN = -127
_EXP_MAX = 127
# 448 = 0.875 * 2^9 (frexp form: mantissa in [0.5, 1)).
_E4M3_MAX_FREXP_MANTISSA = 0.875
_E4M3_MAX_FREXP_EXP = 9


# --------------------------------------------------------------------------- #
# Container
# --------------------------------------------------------------------------- #
@dataclass
class MXFP8Tensor:
    """An MXFP8-quantised tensor.

    Attributes:
        data: ``torch.float8_e4m3fn``, ``[..., R, K]``, blocked along the last
            dim ``K`` (``K % 32 == 0``).  Contiguous.
        scale: ``torch.uint8`` E8M0 biased exponents, ``[..., R, K / 32]``.
        transposed: ``False`` if ``data`` has the source tensor's shape
            (blocks along its last dim); ``True`` if ``data`` is the quantised
            *transpose* of the source (``data`` is ``[..., N, M]`` for an
            ``[..., M, N]`` source, blocks along the source's dim ``-2``).

    ``dequantize()`` returns ``data * 2^(scale - 127)`` in the *stored*
    orientation, i.e. for ``transposed=True`` it returns (an approximation of)
    the source's transpose, ``[..., N, M]``; it never transposes back.
    """

    data: torch.Tensor
    scale: torch.Tensor
    transposed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float8_e4m3fn:
            raise TypeError("MXFP8Tensor.data must be a torch.float8_e4m3fn tensor")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.uint8:
            raise TypeError("MXFP8Tensor.scale must be a torch.uint8 tensor")
        if self.data.dim() not in (2, 3):
            raise ValueError(
                f"MXFP8Tensor.data must be 2-D or 3-D, got shape {tuple(self.data.shape)}")
        k = self.data.shape[-1]
        if k % BLOCK_SIZE != 0:
            raise ValueError(
                f"MXFP8Tensor.data's last dim must be a multiple of {BLOCK_SIZE}, got {k}")
        want = tuple(self.data.shape[:-1]) + (k // BLOCK_SIZE,)
        if tuple(self.scale.shape) != want:
            raise ValueError(
                f"MXFP8Tensor.scale must have shape {want} for data of shape "
                f"{tuple(self.data.shape)}, got {tuple(self.scale.shape)}")
        if self.scale.device != self.data.device:
            raise ValueError("MXFP8Tensor.data and .scale must be on the same device")

    @property
    def shape(self) -> torch.Size:
        """Shape of the stored data (the transposed shape if ``transposed``)."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def scale_exponent(self) -> torch.Tensor:
        """The unbiased block exponents ``e`` (int32), ``scale == 2^e``."""
        return self.scale.to(torch.int32) - E8M0_BIAS

    def scale_float(self) -> torch.Tensor:
        """The block scales ``2^e`` as exact fp32 values, ``[..., R, K / 32]``."""
        return _pow2_f32(self.scale_exponent())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` in the stored orientation (see the class docstring)."""
        return dequantize_mxfp8(self, dtype)


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def _pow2_f32(exp: torch.Tensor) -> torch.Tensor:
    """Exact ``2^exp`` in fp32 for integer ``exp`` in ``[-127, 127]``, from the bits.

    For ``exp >= -126`` the fp32 bit pattern is ``(exp + 127) << 23``; ``2^-127``
    is the fp32 subnormal ``0x00400000``.
    """
    exp = exp.to(torch.int32)
    normal = torch.bitwise_left_shift(exp.clamp(min=-126) + 127, 23).view(torch.float32)
    tiny = torch.full_like(normal, 2.0 ** -127)
    return torch.where(exp >= -126, normal, tiny)


def _check_input(t: object, name: str, transposed: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be 2-D [M, N] or 3-D [E, M, N], got shape {tuple(t.shape)}")
    dim = -2 if transposed else -1
    size = t.shape[dim]
    if size % BLOCK_SIZE != 0:
        which = "second-to-last" if transposed else "last"
        raise ValueError(
            f"{name}'s blocked ({which}) dim must be a multiple of {BLOCK_SIZE}, "
            f"got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must contain only finite values (found inf or nan)")


def _block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``clamp(ceil(log2(amax / 448)), -127, 127)`` exactly, via frexp (int32).

    With ``amax = m * 2^p`` (``m`` in ``[0.5, 1)``) and ``448 = 0.875 * 2^9``:
    ``amax / 448 = (m / 0.875) * 2^(p - 9)`` and ``m / 0.875`` is in
    ``(0.57, 1]`` if ``m <= 0.875`` (ceil of log2 is 0) else in ``(1, 1.15)``
    (ceil of log2 is 1).  Zero gives ``p = 0`` but is clamped to -127 below.
    """
    mant, exp = torch.frexp(amax)
    e = exp.to(torch.int32) - _E4M3_MAX_FREXP_EXP + (mant > _E4M3_MAX_FREXP_MANTISSA).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, _EXP_MIN))
    return e.clamp(_EXP_MIN, _EXP_MAX)


def _quantize_last_dim(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise along the last dim of a 2-D/3-D floating tensor (already validated)."""
    work_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.to(work_dtype).contiguous()
    *lead, k = x.shape
    blocks = x.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)                          # [..., R, K/32]
    e = _block_exponent(amax)
    inv_scale = _pow2_f32(-e).to(work_dtype)                  # exact 2^-e
    y = blocks * inv_scale.unsqueeze(-1)                      # exact (power of two)
    # |y| <= 448 by construction; the clamp only matters when e hit +127
    # (fp64 inputs beyond 448 * 2^127), where values saturate instead of NaN.
    y = y.clamp(-E4M3_MAX, E4M3_MAX)
    data = y.reshape(*lead, k).to(torch.float8_e4m3fn).contiguous()
    scale = (e + E8M0_BIAS).to(torch.uint8).contiguous()
    return data, scale


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #
def quantize_mxfp8(t: torch.Tensor, *, transposed: bool = False) -> MXFP8Tensor:
    """Quantise a 2-D ``[M, N]`` or 3-D ``[E, M, N]`` tensor to MXFP8.

    ``transposed=False``: blocks of 32 along dim -1 (``N % 32 == 0``); the
    result has ``t``'s shape.  ``transposed=True``: quantises
    ``t.transpose(-1, -2)``, i.e. blocks along dim -2 (``M % 32 == 0``); the
    result is the contiguous ``[..., N, M]`` transposed tensor.

    Raises TypeError for a non-tensor / non-floating ``t`` and ValueError for
    a wrong rank, a blocked dim that is not a multiple of 32, or non-finite
    values.
    """
    _check_input(t, "t", transposed)
    src = t.transpose(-1, -2) if transposed else t
    data, scale = _quantize_last_dim(src)
    return MXFP8Tensor(data=data, scale=scale, transposed=bool(transposed))


def quantize_mxfp8_both(t: torch.Tensor) -> Tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both orientations of a weight: ``(normal, transposed)``.

    Needs both ``t.shape[-1]`` and ``t.shape[-2]`` to be multiples of 32.
    """
    _check_input(t, "t", False)
    _check_input(t, "t", True)
    normal = MXFP8Tensor(*_quantize_last_dim(t), transposed=False)
    trans = MXFP8Tensor(*_quantize_last_dim(t.transpose(-1, -2)), transposed=True)
    return normal, trans


def dequantize_mxfp8(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data * 2^(q.scale - 127)`` in the stored orientation, cast to ``dtype``.

    The product is formed exactly (fp32, or fp64 when ``dtype`` is fp64) and
    rounded once to ``dtype``.
    """
    if not isinstance(q, MXFP8Tensor):
        raise TypeError(f"q must be an MXFP8Tensor, got {type(q).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    *lead, k = q.data.shape
    vals = q.data.to(work_dtype).reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = q.scale_float().to(work_dtype).unsqueeze(-1)
    return (vals * scale).reshape(*lead, k).to(dtype)


@contextlib.contextmanager
def _no_tf32() -> Iterator[None]:
    """Keep CUDA fp32 matmuls in full fp32 (no TF32) for the duration."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def mxfp8_matmul_reference(a_q: MXFP8Tensor, b_q: MXFP8Tensor) -> torch.Tensor:
    """The MXFP8 GEMM contract: dequantise, then multiply with fp32 accumulation.

    ``a_q`` is an activation ``[M, K]`` and ``b_q`` a weight ``[N, K]``, both
    blocked along K (for a weight stored ``[K, N]`` use its ``transposed=True``
    copy).  Returns fp32 ``a @ b^T``, ``[M, N]``.  Batched 3-D operands
    ``[E, M, K]`` x ``[E, N, K]`` -> ``[E, M, N]`` are accepted too.
    """
    for name, q in (("a_q", a_q), ("b_q", b_q)):
        if not isinstance(q, MXFP8Tensor):
            raise TypeError(f"{name} must be an MXFP8Tensor, got {type(q).__name__}")
    if a_q.data.dim() != b_q.data.dim():
        raise ValueError(
            f"a_q and b_q must have the same rank, got shapes {tuple(a_q.shape)} "
            f"and {tuple(b_q.shape)}")
    if a_q.shape[-1] != b_q.shape[-1]:
        raise ValueError(
            f"a_q [.., M, K] and b_q [.., N, K] must share K, got shapes "
            f"{tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if a_q.data.dim() == 3 and a_q.shape[0] != b_q.shape[0]:
        raise ValueError(
            f"a_q and b_q must have the same leading (expert) dim, got shapes "
            f"{tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if a_q.device != b_q.device:
        raise ValueError("a_q and b_q must be on the same device")
    a = a_q.dequantize(torch.float32)
    b = b_q.dequantize(torch.float32)
    with _no_tf32():
        return torch.matmul(a, b.transpose(-1, -2))


# --------------------------------------------------------------------------- #
# Blockwise (1 x 128 / 128 x 128, FP32 scales): Hopper's FP8 recipe
# --------------------------------------------------------------------------- #
GROUP_SIZE = 128


@dataclass
class BlockwiseFP8Tensor:
    """A blockwise-FP8 tensor.

    Attributes:
        data: ``torch.float8_e4m3fn`` ``[..., R, K]``, contiguous, K a multiple of 128.
        scale: fp32 ``[..., R / block_rows, K / 128]``: one scale per group of
            ``block_rows`` x 128 elements; the value is ``data * scale``.
        block_rows: 1 (activations, gradients: 1 x 128 groups along K) or 128
            (weights: 128 x 128 blocks).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float8_e4m3fn:
            raise TypeError("BlockwiseFP8Tensor.data must be a torch.float8_e4m3fn tensor")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32:
            raise TypeError("BlockwiseFP8Tensor.scale must be a torch.float32 tensor")
        if self.block_rows not in (1, GROUP_SIZE):
            raise ValueError(f"BlockwiseFP8Tensor.block_rows must be 1 or {GROUP_SIZE}, "
                             f"got {self.block_rows}")
        *lead, rows, k = self.data.shape
        want = (*lead, rows // self.block_rows, k // GROUP_SIZE)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"BlockwiseFP8Tensor.scale must have shape {want} for data of "
                             f"shape {tuple(self.data.shape)}, got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blockwise(self, dtype)


def _blockwise_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """amax / 448 (fp32), or its power of two rounded up; 1 for an all-zero group (its
    data is zeros, any scale reproduces it)."""
    if pow2:
        scale = _pow2_f32(_block_exponent(amax))
    else:  # a true fp32 division on every device (torch turns x / python_scalar into a
        # multiplication by its reciprocal on CUDA, which is off by an ulp at times)
        scale = amax / torch.full_like(amax, E4M3_MAX)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_blockwise(t: torch.Tensor, *, block_rows: int = 1,
                       pow2_scales: bool = False) -> BlockwiseFP8Tensor:
    """Quantise a 2-D ``[R, K]`` or 3-D ``[E, R, K]`` tensor along its last dim K.

    ``block_rows=1``: 1 x 128 groups (activations, gradients); ``block_rows=128``:
    128 x 128 blocks (weights; R a multiple of 128 too). Element value:
    ``data = rne_e4m3(fl32(x / scale))``, clamped to +-448 (the group's amax maps to
    448, or below it with power-of-two scales). To quantise along the other dim (the
    transposed copy a GEMM with the other K needs), pass ``t.transpose(-1, -2)``.

    Raises TypeError for a non-floating tensor and ValueError for a wrong rank, K (or R
    for weights) not a multiple of 128, or non-finite values.
    """
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"t must be a floating-point tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() not in (2, 3):
        raise ValueError(f"t must be 2-D [R, K] or 3-D [E, R, K], got shape {tuple(t.shape)}")
    if block_rows not in (1, GROUP_SIZE):
        raise ValueError(f"block_rows must be 1 (1 x 128 groups) or {GROUP_SIZE} "
                         f"(128 x 128 blocks), got {block_rows}")
    *lead, rows, k = t.shape
    if k % GROUP_SIZE or rows % block_rows:
        what = "K" if k % GROUP_SIZE else "R (weights are 128 x 128 blocks)"
        raise ValueError(f"blockwise FP8 needs {what} to be a multiple of {GROUP_SIZE}, got "
                         f"shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError("t must contain only finite values (found inf or nan)")
    x = t.float().contiguous()
    blocks = x.reshape(*lead, rows // block_rows, block_rows, k // GROUP_SIZE, GROUP_SIZE)
    amax = blocks.abs().amax(dim=(-3, -1))                       # [..., R/br, K/128]
    scale = _blockwise_scale(amax, pow2_scales)
    y = blocks / scale.unsqueeze(-2).unsqueeze(-1)
    data = y.clamp(-E4M3_MAX, E4M3_MAX).reshape(*lead, rows, k).to(torch.float8_e4m3fn)
    return BlockwiseFP8Tensor(data.contiguous(), scale.contiguous(), block_rows)


def dequantize_blockwise(q: BlockwiseFP8Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` per group, formed in fp32 and rounded once to ``dtype``."""
    if not isinstance(q, BlockwiseFP8Tensor):
        raise TypeError(f"q must be a BlockwiseFP8Tensor, got {type(q).__name__}")
    *lead, rows, k = q.data.shape
    br = q.block_rows
    vals = q.data.float().reshape(*lead, rows // br, br, k // GROUP_SIZE, GROUP_SIZE)
    out = vals * q.scale.unsqueeze(-2).unsqueeze(-1)
    return out.reshape(*lead, rows, k).to(dtype)


def blockwise_matmul_reference(a_q: BlockwiseFP8Tensor, b_q: BlockwiseFP8Tensor
                               ) -> torch.Tensor:
    """The blockwise FP8 GEMM contract: fp32 ``a @ b^T`` of the dequantised operands.

    ``a_q`` ``[M, K]`` (1 x 128 groups), ``b_q`` ``[N, K]`` (128 x 128 blocks, or 1 x 128
    for the wgrad's gradient operand); batched ``[E, M, K]`` x ``[E, N, K]`` too.
    """
    for name, q in (("a_q", a_q), ("b_q", b_q)):
        if not isinstance(q, BlockwiseFP8Tensor):
            raise TypeError(f"{name} must be a BlockwiseFP8Tensor, got {type(q).__name__}")
    if a_q.data.dim() != b_q.data.dim() or a_q.shape[-1] != b_q.shape[-1] or (
            a_q.data.dim() == 3 and a_q.shape[0] != b_q.shape[0]):
        raise ValueError(f"a_q [.., M, K] and b_q [.., N, K] must share K (and E), got "
                         f"shapes {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    with _no_tf32():
        return torch.matmul(a_q.dequantize(), b_q.dequantize().transpose(-1, -2))
