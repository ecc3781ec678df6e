"""The Hopper grouped-GEMM core (megatron_mok.kernels.grouped_gemm) against fp32 per-expert GEMMs:
fc1 + SwiGLU, fc2, fc2 dgrad + SwiGLU backward, fc1 dgrad, weight gradients; tails in
every dimension, empty experts, rows past num_rows; bitwise independence of the grid
size. Input validation runs on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from megatron_mok.kernels import grouped_gemm as gg
from moe_inputs import rel_l2

TOL = 1e-2


@pytest.fixture(params=["1", "2"], ids=["cluster1", "cluster2"])
def cluster(request, monkeypatch):
    """MOK_GEMM_CLUSTER: 1 (default) or 2 (CTA pairs on neighbouring row tiles multicasting
    the B tile)."""
    monkeypatch.setenv("MOK_GEMM_CLUSTER", request.param)
    return request.param


def _row_table(counts, extra_tiles=2, device="cuda"):
    """Offsets of segments padded to 128 rows, the rows in use and a row mask of real rows."""
    padded = [-(-c // 128) * 128 for c in counts]
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    capacity = offsets[-1] + extra_tiles * 128
    real = torch.zeros(capacity, dtype=torch.bool)
    for e, c in enumerate(counts):
        real[offsets[e]:offsets[e] + c] = True
    return (torch.tensor(offsets, dtype=torch.int32, device=device),
            torch.tensor([offsets[-1]], dtype=torch.int32, device=device), capacity, real)


def _rows(capacity, cols, real, seed, scale=1.0):
    """bf16 rows with zeros in padding rows (as the dispatch writes them)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(capacity, cols, generator=g) * scale
    a[~real] = 0
    return a.bfloat16().cuda()


def _weights(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16().cuda()


def _segments(offsets):
    o = offsets.tolist()
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1)]


def _swiglu_bwd_ref(d_act, g, u):
    """fp32 d_h = [d_gate, d_up] of act = silu(g) * u."""
    sig = torch.sigmoid(g)
    return torch.cat([d_act * u * sig * (1 + g * (1 - sig)), d_act * g * sig], dim=-1)


