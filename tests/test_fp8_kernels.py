"""The blockwise-FP8 grouped GEMMs (megatron_mok.kernels.fp8_gemm) against the FP8 spec:
the quantiser's bits against fp8_formats.quantize_blockwise, each GEMM against the fp32
product of the same dequantised operands (blockwise_matmul_reference), the forward chain
against reference_fp8's expert, bitwise independence of the grid size and the scheduler.
Input checks run on the CPU."""

import pytest
import torch

from megatron_mok import knobs
from megatron_mok.activations import SWIGLU
from megatron_mok.fp8_formats import (BlockwiseFP8Tensor, blockwise_matmul_reference,
                                      quantize_blockwise)
from megatron_mok.kernels import fp8_gemm as f8
from megatron_mok.reference_fp8 import fp8_expert
from megatron_mok.reference import rel_l2
from row_tables import COUNTS, rand_bf16, row_table, segments

# bf16 outputs of fp32 sums (2^-9 relative per element) over FP8 products; the FP8 WGMMA's
# own accumulation within a 128-deep K tile adds ~2^-14.
GEMM_TOL = 5e-3
DIMS = [(256, 128), (768, 384), (2048, 768)]  # (H, I)


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows_as_blockwise(q, scale_t, lo, hi):
    """Rows [lo, hi) of a quantised row block as the spec's tensor."""
    return BlockwiseFP8Tensor(q[lo:hi].contiguous(), scale_t[:, lo:hi].t().contiguous(), 1)


