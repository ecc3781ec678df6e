"""Blockwise-FP8 grouped GEMMs of the core (csrc/gemm/fp8_gemm.cu, docs/fp8.md).

The recipe's operands: activations in 1 x 128 groups along K (E4M3 values, one fp32 scale
per row and group, stored transposed as [K / 128, rows] for the kernels' bulk loads),
weights in 128 x 128 blocks (`fp8_formats.quantize_blockwise(w, block_rows=128)`: [E, N, K]
values, [E, N / 128, K / 128] scales), quantised once per optimizer step. Rows follow the
row table of the BF16 core (megatron_mok.kernels.grouped_gemm): expert segments padded to
128 rows, counts read on the device, outputs caller-given or allocated here, no host sync.

    quantize_rows(x)                    x bf16 [R, K] -> (q E4M3 [R, K], scale_t [K/128, R])
    gather_quantize_rows(x, sched)      EP = 1: the row table's rows of x quantised (+ bf16)
    quantize_weight(w)                  w [E, N, K] -> BlockwiseFP8Tensor (128 x 128; torch)
    quantize_weights(w)                 the same on the device, both layouts -> Fp8Weight
    fc1_swiglu(xq, xs, w1q, ...)        act = SwiGLU(dq(x) dq(w1)^T) bf16 or E4M3 (+ h bf16)
    rows_matmul(aq, as_, wq, ...)       out = dq(a) dq(w[e])^T bf16       fc2 forward
    dgrad_swiglu_routed(dyq, ...)       fc2 dgrad + router weight + SwiGLU backward (FP8)
    expert_forward(x_rows, w1q, w2q)    the FP8 experts' forward chain over the row table
    expert_dgrad(dy_rows, row_w, ...)   their data gradients (fc2 dgrad, fc1 dgrad)

The GEMMs promote their fp32 partial every 128 of K (docs/fp8.md), so the sums follow a
fixed order: bitwise deterministic and independent of the grid size, as the BF16 core.
The weight gradients run on the BF16 core (MoKConfig.fp8_wgrad = "bf16"). x, dy, act and
d_h are quantised by separate passes (x and dy per token, then their E4M3 rows gathered);
MOK_FP8_FUSED_QUANT=1 fuses each into work that already passes over the data (x and dy
gathered and quantised in one pass, act in fc1's epilogue, d_h in the fc2 dgrad's): the
same bits, measured slower on an H100 (docs/perf-notes.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from megatron_mok import knobs
from megatron_mok.fp8_formats import GROUP_SIZE, BlockwiseFP8Tensor, quantize_blockwise
from megatron_mok.kernels import ops

FP8 = torch.float8_e4m3fn


def available() -> bool:
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "grouped_fp8_gemm_rows")


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_cuda(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")


def _check_multiple(what: str, value: int) -> None:
    if value % GROUP_SIZE:
        raise ValueError(f"blockwise FP8 needs {what} to be a multiple of {GROUP_SIZE}, got "
                         f"{value}; run this layer in BF16")


def quantize_rows(x: torch.Tensor, q: Optional[torch.Tensor] = None,
                  scale_t: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """1 x 128 quantisation of bf16 rows [R, K]: (q [R, K] E4M3, scale_t [K / 128, R] fp32),
    the bits of `quantize_blockwise(x, block_rows=1)` (scale_t is its scale transposed)."""
    _check(x, "x", torch.bfloat16, 2)
    _check_multiple("K", x.shape[1])
    _check_cuda(x, "x")
    rows, k = x.shape
    if q is None:
        q = torch.empty(rows, k, dtype=FP8, device=x.device)
    if scale_t is None:
        scale_t = torch.empty(k // GROUP_SIZE, -(-rows // 4) * 4, dtype=torch.float32,
                              device=x.device)[:, :rows]
    torch.ops.megatron_mok.quantize_fp8_rows(x, q, scale_t)
    return q, scale_t


def quantize_weight(w: torch.Tensor) -> BlockwiseFP8Tensor:
    """Expert weights [E, N, K] in 128 x 128 blocks (N and K multiples of 128), by the spec's
    torch quantiser (it checks the values for inf / nan: a host sync; the passes use
    quantize_weights)."""
    if w.dim() != 3:
        raise ValueError(f"expert weights must be [E, N, K], got shape {tuple(w.shape)}")
    return quantize_blockwise(w, block_rows=GROUP_SIZE)


@dataclasses.dataclass
class Fp8Weight:
    """One expert weight [E, N, K] in 128 x 128 blocks, in both layouts the GEMMs read:
    `q` [E, N, K] (the forward's: K-major along K) and `qt` [E, K, N] (the dgrad's), with
    their block scales (`scale` [E, N/128, K/128], `scale_t` its transpose)."""
    q: torch.Tensor
    scale: torch.Tensor
    qt: torch.Tensor
    scale_t: torch.Tensor

    def blockwise(self) -> BlockwiseFP8Tensor:
        return BlockwiseFP8Tensor(self.q, self.scale, GROUP_SIZE)


def quantize_weights(w: torch.Tensor) -> Fp8Weight:
    """w [E, N, K] bf16 -> Fp8Weight, on the device in one launch (no host sync); the values
    and scales of `quantize_weight(w)`, and their transposes."""
    _check(w, "w", torch.bfloat16, 3)
    _check_multiple("N", w.shape[1])
    _check_multiple("K", w.shape[2])
    _check_cuda(w, "w")
    e, n, k = w.shape
    q = torch.empty(e, n, k, dtype=FP8, device=w.device)
    qt = torch.empty(e, k, n, dtype=FP8, device=w.device)
    scale = torch.empty(e, n // GROUP_SIZE, k // GROUP_SIZE, dtype=torch.float32,
                        device=w.device)
    torch.ops.megatron_mok.quantize_fp8_blocks(w, q, qt, scale)
    return Fp8Weight(q, scale, qt, scale.transpose(1, 2).contiguous())


def _check_gemm(aq, a_scale_t, wq, w_scale, expert_offsets, num_rows) -> None:
    _check(aq, "a", FP8, 2)
    _check(wq, "w", FP8, 3)
    _check(w_scale, "w_scale", torch.float32, 3)
    _check(expert_offsets, "expert_offsets", torch.int32, 1)
    if a_scale_t.dtype != torch.float32 or a_scale_t.dim() != 2 or a_scale_t.stride(1) != 1:
        raise ValueError("a_scale_t must be float32 [K / 128, rows] with unit column stride "
                         "(quantize_rows's scale_t)")
    _check_multiple("K", aq.shape[1])
    _check_multiple("N", wq.shape[1])
    if wq.shape[2] != aq.shape[1]:
        raise ValueError(f"w [E, N, K] must share a's K = {aq.shape[1]}, got {tuple(wq.shape)}")
    if expert_offsets.numel() != wq.shape[0] + 1:
        raise ValueError(f"expert_offsets must have E + 1 = {wq.shape[0] + 1} entries, got "
                         f"{expert_offsets.numel()}")
    if num_rows.dtype != torch.int32 or num_rows.numel() != 1:
        raise ValueError("num_rows must be an int32 tensor with one element")
    for t, name in ((aq, "a"), (a_scale_t, "a_scale_t"), (wq, "w"), (w_scale, "w_scale"),
                    (expert_offsets, "expert_offsets"), (num_rows, "num_rows")):
        _check_cuda(t, name)
        if t.device != aq.device:
            raise ValueError(f"{name} must be on a's device {aq.device}, got {t.device}")


def rows_matmul(aq: torch.Tensor, a_scale_t: torch.Tensor, wq: torch.Tensor,
                w_scale: torch.Tensor, expert_offsets: torch.Tensor, num_rows: torch.Tensor,
                out: Optional[torch.Tensor] = None, max_ctas: int = 0) -> torch.Tensor:
    """out [R, N] bf16 = dq(a) @ dq(w[e])^T on expert e's rows (w [E, N, K])."""
    _check_gemm(aq, a_scale_t, wq, w_scale, expert_offsets, num_rows)
    if out is None:
        out = torch.empty(aq.shape[0], wq.shape[1], dtype=torch.bfloat16, device=aq.device)
    torch.ops.megatron_mok.grouped_fp8_gemm_rows(aq, a_scale_t, wq, w_scale, expert_offsets,
                                                 num_rows, out, max_ctas)
    return out