COUNTS = {
    "balanced": [256, 256, 256, 256],
    "ragged": [1, 0, 300, 129, 0, 77],       # empty experts, sub-tile and multi-tile segments
    "one-expert": [0, 0, 700, 0],
}
DIMS = [(256, 128), (320, 200), (2880, 2880)]  # (H, I): whole tiles and tails


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_forward_ops_match_fp32(routing, hidden, inter, cluster):
    counts = COUNTS[routing]
    offsets, num_rows, capacity, real = _row_table(counts)
    E = len(counts)
    x = _rows(capacity, hidden, real, seed=1)
    w1 = _weights(E, 2 * inter, hidden, seed=2)
    w2 = _weights(E, hidden, inter, seed=3)
    act, h = gg.fc1_swiglu(x, w1, offsets, num_rows)
    y = gg.rows_matmul(act, w2, offsets, num_rows)
    for e, lo, hi in _segments(offsets):
        if hi == lo:
            continue
        h_ref = x[lo:hi].float() @ w1[e].float().t()
        gate, up = h_ref.chunk(2, dim=-1)
        act_ref = F.silu(gate) * up
        assert rel_l2(h[lo:hi].float(), h_ref) < TOL, e
        assert rel_l2(act[lo:hi].float(), act_ref) < TOL, e
        y_ref = act[lo:hi].float() @ w2[e].float().t()
        assert rel_l2(y[lo:hi].float(), y_ref) < TOL, e
        assert torch.all(act[lo:hi][~real[lo:hi].cuda()] == 0)  # padding rows stay zero


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_backward_ops_match_fp32(routing, hidden, inter, cluster):
    counts = COUNTS[routing]
    offsets, num_rows, capacity, real = _row_table(counts)
    E = len(counts)
    x = _rows(capacity, hidden, real, seed=4)
    d_out = _rows(capacity, hidden, real, seed=5)
    h = _rows(capacity, 2 * inter, real, seed=6, scale=2.0)
    w1 = _weights(E, 2 * inter, hidden, seed=7)
    w2 = _weights(E, hidden, inter, seed=8)
    d_h = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows)
    dx = gg.rows_matmul(d_h, w1, offsets, num_rows, w_transposed=True)
    gate, up = h.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).bfloat16()
    dw2 = gg.wgrad(d_out, act, offsets)
    dw1 = gg.wgrad(d_h, x, offsets, out_dtype=torch.float32)
    assert dw1.dtype == torch.float32 and dw2.dtype == torch.bfloat16
    for e, lo, hi in _segments(offsets):
        if hi == lo:  # an expert without rows has zero weight gradients
            assert torch.all(dw1[e] == 0) and torch.all(dw2[e] == 0)
            continue
        d_act = d_out[lo:hi].float() @ w2[e].float()
        d_h_ref = _swiglu_bwd_ref(d_act, gate[lo:hi], up[lo:hi])
        assert rel_l2(d_h[lo:hi].float(), d_h_ref) < TOL, e
        assert rel_l2(dx[lo:hi].float(), d_h[lo:hi].float() @ w1[e].float()) < TOL, e
        assert rel_l2(dw2[e].float(), d_out[lo:hi].float().t() @ act[lo:hi].float()) < TOL, e
        assert rel_l2(dw1[e], d_h[lo:hi].float().t() @ x[lo:hi].float()) < TOL, e


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS + [(512, 1408)])
def test_dgrad_swiglu_routed_matches_fp32_and_its_bits_hold(routing, hidden, inter, monkeypatch):
    """The router weights applied in the epilogue: d_h is the SwiGLU backward of w * (dy @ w2),
    the partials sum to <dy @ w2, act> = <dy, act @ w2^T> (the router weight's gradient, <dy,
    y_row>), act_scaled = w * act; padding rows (w = 0, dy = 0) give zeros. The same bits
    for h through the ring or from global memory, clusters of 1 or 2 and any grid size."""
    monkeypatch.delenv("MOK_GEMM_PINGPONG", raising=False)
    counts = COUNTS[routing]
    offsets, num_rows, capacity, real = _row_table(counts)
    E = len(counts)
    dy_rows = _rows(capacity, hidden, real, seed=51)
    h = _rows(capacity, 2 * inter, real, seed=52, scale=3.0)
    w2 = _weights(E, hidden, inter, seed=53)
    g = torch.Generator().manual_seed(54)
    row_w = (torch.rand(capacity, generator=g) * real).cuda()
    used = int(num_rows.item())
    runs = {}
    for name, env, max_ctas in (("ring", {"MOK_GEMM_CLUSTER": "1"}, 0),
                                ("ring-5", {"MOK_GEMM_CLUSTER": "1"}, 5),
                                ("global", {"MOK_GEMM_CLUSTER": "1", "MOK_DGRAD_H": "global"}, 0),
                                ("cluster2", {"MOK_GEMM_CLUSTER": "2"}, 1)):
        monkeypatch.delenv("MOK_DGRAD_H", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        out = gg.dgrad_swiglu_routed(dy_rows, row_w, w2, h, offsets, num_rows,
                                     max_ctas=max_ctas)
        runs[name] = [t[:used] for t in out]
    d_h, dots_part, act_scaled = runs["ring"]
    assert dots_part.shape[1] == gg.dgrad_col_tiles(inter)
    for name, other in runs.items():
        for a, b in zip(other, runs["ring"]):
            assert torch.equal(a, b), name
    gate, up = h.float().chunk(2, dim=-1)
    act = F.silu(gate) * up
    w = row_w[:, None]
    dots, dots_exact, dots_y = (torch.zeros(used, device="cuda") for _ in range(3))
    for e, lo, hi in _segments(offsets):
        if hi == lo:
            continue
        acc = dy_rows[lo:hi].float() @ w2[e].float()
        ref = _swiglu_bwd_ref(w[lo:hi] * acc, gate[lo:hi], up[lo:hi])
        assert rel_l2(d_h[lo:hi].float(), ref) < TOL, e
        assert rel_l2(act_scaled[lo:hi].float(), w[lo:hi] * act[lo:hi]) < TOL, e
        dots[lo:hi] = dots_part[lo:hi].sum(1)
        dots_exact[lo:hi] = (acc * act[lo:hi]).sum(1)  # the kernel's arithmetic, in fp32
        y_rows = act[lo:hi].bfloat16().float() @ w2[e].float().t()
        dots_y[lo:hi] = (dy_rows[lo:hi].float() * y_rows).sum(1)  # <dy, y_row> of bf16 act
    # Per row against the same arithmetic (only fp32 summation order differs); against
    # <dy, y_row> over all rows at once: a one-row expert's single dot can sit near zero,
    # where bf16(act)'s rounding alone is a large relative error.
    assert torch.allclose(dots, dots_exact, rtol=1e-4, atol=1e-4 * dots_exact.abs().max())
    assert rel_l2(dots, dots_y) < TOL
    pad = ~real[:used].cuda()
    assert torch.count_nonzero(d_h[pad]) == 0 and torch.count_nonzero(act_scaled[pad]) == 0
    assert torch.count_nonzero(dots_part[pad]) == 0


@pytest.mark.gpu
def test_dgrad_swiglu_routed_rejects_bad_weights():
    offsets, num_rows, capacity, real = _row_table([128])
    dy_rows, h = _rows(capacity, 256, real, seed=1), _rows(capacity, 256, real, seed=2)
    w2 = _weights(1, 256, 128, seed=3)
    for bad in (torch.ones(capacity, device="cuda", dtype=torch.bfloat16),
                torch.ones(capacity - 1, device="cuda")):
        with pytest.raises(ValueError, match="row_w must be float32"):
            gg.dgrad_swiglu_routed(dy_rows, bad, w2, h, offsets, num_rows)
    with pytest.raises(ValueError, match="row_w must be on a CUDA device"):
        gg.dgrad_swiglu_routed(dy_rows, torch.ones(capacity), w2, h, offsets, num_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS + [(512, 1408)])
def test_dgrad_swiglu_h_through_ring_same_bits_as_global(routing, hidden, inter, monkeypatch):
    """Core v5: the dgrad + SwiGLU-backward epilogue reads h from ring stages that the
    producer filled by TMA (default) instead of from global memory (MOK_DGRAD_H=global).
    Same values, same arithmetic: the same bits, with column tails (I = 200, 1408: chunks
    past I are zero-filled), ragged and empty experts and any grid size."""
    monkeypatch.setenv("MOK_GEMM_CLUSTER", "1")  # clusters of 2 always read h globally
    monkeypatch.delenv("MOK_GEMM_PINGPONG", raising=False)
    counts = COUNTS[routing]
    offsets, num_rows, capacity, real = _row_table(counts)
    E = len(counts)
    d_out = _rows(capacity, hidden, real, seed=41)
    h = _rows(capacity, 2 * inter, real, seed=42, scale=3.0)
    w2 = _weights(E, hidden, inter, seed=43)
    used = int(num_rows.item())
    monkeypatch.setenv("MOK_DGRAD_H", "global")
    d_h_global = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows)[:used]
    monkeypatch.delenv("MOK_DGRAD_H")
    for max_ctas in (0, 1, 5):
        d_h_ring = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows, max_ctas=max_ctas)[:used]
        assert torch.equal(d_h_ring, d_h_global), max_ctas
    # And the values are the SwiGLU backward of d_out @ w2 (not merely equal to each other).
    gate, up = h.float().chunk(2, dim=-1)
    for e, lo, hi in _segments(offsets):
        if hi == lo:
            continue
        d_act = d_out[lo:hi].float() @ w2[e].float()
        ref = _swiglu_bwd_ref(d_act, gate[lo:hi], up[lo:hi])
        assert rel_l2(d_h_ring[lo:hi].float(), ref) < TOL, e


