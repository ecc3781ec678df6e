"""The Hopper grouped-GEMM core (csrc/gemm/): expert GEMMs over the MoE row table.

Rows are in row-table order: expert e owns rows [expert_offsets[e], expert_offsets[e+1]),
each segment padded to 128 rows (a GEMM tile never straddles two experts); rows past the
device-side `num_rows` are not computed. Weights keep Megatron's grouped-expert layout:
w1 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]. All ops write into caller-given
outputs, read the counts on the device and never synchronise with the host.

    fc1_swiglu(x_rows, w1)        act = silu(x w1_g^T) * (x w1_u^T)   (+ h = [gate, up])
    rows_matmul(a, w)             a @ w[e]^T  (w [E, N, K])   fc2 forward
    rows_matmul(a, w, True)       a @ w[e]    (w [E, K, N])   fc1 dgrad
    dgrad_swiglu(d_out, w2, h)    d_h = SwiGLU'(h) * (d_out @ w2[e])   fc2 dgrad + SwiGLU bwd
    dgrad_swiglu_routed(dy_rows, row_w, w2, h)   the same with d_out = row_w * dy_rows, also
                                  <dy_rows @ w2[e], act> per column tile and row_w * act
    fc1_act(x_rows, w1, act)      act = f(x w1^T) for non-gated experts (w1 [E, I, H])
    dgrad_act_routed(dy_rows, row_w, w2, h, act)   d_h = f'(h) * row_w * (dy_rows @ w2[e]),
                                  with the same dots_part and act_scaled as the SwiGLU one
    wgrad(a, b)                   out[e] = a[rows of e]^T @ b[rows of e]   weight gradients
    segment_column_sums(rows)     out[e] = sum of rows of e (optionally scaled)   bias gradients
    segment_row_dots(rows, vecs)  out[r] = <rows[r], vecs[e of r]>   b2's part of d_topk_w

`glu` (fc1_swiglu, dgrad_swiglu*): (alpha, limit, offset) of the general GLU epilogues,
act = g' sigmoid(alpha g') (u' + offset), g' = min(g, limit), u' = clamp(u, -limit, limit)
(ExpertActivation.kernel_glu; limit inf: no clamp); None: SwiGLU. `bias`: per-expert
biases added in the epilogue, fc1's [E, 2I] before the activation, fc2's [E, N].

Each output tile has one owner CTA and a fixed K order, so results are bitwise
independent of the grid size (`max_ctas`, tests) and deterministic run to run.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_mok.kernels import ops

ROW_TILE = 128
DGRAD_COL_TILE = 256  # columns of I per fc2-dgrad tile (CfgDgradSwiGLU::BN)


def dgrad_col_tiles(inter: int) -> int:
    """Column tiles of fc2's dgrad, i.e. <dy, y_row> partials per row."""
    return -(-inter // DGRAD_COL_TILE)


def available() -> bool:
    return ops.extension_available() and hasattr(torch.ops.megatron_mok, "grouped_fc1_swiglu")


# SwiGLU as the general GLU (alpha 1, no clamp, no offset): where fc1 has a bias, since the
# bias adds live in the general epilogues only (the plain ones keep their code).
SWIGLU_AS_GLU = (1.0, float("inf"), 0.0)


def glu_args(glu: Optional[tuple], biased: bool = False) -> tuple:
    """The ops' trailing (glu, alpha, limit, offset) arguments; `biased` (the pass adds expert
    biases) turns SwiGLU (glu None) into SWIGLU_AS_GLU."""
    if glu is None and biased:
        glu = SWIGLU_AS_GLU
    if glu is None:
        return False, 1.0, 1.0, 0.0
    alpha, limit, offset = (float(v) for v in glu)
    if not (alpha > 0 and limit > 0):
        raise ValueError(f"megatron_mok: the GLU needs alpha > 0 and a clamp limit > 0 (inf: "
                         f"no clamp), got alpha={alpha}, limit={limit}")
    return True, alpha, limit, offset


def check_bias(name: str, bias: Optional[torch.Tensor], experts: int, cols: int,
                like: torch.Tensor) -> None:
    if bias is None:
        return
    _check(name, bias, 2, like.dtype)
    if tuple(bias.shape) != (experts, cols):
        raise ValueError(f"megatron_mok: {name} must be [{experts}, {cols}], got "
                         f"{tuple(bias.shape)}")
    _check_cuda(**{name: bias, "rows": like})


def _check(name: str, t: torch.Tensor, dim: int, dtype=torch.bfloat16) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"megatron_mok: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"megatron_mok: {name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"megatron_mok: {name} must have {dim} dimensions, got {tuple(t.shape)}")


def planes_accumulable(t: torch.Tensor) -> bool:
    """[E, M, N] whose planes are dense [M, N] and, like the tensor, 16-byte aligned: what
    wgrad's TMA stores can add into (contiguous, or per-expert buffers lying apart)."""
    e, m, n = t.shape
    planes_apart = e == 1 or (t.stride(0) >= m * n and t.stride(0) * t.element_size() % 16 == 0)
    return t.stride(2) == 1 and t.stride(1) == n and planes_apart and t.data_ptr() % 16 == 0


def _check_cuda(contiguous: bool = True, **tensors: Optional[torch.Tensor]) -> None:
    """After the shape checks: every tensor on one CUDA device, contiguous (unless told
    otherwise)."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"megatron_mok: {name} must be on a CUDA device, got {t.device}")
        if device is not None and t.device != device:
            raise ValueError(f"megatron_mok: {name} is on {t.device}, the other inputs on {device}")
        device = t.device
        if contiguous and not t.is_contiguous():
            raise ValueError(f"megatron_mok: {name} must be contiguous")


def _check_table(rows: int, offsets: torch.Tensor, num_experts: int,
                 num_rows: Optional[torch.Tensor]) -> None:
    if rows % ROW_TILE:
        raise ValueError(f"megatron_mok: the row table must hold a multiple of {ROW_TILE} rows, "
                         f"got {rows}")
    _check("expert_offsets", offsets, 1, torch.int32)
    if offsets.numel() != num_experts + 1:
        raise ValueError(f"megatron_mok: expert_offsets must have {num_experts + 1} entries "
                         f"(experts + 1), got {offsets.numel()}")
    if num_rows is not None:
        _check("num_rows", num_rows, 1, torch.int32)


def check_multiple_of_8(**sizes: int) -> None:
    for name, value in sizes.items():
        if value <= 0 or value % 8:  # TMA: 16-byte aligned rows, no empty dimension
            raise ValueError(f"megatron_mok: {name}={value} must be a positive multiple of 8 "
                             f"for the grouped-GEMM core")


def fc1_swiglu(x_rows: torch.Tensor, w1: torch.Tensor, expert_offsets: torch.Tensor,
               num_rows: torch.Tensor, *, save_h: bool = True, max_ctas: int = 0,
               bias: Optional[torch.Tensor] = None, glu: Optional[tuple] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(act [rows, I], h [rows, 2I] or None): fc1 (+ bias [E, 2I]) with SwiGLU (or the
    general GLU) in the epilogue (fp32, one rounding of act); h is the bf16 pre-activation
    (bias included) the backward needs."""
    _check("x_rows", x_rows, 2)
    _check("w1", w1, 3)
    rows, hidden = x_rows.shape
    if w1.shape[2] != hidden or w1.shape[1] % 2:
        raise ValueError(f"megatron_mok: w1 must be [E, 2I, {hidden}], got {tuple(w1.shape)}")
    inter = w1.shape[1] // 2
    _check_table(rows, expert_offsets, w1.shape[0], num_rows)
    check_multiple_of_8(hidden=hidden, inter=inter)
    _check_cuda(x_rows=x_rows, w1=w1, expert_offsets=expert_offsets, num_rows=num_rows)
    check_bias("b1", bias, w1.shape[0], 2 * inter, x_rows)
    glu_tail = glu_args(glu, biased=bias is not None)
    act = x_rows.new_empty(rows, inter)
    h = x_rows.new_empty(rows, 2 * inter) if save_h else None
    torch.ops.megatron_mok.grouped_fc1_swiglu(x_rows, w1, expert_offsets, num_rows, act, h,
                                              max_ctas, bias, *glu_tail)
    return act, h


def _kernel_act(activation) -> tuple[int, float]:
    act = activation.kernel_act
    if act is None:
        raise ValueError(f"megatron_mok: {activation.describe()} is a GLU: use fc1_swiglu / "
                         f"dgrad_swiglu_routed (the non-gated ops take f(h) of one column)")
    return act


def fc1_act(x_rows: torch.Tensor, w1: torch.Tensor, expert_offsets: torch.Tensor,
            num_rows: torch.Tensor, activation, *, save_h: bool = True, max_ctas: int = 0,
            bias: Optional[torch.Tensor] = None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(act [rows, I], h [rows, I] or None) of a non-gated expert (activation: an
    ExpertActivation with kernel_act; w1 [E, I, H]): fc1 (+ bias [E, I]) with f in the
    epilogue (fp32, one rounding of act); h is the bf16 pre-activation (bias included)."""
    act_fn, alpha = _kernel_act(activation)
    _check("x_rows", x_rows, 2)
    _check("w1", w1, 3)
    rows, hidden = x_rows.shape
    if w1.shape[2] != hidden:
        raise ValueError(f"megatron_mok: w1 must be [E, I, {hidden}], got {tuple(w1.shape)}")
    inter = w1.shape[1]
    _check_table(rows, expert_offsets, w1.shape[0], num_rows)
    check_multiple_of_8(hidden=hidden, inter=inter)
    _check_cuda(x_rows=x_rows, w1=w1, expert_offsets=expert_offsets, num_rows=num_rows)
    check_bias("b1", bias, w1.shape[0], inter, x_rows)
    act = x_rows.new_empty(rows, inter)
    h = x_rows.new_empty(rows, inter) if save_h else None
    torch.ops.megatron_mok.grouped_fc1_act(x_rows, w1, expert_offsets, num_rows, act, h,
                                           max_ctas, bias, act_fn, alpha)
    return act, h


def rows_matmul(a: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor,
                num_rows: torch.Tensor, w_transposed: bool = False, *, max_ctas: int = 0,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ w[e]^T (w [E, N, K]) or, with w_transposed, a @ w[e] (w [E, K, N]), per segment;
    + bias[e] ([E, N], fc2's) in the epilogue."""
    _check("a", a, 2)
    _check("w", w, 3)
    rows, k = a.shape
    n = w.shape[2] if w_transposed else w.shape[1]
    if (w.shape[1] if w_transposed else w.shape[2]) != k:
        raise ValueError(f"megatron_mok: w {tuple(w.shape)} does not reduce over a's {k} columns")
    _check_table(rows, expert_offsets, w.shape[0], num_rows)
    check_multiple_of_8(n=n, k=k)
    _check_cuda(a=a, w=w, expert_offsets=expert_offsets, num_rows=num_rows)
    check_bias("bias", bias, w.shape[0], n, a)
    if bias is not None and w_transposed:
        raise ValueError("megatron_mok: rows_matmul's bias is fc2's (w [E, N, K], not "
                         "w_transposed)")
    out = a.new_empty(rows, n)
    torch.ops.megatron_mok.grouped_gemm_rows(a, w, expert_offsets, num_rows, w_transposed, out,
                                             max_ctas, bias)
    return out


def _check_dgrad(d_out, w2, h, expert_offsets, num_rows, h_per_inter: int = 2) -> int:
    """The shared checks of the fused fc2 dgrad + activation backward (h [rows, 2I] for
    GLUs, [rows, I] with h_per_inter=1); returns I."""
    _check("d_out", d_out, 2)
    _check("w2", w2, 3)
    _check("h", h, 2)
    rows, hidden = d_out.shape
    inter = w2.shape[2]
    if w2.shape[1] != hidden:
        raise ValueError(f"megatron_mok: w2 must be [E, {hidden}, I], got {tuple(w2.shape)}")
    h_cols = h_per_inter * inter
    if tuple(h.shape) != (rows, h_cols):
        raise ValueError(f"megatron_mok: h must be [{rows}, {h_cols}], got {tuple(h.shape)}")
    _check_table(rows, expert_offsets, w2.shape[0], num_rows)
    check_multiple_of_8(hidden=hidden, inter=inter)
    _check_cuda(d_out=d_out, w2=w2, h=h, expert_offsets=expert_offsets, num_rows=num_rows)
    return inter


def _routed_outputs(dy_rows, row_w, h, inter: int):
    """The routed dgrads' row_w check and outputs: (d_h like h, dots_part [rows,
    dgrad_col_tiles(I)] fp32, act_scaled [rows, I])."""
    rows = dy_rows.shape[0]
    if row_w.dtype != torch.float32 or tuple(row_w.shape) != (rows,):
        raise ValueError(f"megatron_mok: row_w must be float32 [{rows}], got "
                         f"{row_w.dtype} {tuple(row_w.shape)}")
    _check_cuda(dy_rows=dy_rows, row_w=row_w)
    dots_part = torch.empty(rows, dgrad_col_tiles(inter), dtype=torch.float32,
                            device=dy_rows.device)
    return torch.empty_like(h), dots_part, dy_rows.new_empty(rows, inter)


def dgrad_swiglu(d_out: torch.Tensor, w2: torch.Tensor, h: torch.Tensor,
                 expert_offsets: torch.Tensor, num_rows: torch.Tensor, *, max_ctas: int = 0,
                 glu: Optional[tuple] = None) -> torch.Tensor:
    """d_h [rows, 2I]: d_act = d_out @ w2[e] in fp32, then the SwiGLU (or GLU) backward at h."""
    _check_dgrad(d_out, w2, h, expert_offsets, num_rows)
    glu_tail = glu_args(glu)
    d_h = torch.empty_like(h)
    torch.ops.megatron_mok.grouped_dgrad_swiglu(d_out, w2, expert_offsets, num_rows, h, d_h,
                                                max_ctas, None, None, None, *glu_tail)
    return d_h


def dgrad_swiglu_routed(dy_rows: torch.Tensor, row_w: torch.Tensor, w2: torch.Tensor,
                        h: torch.Tensor, expert_offsets: torch.Tensor, num_rows: torch.Tensor,
                        *, max_ctas: int = 0, glu: Optional[tuple] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_h, dots_part, act_scaled) with the router weights applied in the epilogue: acc =
    dy_rows @ w2[e] (fp32), d_act = row_w * acc, d_h the SwiGLU backward at h; dots_part
    [rows, dgrad_col_tiles(I)] fp32 = <acc, act> over each column tile (act = SwiGLU(h)
    recomputed; their sum is <dy, y_row>, the router weight's gradient, without reading y
    rows); act_scaled [rows, I] = row_w * act (dW2 = dy_rows^T act_scaled)."""
    inter = _check_dgrad(dy_rows, w2, h, expert_offsets, num_rows)
    glu_tail = glu_args(glu)
    d_h, dots_part, act_scaled = _routed_outputs(dy_rows, row_w, h, inter)
    torch.ops.megatron_mok.grouped_dgrad_swiglu(dy_rows, w2, expert_offsets, num_rows, h, d_h,
                                                max_ctas, row_w, dots_part, act_scaled,
                                                *glu_tail)
    return d_h, dots_part, act_scaled


def dgrad_act_routed(dy_rows: torch.Tensor, row_w: torch.Tensor, w2: torch.Tensor,
                     h: torch.Tensor, expert_offsets: torch.Tensor, num_rows: torch.Tensor,
                     activation, *, max_ctas: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dgrad_swiglu_routed for a non-gated expert (h [rows, I]): acc = dy_rows @ w2[e] in
    fp32, d_h = row_w * acc * f'(h); dots_part = <acc, f(h)> per column tile; act_scaled =
    row_w * f(h)."""
    act_fn, alpha = _kernel_act(activation)
    inter = _check_dgrad(dy_rows, w2, h, expert_offsets, num_rows, h_per_inter=1)
    d_h, dots_part, act_scaled = _routed_outputs(dy_rows, row_w, h, inter)
    torch.ops.megatron_mok.grouped_dgrad_act(dy_rows, w2, expert_offsets, num_rows, h, d_h,
                                             max_ctas, row_w, dots_part, act_scaled, act_fn,
                                             alpha)
    return d_h, dots_part, act_scaled


def wgrad(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor, *,
          out_dtype: Optional[torch.dtype] = None,
          accumulate_into: Optional[torch.Tensor] = None, reverse_experts: bool = False,
          max_ctas: int = 0, gather: Optional[tuple] = None,
          gathered: str = "b") -> torch.Tensor:
    """out [E, M, N], out[e] = a[rows of e]^T @ b[rows of e] (tokens as K, row-table order;
    an expert without rows gets zeros). With `accumulate_into` (fp32 [E, M, N], e.g. a view
    of Megatron's main_grads: dense 16-byte aligned [M, N] planes, which may lie apart) the
    gradient is added into it instead (TMA reduce-add stores: one add per element,
    deterministic) and that tensor is returned; with `reverse_experts` expert e's gradient
    goes into plane E - 1 - e. out_dtype: bfloat16 (default) or float32; with
    accumulate_into only float32. gather = (peer_rank, peer_token), int32 [rows] (EP = 1):
    the operands named by `gathered` ("a", "b" or "ab") are the tokens ([T, M] / [T, N],
    columns a multiple of 64) and their row j is token peer_token[j] (zeros where
    peer_rank[j] < 0), gathered by the kernel's producer: the bits of passing the gathered
    rows, without writing them."""
    if accumulate_into is not None and out_dtype not in (None, torch.float32):
        raise TypeError(f"megatron_mok: wgrad accumulates in float32, got out_dtype={out_dtype}")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"megatron_mok: wgrad out_dtype must be bfloat16 or float32, "
                        f"got {out_dtype}")
    _check("a", a, 2)
    _check("b", b, 2)
    gather_rank = gather_token = None
    operands = {"a": 1, "b": 2, "ab": 3}
    if gather is None:
        rows = a.shape[0]
        if b.shape[0] != rows:
            raise ValueError(f"megatron_mok: a and b must have the same rows, got {a.shape[0]} "
                             f"and {b.shape[0]}")
    else:
        if gathered not in operands:
            raise ValueError(f"megatron_mok: gathered must be 'a', 'b' or 'ab', got {gathered!r}")
        gather_rank, gather_token = gather
        rows = gather_rank.shape[0] if gather_rank.dim() == 1 else -1
        for name, t in (("peer_rank", gather_rank), ("peer_token", gather_token)):
            if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != rows \
                    or not t.is_contiguous():
                raise ValueError(f"megatron_mok: the wgrad gather's {name} must be contiguous "
                                 f"int32 [rows], got {t.dtype} {tuple(t.shape)}")
        for name, t in (("a", a), ("b", b)):
            if name in gathered and (t.shape[1] % 64 or t.shape[0] == 0):
                raise ValueError(f"megatron_mok: gathered wgrad rows need {name}'s columns a "
                                 f"multiple of 64 and at least one token, got {tuple(t.shape)}")
            if name not in gathered and t.shape[0] != rows:
                raise ValueError(f"megatron_mok: {name} must hold the row table's {rows} rows, "
                                 f"got {t.shape[0]}")
    num_experts = expert_offsets.numel() - 1
    _check_table(rows, expert_offsets, num_experts, None)
    check_multiple_of_8(m=a.shape[1], n=b.shape[1])
    shape = (num_experts, a.shape[1], b.shape[1])
    if reverse_experts and accumulate_into is None:
        raise ValueError("megatron_mok: reverse_experts needs accumulate_into")
    if accumulate_into is not None:
        _check("accumulate_into", accumulate_into, 3, torch.float32)
        if tuple(accumulate_into.shape) != shape:
            raise ValueError(f"megatron_mok: accumulate_into must be {list(shape)}, got "
                             f"{list(accumulate_into.shape)}")
        if not planes_accumulable(accumulate_into):
            raise ValueError("megatron_mok: accumulate_into must hold dense [M, N] planes, "
                             "16-byte aligned and apart (TMA stores); add a separately "
                             "computed gradient instead")
    _check_cuda(a=a, b=b, expert_offsets=expert_offsets)
    if gather is not None:
        _check_cuda(a=a, peer_rank=gather_rank, peer_token=gather_token)
    _check_cuda(a=a, accumulate_into=accumulate_into, contiguous=False)
    if accumulate_into is not None:
        torch.ops.megatron_mok.grouped_wgrad(a, b, expert_offsets, accumulate_into, True,
                                             max_ctas, reverse_experts, gather_rank,
                                             gather_token, operands.get(gathered, 2))
        return accumulate_into
    out = a.new_empty(*shape, dtype=out_dtype)
    torch.ops.megatron_mok.grouped_wgrad(a, b, expert_offsets, out, False, max_ctas, False,
                                         gather_rank, gather_token, operands.get(gathered, 2))
    return out


def _check_segment_rows(rows, expert_offsets, num_rows) -> tuple[int, int, int]:
    """The segment ops' shared checks; (rows, columns, experts)."""
    _check("rows", rows, 2)
    count, cols = rows.shape
    num_experts = expert_offsets.numel() - 1
    _check_table(count, expert_offsets, num_experts, num_rows)
    check_multiple_of_8(cols=cols)  # 16-byte row pieces
    return count, cols, num_experts


def segment_column_sums(rows: torch.Tensor, expert_offsets: torch.Tensor,
                        num_rows: torch.Tensor, scale: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """fp32 [E, N]: out[e] = sum over the rows r of segment e (below num_rows) of
    scale[r] * rows[r] (scale fp32 [rows], optional), in row order: the experts' bias
    gradients (fc1's from d_h, fc2's from the dy rows and their router weights)."""
    count, cols, num_experts = _check_segment_rows(rows, expert_offsets, num_rows)
    if scale is not None:
        _check("scale", scale, 1, torch.float32)
        if scale.shape[0] != count:
            raise ValueError(f"megatron_mok: scale must be [{count}], got {tuple(scale.shape)}")
    _check_cuda(rows=rows, scale=scale, expert_offsets=expert_offsets, num_rows=num_rows)
    out = torch.empty(num_experts, cols, dtype=torch.float32, device=rows.device)
    torch.ops.megatron_mok.segment_column_sums(rows, expert_offsets, num_rows, scale, out)
    return out


def segment_row_dots(rows: torch.Tensor, vecs: torch.Tensor, expert_offsets: torch.Tensor,
                     num_rows: torch.Tensor) -> torch.Tensor:
    """fp32 [rows]: <rows[r], vecs[e]> for the rows r of segment e (0 past num_rows), one
    fixed-order reduction per row: fc2's bias term of the router weights' gradient."""
    count, cols, num_experts = _check_segment_rows(rows, expert_offsets, num_rows)
    _check("vecs", vecs, 2)
    if tuple(vecs.shape) != (num_experts, cols):
        raise ValueError(f"megatron_mok: vecs must be [{num_experts}, {cols}], got "
                         f"{tuple(vecs.shape)}")
    _check_cuda(rows=rows, vecs=vecs, expert_offsets=expert_offsets, num_rows=num_rows)
    out = torch.empty(count, dtype=torch.float32, device=rows.device)
    torch.ops.megatron_mok.segment_row_dots(rows, vecs, expert_offsets, num_rows, out)
    return out