def _weight_slice(w: BlockwiseFP8Tensor, e, rows=None):
    data, scale = w.data[e], w.scale[e]
    if rows is not None:
        data, scale = data[rows], scale[rows.start // 128:rows.stop // 128]
    return BlockwiseFP8Tensor(data.contiguous(), scale.contiguous(), 128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k", [(1, 128), (300, 768), (1024, 2048)])
def test_quantize_rows_bits_match_the_spec(rows, k):
    x = rand_bf16(rows, k, seed=rows + k, scale=3.0)
    x[0, :128] = 0  # an all-zero group: scale 1
    q, scale_t = f8.quantize_rows(x)
    ref = quantize_blockwise(x, block_rows=1)
    assert torch.equal(_bits(q), _bits(ref.data))
    assert torch.equal(scale_t, ref.scale.t())
    assert scale_t[0, 0].item() == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_fc2_rows_matmul_matches_the_dequantised_product(routing, hidden, inter):
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(offs) - 1
    a = rand_bf16(capacity, inter, seed=1, real=real)
    w = f8.quantize_weight(rand_bf16(E, hidden, inter, seed=2, scale=inter ** -0.5))
    aq, a_scale_t = f8.quantize_rows(a)
    out = f8.rows_matmul(aq, a_scale_t, w.data, w.scale, offsets, num_rows)
    for e, lo, hi in segments(offs):
        ref = blockwise_matmul_reference(_rows_as_blockwise(aq, a_scale_t, lo, hi),
                                         _weight_slice(w, e))
        assert rel_l2(out[lo:hi].float(), ref) < GEMM_TOL, (e, lo, hi)


def _fc1_case(routing, hidden, inter, seed):
    """A row table, quantised x rows and w1, and the plain fc1 launch's act and h."""
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    x = rand_bf16(capacity, hidden, seed=seed, real=real)
    w1 = f8.quantize_weight(rand_bf16(len(offs) - 1, 2 * inter, hidden, seed=seed + 1,
                                      scale=hidden ** -0.5))
    xq, x_scale_t = f8.quantize_rows(x)
    act, h = f8.fc1_swiglu(xq, x_scale_t, w1.data, w1.scale, offsets, num_rows)
    return offsets, num_rows, capacity, offs, xq, x_scale_t, w1, act, h


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_fc1_swiglu_matches_the_dequantised_product(routing, hidden, inter):
    offsets, num_rows, _, offs, xq, x_scale_t, w1, act, h = _fc1_case(routing, hidden, inter, 3)
    for e, lo, hi in segments(offs):
        h_ref = blockwise_matmul_reference(_rows_as_blockwise(xq, x_scale_t, lo, hi),
                                           _weight_slice(w1, e))
        assert rel_l2(h[lo:hi].float(), h_ref) < GEMM_TOL, (e, lo, hi)
        assert rel_l2(act[lo:hi].float(), SWIGLU(h_ref)) < GEMM_TOL, (e, lo, hi)


@pytest.mark.gpu
def test_expert_forward_matches_the_fp8_spec():
    """The chain x -> q -> fc1 + SwiGLU -> q -> fc2 against reference_fp8's expert per
    segment (the chain quantises act from its bf16 rounding, the spec from fp32)."""
    offsets, num_rows, capacity, real, offs = row_table([300, 129, 0, 77])
    hidden, inter = 1024, 512
    E = len(offs) - 1
    x = rand_bf16(capacity, hidden, seed=5, real=real)
    w1_bf = rand_bf16(E, 2 * inter, hidden, seed=6, scale=hidden ** -0.5)
    w2_bf = rand_bf16(E, hidden, inter, seed=7, scale=inter ** -0.5)
    out, _ = f8.expert_forward(x, f8.quantize_weight(w1_bf), f8.quantize_weight(w2_bf),
                               offsets, num_rows)
    for e, lo, hi in segments(offs):
        ref = fp8_expert(x[lo:hi].float(), w1_bf[e], w2_bf[e], torch.bfloat16)
        assert rel_l2(out[lo:hi].float(), ref) < 1e-2, (e, lo, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler, cluster, promotion", [
    ("counter", "1", "serial"), ("static", "1", "serial"), ("static", "2", "serial"),
    ("counter", "1", "overlap"), ("static", "1", "overlap")])
def test_bits_do_not_depend_on_the_grid_the_scheduler_the_cluster_or_the_promotion(
        scheduler, cluster, promotion):
    offsets, num_rows, capacity, real, offs = row_table(COUNTS["ragged"])
    hidden, inter = 768, 384
    E = len(offs) - 1
    x = rand_bf16(capacity, hidden, seed=8, real=real)
    w1 = f8.quantize_weights(rand_bf16(E, 2 * inter, hidden, seed=9, scale=hidden ** -0.5))
    w2 = f8.quantize_weights(rand_bf16(E, hidden, inter, seed=10, scale=inter ** -0.5))
    used = offs[-1]  # rows past the table's segments are never written
    base, base_h = f8.expert_forward(x, w1, w2, offsets, num_rows, save_h=True)
    dy = rand_bf16(capacity, hidden, seed=18, real=real)
    row_w = torch.rand(capacity, generator=torch.Generator().manual_seed(19)).cuda()
    base_dgrad = f8.expert_dgrad(dy, row_w, w1, w2, base_h, offsets, num_rows)
    knobs.set_env("MOK_GEMM_SCHEDULER", scheduler)
    knobs.set_env("MOK_GEMM_CLUSTER", cluster)
    knobs.set_env("MOK_FP8_PROMOTION", promotion)
    try:
        for ctas in (2, 6, 0):
            out, h = f8.expert_forward(x, w1, w2, offsets, num_rows, save_h=True, max_ctas=ctas)
            assert torch.equal(out[:used], base[:used]), ctas
            assert torch.equal(h[:used], base_h[:used]), ctas
            dgrad = f8.expert_dgrad(dy, row_w, w1, w2, base_h, offsets, num_rows, max_ctas=ctas)
            for got, want in zip(dgrad, base_dgrad):
                assert torch.equal(got[:used], want[:used]), ctas
    finally:
        knobs.set_env("MOK_GEMM_SCHEDULER", None)
        knobs.set_env("MOK_GEMM_CLUSTER", None)
        knobs.set_env("MOK_FP8_PROMOTION", None)


@pytest.mark.gpu
def test_rows_past_num_rows_are_not_written():
    offsets, _, capacity, real, offs = row_table([256, 256])
    num_rows = torch.tensor([128], dtype=torch.int32, device="cuda")
    a = rand_bf16(capacity, 256, seed=11, real=real)
    w = f8.quantize_weight(rand_bf16(2, 256, 256, seed=12, scale=1 / 16))
    aq, s = f8.quantize_rows(a)
    out = torch.full((capacity, 256), 7.0, dtype=torch.bfloat16, device="cuda")
    f8.rows_matmul(aq, s, w.data, w.scale, offsets, num_rows, out=out)
    assert bool((out[128:] == 7.0).all())
    assert not bool((out[:128] == 7.0).all())


def test_bad_inputs_raise_before_any_launch():
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        f8.quantize_rows(x)
    with pytest.raises(TypeError, match="bfloat16"):
        f8.quantize_rows(x.float())
    with pytest.raises(ValueError, match="multiple of 128"):
        f8.quantize_rows(torch.zeros(128, 200, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="multiple of 128"):
        f8.quantize_weight(torch.zeros(2, 100, 256))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        f8.quantize_weight(torch.zeros(100, 256))
    sched = None  # the checks of x come first
    with pytest.raises(ValueError, match="CUDA"):
        f8.gather_quantize_rows(x, sched)
    with pytest.raises(TypeError, match="bfloat16"):
        f8.gather_quantize_rows(x.half(), sched)
    with pytest.raises(ValueError, match="multiple of 128"):
        f8.gather_quantize_rows(torch.zeros(128, 200, dtype=torch.bfloat16), sched)
    with pytest.raises(ValueError, match="contiguous"):
        f8.gather_quantize_rows(torch.zeros(256, 256, dtype=torch.bfloat16)[::2], sched)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128, 256), (4, 768, 2048), (2, 4096, 1024)])