@pytest.mark.gpu
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS + [(512, 1408)])
@pytest.mark.parametrize("scheduler", ["counter", "static"])
def test_pingpong_kernel_matches_fp32_and_is_deterministic(routing, hidden, inter, scheduler,
                                                           monkeypatch):
    """Core v6 (MOK_GEMM_PINGPONG=1): fc2, the fc1 dgrad and the fused fc2 dgrad + SwiGLU
    backward on the ping-pong kernel (128 x 128 tiles, the two consumer warpgroups on
    alternate tiles) against fp32 per-expert GEMMs, with column tails and ragged / empty
    experts; and the same bits for any grid size (1, 3, 7 CTAs, all)."""
    monkeypatch.setenv("MOK_GEMM_PINGPONG", "1")
    monkeypatch.setenv("MOK_GEMM_CLUSTER", "1")
    monkeypatch.setenv("MOK_DGRAD_H", "ring")
    # Static striding: the warpgroups step over each other's stages with no task queue
    # keeping the producer ahead (the mainloop turn must).
    monkeypatch.setenv("MOK_GEMM_SCHEDULER", scheduler)
    counts = COUNTS[routing]
    offsets, num_rows, capacity, real = _row_table(counts)
    E = len(counts)
    act = _rows(capacity, inter, real, seed=51)
    d_out = _rows(capacity, hidden, real, seed=52)
    h = _rows(capacity, 2 * inter, real, seed=53, scale=2.0)
    w1 = _weights(E, 2 * inter, hidden, seed=54)
    w2 = _weights(E, hidden, inter, seed=55)
    used = int(num_rows.item())

    def run(max_ctas):
        y = gg.rows_matmul(act, w2, offsets, num_rows, max_ctas=max_ctas)
        d_h = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows, max_ctas=max_ctas)
        dx = gg.rows_matmul(d_h, w1, offsets, num_rows, w_transposed=True, max_ctas=max_ctas)
        return [t[:used] for t in (y, d_h, dx)]

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, d_h, dx = base = run(0)
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages()]
    assert sum("grouped_gemm_pingpong_kernel" in k for k in kernels) == 3, kernels  # it ran
    gate, up = h.float().chunk(2, dim=-1)
    for e, lo, hi in _segments(offsets):
        if hi == lo:
            continue
        assert rel_l2(y[lo:hi].float(), act[lo:hi].float() @ w2[e].float().t()) < TOL, e
        d_act = d_out[lo:hi].float() @ w2[e].float()
        ref = _swiglu_bwd_ref(d_act, gate[lo:hi], up[lo:hi])
        assert rel_l2(d_h[lo:hi].float(), ref) < TOL, e
        assert rel_l2(dx[lo:hi].float(), d_h[lo:hi].float() @ w1[e].float()) < TOL, e
    for max_ctas in (1, 3, 7):
        for a, b in zip(base, run(max_ctas)):
            assert torch.equal(a, b), max_ctas