def fc1_swiglu(xq: torch.Tensor, x_scale_t: torch.Tensor, w1q: torch.Tensor,
               w1_scale: torch.Tensor, expert_offsets: torch.Tensor, num_rows: torch.Tensor,
               save_h: bool = True, max_ctas: int = 0, quantize_act: bool = False):
    """(act, h [R, 2I] bf16 or None): fc1 in FP8 (w1 [E, 2I, H], gate rows then up rows) with
    SwiGLU in the epilogue, from the fp32 accumulators. act: [R, I] bf16, or with
    quantize_act (act_q E4M3 [R, I], act_scale_t [I / 128, R]): act quantised 1 x 128 by the
    same epilogue from its bf16 rounding, no bf16 act written (the bits of
    quantize_rows(act); rows at and past num_rows' last 128-row tile unwritten)."""
    _check_gemm(xq, x_scale_t, w1q, w1_scale, expert_offsets, num_rows)
    rows, inter = xq.shape[0], w1q.shape[1] // 2
    _check_multiple("I", inter)
    h = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=xq.device) if save_h else None
    act = act_q = act_scale_t = None
    if quantize_act:
        act_q = torch.empty(rows, inter, dtype=FP8, device=xq.device)
        act_scale_t = torch.empty(inter // GROUP_SIZE, -(-rows // 4) * 4, dtype=torch.float32,
                                  device=xq.device)[:, :rows]
    else:
        act = torch.empty(rows, inter, dtype=torch.bfloat16, device=xq.device)
    torch.ops.megatron_mok.grouped_fp8_fc1_swiglu(xq, x_scale_t, w1q, w1_scale, expert_offsets,
                                                  num_rows, act, h, max_ctas, act_q, act_scale_t)
    return ((act_q, act_scale_t) if quantize_act else act), h


