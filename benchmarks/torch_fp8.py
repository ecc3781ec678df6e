"""The unfused FP8 baseline of the layer benchmark (`torch-fp8`): PyTorch's row-wise-scaled
FP8 grouped GEMM (`torch._scaled_grouped_mm`, E4M3, one fp32 scale per row of each
operand along the GEMM's K) with the permute / unpermute of `torch-unfused` around it.

Per expert GEMM (out = a @ w^T, a [M, K] rows grouped by `offs`, w [G, N, K]):
    forward   a quantised per row, w per (expert, output row); FP8 grouped GEMM -> bf16
    dgrad     d_out quantised per row along N, w's transpose per (expert, input feature)
    wgrad     in BF16 (`torch._grouped_mm` grouped along the tokens), as mok's default
The shared expert stays BF16 (as in mok's FP8 pass). This is the recipe a PyTorch user
gets without custom kernels (row-wise rather than 1 x 128 / 128 x 128 scales: coarser,
so cheaper to quantise and less accurate); on the CPU the same products run dequantised
(tests only).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rowwise(t: torch.Tensor):
    """(q E4M3, scale fp32) with one scale per row of t's last dimension: scale = amax / 448."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale.squeeze(-1)


def _scaled_grouped_mm(a_q, a_s, b_q, b_s, offs) -> torch.Tensor:
    """bf16 [M, N] = (a_q * a_s) @ (b_q[g] * b_s[g]) per group: a_q [M, K] row-major, a_s [M],
    b_q [G, K, N] column-major, b_s [G, N]. Rows past offs[-1] are zero on the CPU and not
    written on the GPU."""
    if a_q.is_cuda:
        return torch._scaled_grouped_mm(a_q, b_q, a_s, b_s, offs=offs, out_dtype=torch.bfloat16)
    out = torch.zeros(a_q.shape[0], b_q.shape[2], dtype=torch.bfloat16)
    start = 0
    for g, end in enumerate(offs.tolist()):
        a = a_q[start:end].float() * a_s[start:end, None]
        out[start:end] = (a @ (b_q[g].float() * b_s[g][None, :])).to(torch.bfloat16)
        start = end
    return out


def _grouped_wgrad(d_out: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[G, N, K] = d_out_g^T @ a_g per group of rows, in BF16 with fp32 accumulation."""
    if d_out.is_cuda:
        return torch._grouped_mm(d_out.t(), a, offs=offs)
    parts, start = [], 0
    for end in offs.tolist():
        parts.append((d_out[start:end].float().t() @ a[start:end].float()).to(d_out.dtype))
        start = end
    return torch.stack(parts)


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w, offs):
        a_q, a_s = quantize_rowwise(a)
        w_q, w_s = quantize_rowwise(w)  # per (expert, output row), along K
        ctx.save_for_backward(a, w, offs)
        return _scaled_grouped_mm(a_q, a_s, w_q.transpose(-2, -1), w_s, offs)

    @staticmethod
    def backward(ctx, d_out):
        a, w, offs = ctx.saved_tensors
        d_out = d_out.contiguous()
        d_q, d_s = quantize_rowwise(d_out)  # along N
        wt_q, wt_s = quantize_rowwise(w.transpose(1, 2).contiguous())  # [G, K, N] along N
        d_a = _scaled_grouped_mm(d_q, d_s, wt_q.transpose(-2, -1), wt_s, offs)
        d_w = _grouped_wgrad(d_out, a, offs) if ctx.needs_input_grad[1] else None
        return d_a, d_w, None


def fp8_grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group a_g @ w[g]^T in row-wise FP8 (benchmarks.layer.grouped_linear's contract):
    a [M, K] bf16 grouped by `offs` (int32 cumulative ends), w [G, N, K] bf16 -> [M, N] bf16.
    K and N must be multiples of 16 (the FP8 GEMM's alignment)."""
    return _Fp8GroupedLinear.apply(a.contiguous(), w, offs)