@pytest.mark.gpu
@pytest.mark.parametrize("gap, reverse", [(0, True), (320 * 8, False), (320 * 8, True)])
def test_wgrad_accumulates_into_per_expert_buffers(gap, reverse):
    """main_grads that lie apart (a gap between experts, as a SequentialMLP's fc1 and fc2
    interleave in Megatron's grad buffer) and/or backwards (that buffer's parameter order):
    one launch adds expert e's gradient into its own buffer, bit for bit start + dw."""
    offsets, num_rows, capacity, real = _row_table(COUNTS["ragged"])
    a = _rows(capacity, 200, real, seed=31)
    b = _rows(capacity, 320, real, seed=32)
    E, step = offsets.numel() - 1, 200 * 320 + gap
    g = torch.Generator().manual_seed(33)
    buffer = torch.randn(E * step, generator=g).cuda()  # the grad buffer, gaps included
    planes = buffer.as_strided((E, 200, 320), (step, 320, 1))
    start = buffer.clone()
    main_grads = [planes[E - 1 - e] if reverse else planes[e] for e in range(E)]
    dw = gg.wgrad(a, b, offsets, out_dtype=torch.float32)
    gg.wgrad(a, b, offsets, accumulate_into=planes, reverse_experts=reverse)
    expected = start.clone()
    expected_planes = expected.as_strided((E, 200, 320), (step, 320, 1))
    for e in range(E):
        (expected_planes[E - 1 - e] if reverse else expected_planes[e]).add_(dw[e])
    assert torch.equal(buffer, expected)  # gaps untouched, every expert in its buffer
    assert all(torch.equal(main_grads[e], expected_planes[E - 1 - e if reverse else e])
               for e in range(E))