def dgrad_swiglu_routed(dyq: torch.Tensor, dy_scale_t: torch.Tensor, row_w: torch.Tensor,
                        w2: Fp8Weight, h: torch.Tensor, expert_offsets: torch.Tensor,
                        num_rows: torch.Tensor, max_ctas: int = 0, quantize_dh: bool = False):
    """fc2's dgrad in FP8 with the router weights and the SwiGLU backward in its epilogue, as
    grouped_gemm.dgrad_swiglu_routed: dy rows (unscaled) quantised 1 x 128 along H, w2's
    transposed blocks. Returns (d_h [R, 2I] bf16, dots_part [R, I / 128] fp32 (<acc, act>
    per 128-column tile), act_scaled [R, I] bf16 = row_w * SwiGLU(h)); quantize_dh: also
    (dh_q, dh_scale_t), d_h quantised 1 x 128 by the same epilogue from its bf16 values
    (the bits of quantize_rows(d_h); rows at and past num_rows unwritten)."""
    _check_gemm(dyq, dy_scale_t, w2.qt, w2.scale_t, expert_offsets, num_rows)
    rows, inter = dyq.shape[0], w2.qt.shape[1]
    _check(h, "h", torch.bfloat16, 2)
    if tuple(h.shape) != (rows, 2 * inter):
        raise ValueError(f"h must be [{rows}, {2 * inter}], got {tuple(h.shape)}")
    d_h = torch.empty_like(h)
    dots_part = torch.empty(rows, inter // GROUP_SIZE, dtype=torch.float32, device=h.device)
    act_scaled = torch.empty(rows, inter, dtype=torch.bfloat16, device=h.device)
    dh_q = dh_scale_t = None
    if quantize_dh:
        dh_q = torch.empty(rows, 2 * inter, dtype=FP8, device=h.device)
        dh_scale_t = torch.empty(2 * inter // GROUP_SIZE, -(-rows // 4) * 4,
                                 dtype=torch.float32, device=h.device)[:, :rows]
    torch.ops.megatron_mok.grouped_fp8_dgrad_swiglu(dyq, dy_scale_t, w2.qt, w2.scale_t,
                                                    expert_offsets, num_rows, h, d_h, max_ctas,
                                                    row_w, dots_part, act_scaled, dh_q,
                                                    dh_scale_t)
    if quantize_dh:
        return d_h, dots_part, act_scaled, (dh_q, dh_scale_t)
    return d_h, dots_part, act_scaled


def gather_quantize_rows(x: torch.Tensor, sched, topk_w: Optional[torch.Tensor] = None,
                         keep_rows: bool = False):
    """EP = 1: the row table's rows of x [T, H] bf16 (row j = token sched.peer_token[j];
    padding rows zeros with scale 1) quantised 1 x 128. keep_rows: also their bf16 copy
    (pull_rows's rows); topk_w [T, K] fp32: also each row's router weight (pull_rows's
    row_w, 0 for padding). A row's groups depend on its values alone, so these are the bits
    of quantize_rows(x_rows). Separate passes (quantize_then_gather_rows), or with
    MOK_FP8_FUSED_QUANT=1 one (gather_quantize_rows_fused). Returns ((q, scale_t), rows or
    None, row_w or None)."""
    _check(x, "x", torch.bfloat16, 2)
    _check_multiple("H", x.shape[1])
    _check_cuda(x, "x")
    if topk_w is not None:
        _check(topk_w, "topk_w", torch.float32, 2)
    gather = gather_quantize_rows_fused if fused_quantisers() else quantize_then_gather_rows
    return gather(x, sched, topk_w, keep_rows)


def gather_quantize_rows_fused(x: torch.Tensor, sched, topk_w: Optional[torch.Tensor],
                               keep_rows: bool):
    """gather_quantize_rows in one pass (checked inputs): x read once per route (mostly from
    L2), no bf16 rows in HBM unless asked; rows at and past sched.num_rows unwritten."""
    capacity, hidden = sched.peer_rank.numel(), x.shape[1]
    q = torch.empty(capacity, hidden, dtype=FP8, device=x.device)
    scale_t = torch.empty(hidden // GROUP_SIZE, -(-capacity // 4) * 4, dtype=torch.float32,
                          device=x.device)[:, :capacity]
    rows = torch.empty(capacity, hidden, dtype=x.dtype, device=x.device) if keep_rows else None
    row_w = None
    if topk_w is not None:
        row_w = torch.empty(capacity, dtype=torch.float32, device=x.device)
    torch.ops.megatron_mok.gather_quantize_fp8_rows(
        x, sched.peer_rank, sched.peer_token, sched.peer_k, sched.num_rows, topk_w, q, scale_t,
        rows, row_w)
    return (q, scale_t), rows, row_w


def fused_quantisers() -> bool:
    """MOK_FP8_FUSED_QUANT=1: the quantisers fused into the gathers and epilogues."""
    return knobs.get("MOK_FP8_FUSED_QUANT") == "1"


def quantize_then_gather_rows(x: torch.Tensor, sched, topk_w: Optional[torch.Tensor],
                              keep_rows: bool):
    """gather_quantize_rows in separate passes (checked inputs): the tokens quantised once (plus a zero row
    with scale 1 for the padding rows), then their E4M3 rows, scales, bf16 rows and router
    weights gathered by index. A row's groups depend on its values alone: the same bits."""
    tokens, hidden = x.shape
    xq = torch.empty(tokens + 1, hidden, dtype=FP8, device=x.device)
    xs = torch.empty(hidden // GROUP_SIZE, -(-(tokens + 1) // 4) * 4, dtype=torch.float32,
                     device=x.device)[:, :tokens + 1]
    quantize_rows(x, xq[:tokens], xs[:, :tokens])
    xq[tokens].view(torch.uint8).zero_()
    xs[:, tokens].fill_(1.0)
    routed = sched.peer_rank >= 0
    token = torch.where(routed, sched.peer_token, tokens).long()
    q = xq.view(torch.uint8).index_select(0, token).view(FP8)
    scale_t = xs.index_select(1, token)  # [H / 128, capacity]: capacity is a multiple of 128
    rows = row_w = None
    if keep_rows:
        rows = torch.cat([x, x.new_zeros(1, hidden)]).index_select(0, token)
    if topk_w is not None and tokens == 0:
        row_w = torch.zeros(token.numel(), dtype=torch.float32, device=x.device)
    elif topk_w is not None:
        k = torch.where(routed, sched.peer_k, 0).long()
        row_w = torch.where(routed, topk_w[token.clamp(max=tokens - 1), k], 0.0)
    return (q, scale_t), rows, row_w


def expert_forward(x_rows, w1, w2,
                   expert_offsets: torch.Tensor, num_rows: torch.Tensor, save_h: bool = False,
                   max_ctas: int = 0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The routed experts' forward in FP8 over the row table: x rows quantised 1 x 128, fc1 +
    SwiGLU, act quantised 1 x 128 from its bf16 rounding (MOK_FP8_FUSED_QUANT=1: in fc1's
    epilogue), fc2. w1, w2: Fp8Weight or BlockwiseFP8Tensor; x_rows: bf16 rows,
    or (E4M3 rows, scale_t) already quantised (gather_quantize_rows). Returns (out rows
    [R, H] bf16, h or None)."""
    (w1q, w1s), (w2q, w2s) = (_values_and_scales(w) for w in (w1, w2))
    xq, xs = x_rows if isinstance(x_rows, tuple) else quantize_rows(x_rows)
    if fused_quantisers():
        (aq, as_), h = fc1_swiglu(xq, xs, w1q, w1s, expert_offsets, num_rows, save_h,
                                  max_ctas, quantize_act=True)
    else:
        act, h = fc1_swiglu(xq, xs, w1q, w1s, expert_offsets, num_rows, save_h, max_ctas)
        aq, as_ = quantize_rows(act)
    return rows_matmul(aq, as_, w2q, w2s, expert_offsets, num_rows, max_ctas=max_ctas), h


def expert_dgrad(dy_rows, row_w: torch.Tensor, w1: Fp8Weight, w2: Fp8Weight,
                 h: torch.Tensor, expert_offsets: torch.Tensor, num_rows: torch.Tensor,
                 max_ctas: int = 0):
    """The FP8 experts' data gradients over the row table: dy rows quantised 1 x 128, fc2
    dgrad + router weight + SwiGLU backward, d_h quantised 1 x 128 from its bf16 rounding
    (MOK_FP8_FUSED_QUANT=1: in the same epilogue), fc1 dgrad against w1's transposed blocks. dy_rows: bf16 rows, or (E4M3 rows, scale_t)
    already quantised (gather_quantize_rows of dy). Returns (d_h, dots_part, act_scaled,
    dx_rows)."""
    dyq, dys = dy_rows if isinstance(dy_rows, tuple) else quantize_rows(dy_rows)
    if fused_quantisers():
        d_h, dots_part, act_scaled, (dhq, dhs) = dgrad_swiglu_routed(
            dyq, dys, row_w, w2, h, expert_offsets, num_rows, max_ctas, quantize_dh=True)
    else:
        d_h, dots_part, act_scaled = dgrad_swiglu_routed(dyq, dys, row_w, w2, h, expert_offsets,
                                                         num_rows, max_ctas)
        dhq, dhs = quantize_rows(d_h)
    dx_rows = rows_matmul(dhq, dhs, w1.qt, w1.scale_t, expert_offsets, num_rows,
                          max_ctas=max_ctas)
    return d_h, dots_part, act_scaled, dx_rows


def _values_and_scales(w):
    if isinstance(w, Fp8Weight):
        return w.q, w.scale
    return w.data, w.scale