def test_quantize_weights_bits_match_the_spec_in_both_layouts(shape):
    w = rand_bf16(*shape, seed=13, scale=0.05)
    w[0, :128, :128] = 0  # an all-zero block: scale 1
    got = f8.quantize_weights(w)
    ref = f8.quantize_weight(w)
    assert torch.equal(_bits(got.q), _bits(ref.data))
    assert torch.equal(got.scale, ref.scale)
    assert torch.equal(_bits(got.qt), _bits(ref.data.transpose(1, 2).contiguous()))
    assert torch.equal(got.scale_t, ref.scale.transpose(1, 2))
    ref_t = quantize_blockwise(w.transpose(1, 2), block_rows=128)  # the transpose's own blocks
    assert torch.equal(_bits(got.qt), _bits(ref_t.data))


def _dgrad_inputs(routing, hidden, inter, seed):
    """A row table and the FP8 fc2 dgrad's operands on it: (offsets, num_rows, offs, dy
    quantised (dyq, dys), row_w (0 on padding rows), w2 as Fp8Weight, h)."""
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(offs) - 1
    dy = rand_bf16(capacity, hidden, seed=seed, real=real)
    h = rand_bf16(capacity, 2 * inter, seed=seed + 1, scale=2.0)
    row_w = torch.rand(capacity, generator=torch.Generator().manual_seed(seed + 2)).cuda()
    row_w[~real.cuda()] = 0
    w2 = f8.quantize_weights(rand_bf16(E, hidden, inter, seed=seed + 3, scale=inter ** -0.5))
    return offsets, num_rows, offs, f8.quantize_rows(dy), row_w, w2, h


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
def test_fp8_dgrad_swiglu_routed_matches_fp32(routing):
    offsets, num_rows, offs, (dyq, dys), row_w, w2, h = _dgrad_inputs(routing, 1024, 384, 14)
    d_h, dots_part, act_scaled = f8.dgrad_swiglu_routed(dyq, dys, row_w, w2, h, offsets,
                                                        num_rows)
    w2t = BlockwiseFP8Tensor(w2.qt, w2.scale_t, 128)
    for e, lo, hi in segments(offs):
        acc = blockwise_matmul_reference(_rows_as_blockwise(dyq, dys, lo, hi),
                                         _weight_slice(w2t, e))
        g, u = h[lo:hi].float().chunk(2, dim=1)
        sig = torch.sigmoid(g)
        act = g * sig * u
        w = row_w[lo:hi, None]
        d_act = w * acc
        d_ref = torch.cat([d_act * u * sig * (1 + g * (1 - sig)), d_act * g * sig], dim=1)
        assert rel_l2(d_h[lo:hi].float(), d_ref) < GEMM_TOL, e
        assert rel_l2(act_scaled[lo:hi].float(), w * act) < GEMM_TOL, e
        assert rel_l2(dots_part[lo:hi].sum(1), (acc * act).sum(1)) < GEMM_TOL, e


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("inter", [384, 768])
def test_fp8_dgrad_quantises_d_h_as_the_row_quantiser(routing, inter):
    """The fc2 dgrad's epilogue quantises d_h (E4M3 rows, transposed scales) with the bits of
    quantize_rows over the d_h it stores, and the d_h, dots and act_scaled it returns are
    those of the launch without the quantisation."""
    offsets, num_rows, _, (dyq, dys), row_w, w2, h = _dgrad_inputs(routing, 512, inter, 24)
    plain = f8.dgrad_swiglu_routed(dyq, dys, row_w, w2, h, offsets, num_rows)
    d_h, dots_part, act_scaled, (dhq, dhs) = f8.dgrad_swiglu_routed(
        dyq, dys, row_w, w2, h, offsets, num_rows, quantize_dh=True)
    n = int(num_rows)  # rows the kernels write
    for got, want in zip((d_h, dots_part, act_scaled), plain):
        assert torch.equal(got[:n], want[:n])
    want_q, want_s = f8.quantize_rows(d_h[:n].contiguous())
    assert torch.equal(_bits(dhq[:n]), _bits(want_q))
    assert torch.equal(dhs[:, :n], want_s)
    assert bool((dhs[:, :n] != 1).any())  # real groups, not only zero-row scales


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", [(512, 256), (768, 384), (2048, 768)])
def test_fc1_quantises_act_as_the_row_quantiser(routing, hidden, inter):
    """fc1's epilogue quantises act (E4M3 rows, transposed scales) with the bits of
    quantize_rows over the bf16 act the plain launch stores, its h is that launch's, and
    the bits hold for any grid (a CTA running several tile pairs) and cluster size. Outputs
    start poisoned (NaN), so a row or group the kernel skips fails the test."""
    offsets, num_rows, capacity, offs, xq, x_scale_t, w1, act, h = _fc1_case(
        routing, hidden, inter, 31)
    n = offs[-1]  # rows in the segments
    want_q, want_s = f8.quantize_rows(act[:n].contiguous())
    assert bool((want_s != 1).any())  # real groups, not only zero-row scales

    def quantised(ctas, save_h=True):
        act_q = torch.full((capacity, inter), 0x7F, dtype=torch.uint8, device="cuda")
        act_scale_t = torch.full((inter // 128, capacity), float("nan"), device="cuda")
        h_q = torch.full_like(h, float("nan")) if save_h else None
        torch.ops.megatron_mok.grouped_fp8_fc1_swiglu(
            xq, x_scale_t, w1.data, w1.scale, offsets, num_rows, None, h_q, ctas,
            act_q.view(torch.float8_e4m3fn), act_scale_t)
        return act_q, act_scale_t, h_q

    try:
        for cluster, ctas in (("1", 0), ("1", 3), ("2", 0), ("2", 4)):
            knobs.set_env("MOK_GEMM_CLUSTER", cluster)
            aq, a_scale_t, h_q = quantised(ctas)
            assert torch.equal(h_q[:n], h[:n]), (cluster, ctas)
            assert torch.equal(aq[:n], _bits(want_q)), (cluster, ctas)
            assert torch.equal(a_scale_t[:, :n], want_s), (cluster, ctas)
    finally:
        knobs.set_env("MOK_GEMM_CLUSTER", None)
    aq, a_scale_t, _ = quantised(0, save_h=False)
    assert torch.equal(aq[:n], _bits(want_q)) and torch.equal(a_scale_t[:, :n], want_s)
    (aq, _), none = f8.fc1_swiglu(xq, x_scale_t, w1.data, w1.scale, offsets, num_rows,
                                  save_h=False, quantize_act=True)  # the wrapper's outputs
    assert none is None and torch.equal(_bits(aq[:n]), _bits(want_q))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["0", "1"])  # MOK_FP8_FUSED_QUANT: per token or one pass
@pytest.mark.parametrize("num_rows", [640, 384])
@pytest.mark.parametrize("hidden", [512, 640])  # 640: a warp's 4 groups span two rows
def test_gather_quantize_rows_is_the_pull_and_the_quantised_gather(num_rows, hidden, fused,
                                                                   monkeypatch):
    """The gather (EP = 1), the one-pass kernel or the tokens quantised then gathered: its
    E4M3 rows and scales are the gathered bf16 rows quantised, bit for bit; its bf16 rows
    and router weights what pull_rows gives (padding rows zeros with scale 1, weight 0);
    rows below num_rows are written."""
    from types import SimpleNamespace
    monkeypatch.setenv("MOK_FP8_FUSED_QUANT", fused)
    g = torch.Generator().manual_seed(22)
    tokens, capacity, topk = 200, 640, 4
    x = rand_bf16(tokens, hidden, seed=23)
    topk_w = torch.rand(tokens, topk, generator=g).cuda()
    peer_token = torch.randint(0, tokens, (capacity,), generator=g).int()
    peer_k = torch.randint(0, topk, (capacity,), generator=g).int()
    peer_rank = torch.zeros(capacity, dtype=torch.int32)
    pad = torch.rand(capacity, generator=g) < 0.2
    peer_token[pad], peer_rank[pad], peer_k[pad] = -1, -1, -1
    sched = SimpleNamespace(peer_rank=peer_rank.cuda(), peer_token=peer_token.cuda(),
                            peer_k=peer_k.cuda(),
                            num_rows=torch.tensor([num_rows], dtype=torch.int32, device="cuda"))
    (q, scale_t), rows, row_w = f8.gather_quantize_rows(x, sched, topk_w=topk_w, keep_rows=True)
    n = num_rows
    routed = (sched.peer_rank[:n] >= 0)
    tok = sched.peer_token[:n].clamp(min=0).long()
    want_rows = torch.where(routed.unsqueeze(1), x[tok], torch.zeros((), dtype=x.dtype,
                                                                     device="cuda"))
    assert torch.equal(rows[:n], want_rows)
    want_q, want_s = f8.quantize_rows(want_rows)
    assert torch.equal(_bits(q[:n]), _bits(want_q))
    assert torch.equal(scale_t[:, :n], want_s)
    assert bool((scale_t[:, :n][:, ~routed] == 1).all())
    want_w = torch.where(routed, topk_w[tok, sched.peer_k[:n].clamp(min=0).long()], 0.0)
    assert torch.equal(row_w[:n], want_w)
    # Alone (no bf16 copy, no weights): the same E4M3 bits.
    (q2, s2), none_rows, none_w = f8.gather_quantize_rows(x, sched)
    assert none_rows is None and none_w is None
    assert torch.equal(_bits(q2[:n]), _bits(q[:n])) and torch.equal(s2[:, :n], scale_t[:, :n])
    # Rows at and past num_rows are left as they were (sentinels).
    q3 = torch.full_like(q.view(torch.uint8), 0x7E).view(torch.float8_e4m3fn)
    s3 = torch.full_like(scale_t, -5.0)
    rows3, w3 = torch.full_like(rows, 7.0), torch.full_like(row_w, -3.0)
    torch.ops.megatron_mok.gather_quantize_fp8_rows(
        x, sched.peer_rank, sched.peer_token, sched.peer_k, sched.num_rows, topk_w, q3, s3,
        rows3, w3)
    assert torch.equal(_bits(q3[:n]), _bits(q[:n])) and torch.equal(rows3[:n], rows[:n])
    assert bool((_bits(q3[n:]) == 0x7E).all()) and bool((s3[:, n:] == -5.0).all())
    assert bool((rows3[n:] == 7.0).all()) and bool((w3[n:] == -3.0).all())