@pytest.mark.gpu
def test_wgrad_accumulates_into_fp32_main_grad(cluster):
    """Megatron's gradient-accumulation fusion: main_grad += dW with one fp32 add per element,
    so it equals main_grad + (the fp32 wgrad) bit for bit, twice in a row."""
    offsets, num_rows, capacity, real = _row_table(COUNTS["ragged"])
    a = _rows(capacity, 200, real, seed=21)
    b = _rows(capacity, 320, real, seed=22)
    E = offsets.numel() - 1
    g = torch.Generator().manual_seed(23)
    main_grad = torch.randn(E, 200, 320, generator=g).cuda()
    start = main_grad.clone()
    dw = gg.wgrad(a, b, offsets, out_dtype=torch.float32)
    assert gg.wgrad(a, b, offsets, accumulate_into=main_grad) is main_grad
    assert torch.equal(main_grad, start + dw)
    gg.wgrad(a, b, offsets, accumulate_into=main_grad)
    assert torch.equal(main_grad, (start + dw) + dw)
    for e, lo, hi in _segments(offsets):  # and dw itself is right (empty experts add 0)
        ref = a[lo:hi].float().t() @ b[lo:hi].float() if hi > lo else torch.zeros_like(dw[e])
        assert rel_l2(main_grad[e] - start[e], 2 * ref) < TOL or hi == lo, e
        if hi == lo:
            assert torch.equal(main_grad[e], start[e])


@pytest.mark.gpu
def test_rows_past_num_rows_are_not_computed(cluster):
    offsets, num_rows, capacity, real = _row_table([200, 60], extra_tiles=3)
    x = _rows(capacity, 256, real, seed=9)
    w2 = _weights(2, 128, 256, seed=10)
    out = torch.full((capacity, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    torch.ops.megatron_mok.grouped_gemm_rows(x, w2, offsets, num_rows, False, out, 0)
    used = int(num_rows.item())
    assert torch.all(out[used:] == 7.0)
    assert rel_l2(out[:200].float(), x[:200].float() @ w2[0].float().t()) < TOL


@pytest.mark.gpu
def test_bitwise_independent_of_grid_size_and_repeatable(monkeypatch):
    offsets, num_rows, capacity, real = _row_table(COUNTS["ragged"])
    E, hidden, inter = 6, 320, 200
    x = _rows(capacity, hidden, real, seed=11)
    d_out = _rows(capacity, hidden, real, seed=12)
    w1 = _weights(E, 2 * inter, hidden, seed=13)
    w2 = _weights(E, hidden, inter, seed=14)

    def run(max_ctas):
        act, h = gg.fc1_swiglu(x, w1, offsets, num_rows, max_ctas=max_ctas)
        y = gg.rows_matmul(act, w2, offsets, num_rows, max_ctas=max_ctas)
        d_h = gg.dgrad_swiglu(d_out, w2, h, offsets, num_rows, max_ctas=max_ctas)
        dx = gg.rows_matmul(d_h, w1, offsets, num_rows, True, max_ctas=max_ctas)
        dw1 = gg.wgrad(d_h, x, offsets, max_ctas=max_ctas)
        dw2 = gg.wgrad(d_out, act, offsets, max_ctas=max_ctas)
        used = int(num_rows.item())
        return [t[:used] for t in (act, h, y, d_h, dx)] + [dw1, dw2]

    base = run(0)
    # Neither the cluster size nor the scheduler (global task counter or static striding;
    # clusters always stride) may change a bit.
    for cluster, scheduler in (("1", "counter"), ("1", "static"), ("2", "static")):
        monkeypatch.setenv("MOK_GEMM_CLUSTER", cluster)
        monkeypatch.setenv("MOK_GEMM_SCHEDULER", scheduler)
        for max_ctas in (0, 1, 3, 17):
            for a, b in zip(base, run(max_ctas)):
                assert torch.equal(a, b), (cluster, scheduler, max_ctas)


@pytest.mark.gpu
def test_cuda_graph_capture_and_no_host_sync():
    offsets, num_rows, capacity, real = _row_table(COUNTS["balanced"])
    x = _rows(capacity, 256, real, seed=15)
    w1 = _weights(4, 256, 256, seed=16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        act_eager, _ = gg.fc1_swiglu(x, w1, offsets, num_rows)
        d_h = gg.dgrad_swiglu(x, w1[:, :, :128].contiguous(),
                              torch.cat([act_eager, act_eager], 1), offsets, num_rows)
        gg.wgrad(d_h, x, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            act_graph, _ = gg.fc1_swiglu(x, w1, offsets, num_rows)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    used = int(num_rows.item())  # rows past num_rows are not computed (uninitialised)
    assert torch.equal(act_graph[:used], act_eager[:used])


# ----------------------------------------------------------------------- validation (CPU)

def test_bad_inputs_raise_before_launch():
    offsets = torch.tensor([0, 128], dtype=torch.int32)
    num_rows = torch.tensor([128], dtype=torch.int32)
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    w1 = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x_rows must be torch.bfloat16"):
        gg.fc1_swiglu(x.float(), w1, offsets, num_rows)
    with pytest.raises(ValueError, match="w1 must have 3 dimensions"):
        gg.fc1_swiglu(x, w1[0], offsets, num_rows)
    with pytest.raises(ValueError, match=r"w1 must be \[E, 2I, 64\]"):
        gg.fc1_swiglu(x, w1[:, :, :32].contiguous(), offsets, num_rows)
    with pytest.raises(ValueError, match="multiple of 128 rows"):
        gg.fc1_swiglu(x[:100], w1, offsets, num_rows)
    with pytest.raises(ValueError, match="expert_offsets must have 3 entries"):
        gg.fc1_swiglu(x, torch.zeros(2, 64, 64, dtype=torch.bfloat16), offsets, num_rows)
    with pytest.raises(ValueError, match="inter=20 must be a positive multiple of 8"):
        gg.fc1_swiglu(x, torch.zeros(1, 40, 64, dtype=torch.bfloat16), offsets, num_rows)
    with pytest.raises(ValueError, match="inter=0 must be a positive multiple of 8"):
        gg.fc1_swiglu(x, torch.zeros(1, 0, 64, dtype=torch.bfloat16), offsets, num_rows)
    with pytest.raises(ValueError, match="x_rows must be on a CUDA device"):
        gg.fc1_swiglu(x, w1, offsets, num_rows)
    with pytest.raises(ValueError, match="must be contiguous|CUDA device"):
        gg.rows_matmul(x, w1.transpose(1, 2), offsets, num_rows)
    with pytest.raises(TypeError, match="wgrad out_dtype"):
        gg.wgrad(x, x, offsets, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="same rows"):
        gg.wgrad(x, x[:64], offsets)
    with pytest.raises(TypeError, match="accumulate_into must be torch.float32"):
        gg.wgrad(x, x, offsets, accumulate_into=torch.zeros(1, 64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"accumulate_into must be \[1, 64, 64\]"):
        gg.wgrad(x, x, offsets, accumulate_into=torch.zeros(1, 64, 32))
    with pytest.raises(ValueError, match="accumulate_into must hold dense"):  # misaligned
        gg.wgrad(x, x, offsets, accumulate_into=torch.zeros(1 + 64 * 64)[1:].view(1, 64, 64))
    with pytest.raises(ValueError, match="accumulate_into must hold dense"):  # planes not dense
        gg.wgrad(x, x, offsets, accumulate_into=torch.zeros(1, 64, 64).transpose(1, 2))
    # Planes apart by a stride that is not a multiple of 16 bytes.
    apart = torch.zeros(2 * 64 * 64 + 2).as_strided((2, 64, 64), (64 * 64 + 1, 64, 1))
    with pytest.raises(ValueError, match="accumulate_into must hold dense"):
        gg.wgrad(x, x, torch.tensor([0, 64, 128], dtype=torch.int32), accumulate_into=apart)
    with pytest.raises(ValueError, match="reverse_experts needs accumulate_into"):
        gg.wgrad(x, x, offsets, reverse_experts=True)
    with pytest.raises(TypeError, match="wgrad accumulates in float32"):
        gg.wgrad(x, x, offsets, out_dtype=torch.bfloat16,
                 accumulate_into=torch.zeros(1, 64, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [320, 2048])
def test_wgrad_gathering_its_rows_gives_the_bits_of_gathered_rows(n):
    """MOK_WGRAD_GATHER's kernel: b given as the tokens and a row table (token per row,
    padding rows zero) gives the bits of passing the gathered rows, for bf16 and fp32 outputs
    and accumulated into main_grad planes."""
    offsets, num_rows, capacity, real = _row_table(COUNTS["ragged"])
    g = torch.Generator().manual_seed(41)
    tokens = 300
    x = (torch.randn(tokens, n, generator=g)).bfloat16().cuda()
    peer_token = torch.randint(0, tokens, (capacity,), generator=g).int()
    peer_rank = torch.zeros(capacity, dtype=torch.int32)
    peer_rank[~real], peer_token[~real] = -1, -1
    pad = torch.rand(capacity, generator=g) < 0.05  # a few padding rows inside segments too
    peer_rank[pad], peer_token[pad] = -1, -1
    peer_rank, peer_token = peer_rank.cuda(), peer_token.cuda()
    routed = (peer_rank >= 0).unsqueeze(1)
    rows = torch.where(routed, x[peer_token.clamp(min=0).long()], torch.zeros((), dtype=x.dtype,
                                                                          device="cuda"))
    a = _rows(capacity, 256, real, seed=42)
    gather = (peer_rank, peer_token)
    assert torch.equal(gg.wgrad(a, x, offsets, gather=gather), gg.wgrad(a, rows, offsets))
    # Few CTAs: each walks several tasks (the ring across tasks, empty experts mid-stream).
    assert torch.equal(gg.wgrad(a, x, offsets, gather=gather, max_ctas=4),
                       gg.wgrad(a, rows, offsets))
    dw32 = gg.wgrad(a, rows, offsets, out_dtype=torch.float32)
    assert torch.equal(gg.wgrad(a, x, offsets, out_dtype=torch.float32, gather=gather), dw32)
    main_grad = torch.randn(offsets.numel() - 1, 256, n, generator=g).cuda()
    start = main_grad.clone()
    gg.wgrad(a, x, offsets, accumulate_into=main_grad, gather=gather)
    assert torch.equal(main_grad, start + dw32)
    # dW2's form: a (dy) gathered, b given as rows; and both gathered.
    b = _rows(capacity, 256, real, seed=43)
    assert torch.equal(gg.wgrad(x, b, offsets, gather=gather, gathered="a"),
                       gg.wgrad(rows, b, offsets))
    assert torch.equal(gg.wgrad(x, b, offsets, gather=gather, gathered="a", max_ctas=3),
                       gg.wgrad(rows, b, offsets))
    planes = torch.zeros(offsets.numel() - 1, n, 256, device="cuda")
    gg.wgrad(x, b, offsets, gather=gather, gathered="a", accumulate_into=planes,
             reverse_experts=True)
    assert torch.equal(planes.flip(0), gg.wgrad(rows, b, offsets, out_dtype=torch.float32))
    assert torch.equal(gg.wgrad(x, x, offsets, gather=gather, gathered="ab"),
                       gg.wgrad(rows, rows, offsets))
    with pytest.raises(ValueError, match="int32"):
        gg.wgrad(a, x, offsets, gather=(peer_rank.long(), peer_token))
    with pytest.raises(ValueError, match="multiple of 64"):
        gg.wgrad(a, x[:, :40].contiguous(), offsets, gather=gather)
