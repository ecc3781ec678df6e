"""The kernel backend's general GLU (GPT-OSS's clamped quick_gelu GLU with its linear
offset; clamped silu) and expert biases, in the core's epilogues and the megakernels:
each op against fp32 per-expert math (the clamp exercised: |h| reaches past it), the
bias gradients' segmented sums, and the layer (chain and megakernels, forward and
backward, b1 and b2 gradients included) against the reference, bitwise deterministic and
bit-equal between the launch chain and the megakernels."""

import pytest
import torch

from megatron_mok import activations as A
from megatron_mok import functional as mok
from megatron_mok.config import MoKConfig
from megatron_mok.kernels import grouped_gemm as gg
from moe_inputs import make_moe_inputs, rel_l2
from row_tables import COUNTS, rand_bf16, row_table, segments

pytestmark = pytest.mark.gpu

TOL = 1e-2
CLAMPED_SILU = A.ExpertActivation("silu", gated=True, clamp=2.5, linear_offset=0.5)
ACTIVATIONS = [A.GPT_OSS, CLAMPED_SILU]
DIMS = [(320, 200), (512, 1408)]  # (H, I): column tails of every tile width


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.describe())
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_fc1_glu_with_bias_and_fc2_bias_match_fp32(activation, routing, hidden, inter):
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(COUNTS[routing])
    x = rand_bf16(capacity, hidden, seed=1, real=real)
    w1 = rand_bf16(E, 2 * inter, hidden, seed=2, scale=4 * hidden ** -0.5)  # |h| past the clamp
    b1 = rand_bf16(E, 2 * inter, seed=3)
    w2 = rand_bf16(E, hidden, inter, seed=4, scale=inter ** -0.5)
    b2 = rand_bf16(E, hidden, seed=5)
    glu = activation.kernel_glu
    used = int(num_rows.item())  # rows past it are never written
    act, h = gg.fc1_swiglu(x, w1, offsets, num_rows, bias=b1, glu=glu)
    act_1, h_1 = gg.fc1_swiglu(x, w1, offsets, num_rows, bias=b1, glu=glu, max_ctas=3)
    assert torch.equal(act[:used], act_1[:used]) and torch.equal(h[:used], h_1[:used])
    y = gg.rows_matmul(act, w2, offsets, num_rows, bias=b2)
    y_1 = gg.rows_matmul(act, w2, offsets, num_rows, bias=b2, max_ctas=5)
    assert torch.equal(y[:used], y_1[:used])
    clamped = 0
    for e, lo, hi in segments(offs):
        h_ref = x[lo:hi].float() @ w1[e].float().t() + b1[e].float()
        clamped += int((h_ref[:, :inter] > activation.clamp).sum())
        assert rel_l2(h[lo:hi].float(), h_ref) < TOL, e
        act_ref = activation(h_ref)
        assert rel_l2(act[lo:hi].float(), act_ref) < TOL, e
        y_ref = act[lo:hi].float() @ w2[e].float().t() + b2[e].float()
        assert rel_l2(y[lo:hi].float(), y_ref) < TOL, e
    assert clamped > 0  # the clamp was exercised
    # A NaN in fc1's output stays a NaN through the clamp (torch.clamp's semantics).
    e, lo, hi = segments(offs)[0]
    x_nan = x.clone()
    x_nan[lo, 0] = float("nan")
    act_nan, _ = gg.fc1_swiglu(x_nan, w1, offsets, num_rows, bias=b1, glu=glu)
    assert torch.isnan(act_nan[lo]).all() and not torch.isnan(act_nan[lo + 1:used]).any()
    # SwiGLU keeps its own epilogue; its bias goes through the same add.
    act_s, h_s = gg.fc1_swiglu(x, w1, offsets, num_rows, bias=b1)
    e, lo, hi = segments(offs)[0]
    h_ref = x[lo:hi].float() @ w1[e].float().t() + b1[e].float()
    assert rel_l2(act_s[lo:hi].float(), A.SWIGLU(h_ref)) < TOL


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a.describe())
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_dgrad_glu_routed_matches_its_closed_form(activation, routing, hidden, inter,
                                                  monkeypatch):
    """d_h is the GLU backward of w * (dy @ w2) (zero where the clamp cut the gradient), the
    partials sum to <acc, act>, act_scaled = w * act; the same bits for h through the ring
    or from global memory and any grid size."""
    monkeypatch.setenv("MOK_GEMM_CLUSTER", "1")
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(COUNTS[routing])
    dy = rand_bf16(capacity, hidden, seed=11, real=real)
    h = rand_bf16(capacity, 2 * inter, seed=12, scale=5.0, real=real)
    w2 = rand_bf16(E, hidden, inter, seed=13, scale=inter ** -0.5)
    row_w = (torch.rand(capacity, generator=torch.Generator().manual_seed(14)) * real).cuda()
    glu = activation.kernel_glu
    used = int(num_rows.item())
    runs = []
    for h_path, max_ctas in (("ring", 0), ("ring", 5), ("global", 0)):
        monkeypatch.setenv("MOK_DGRAD_H", h_path)
        out = gg.dgrad_swiglu_routed(dy, row_w, w2, h, offsets, num_rows, glu=glu,
                                     max_ctas=max_ctas)
        runs.append([t[:used] for t in out])
    for other in runs[1:]:
        for a, b in zip(other, runs[0]):
            assert torch.equal(a, b)
    d_h, dots_part, act_scaled = runs[0]
    act = activation(h.float())
    w = row_w[:, None]
    for e, lo, hi in segments(offs):
        acc = dy[lo:hi].float() @ w2[e].float()
        ref = A.glu_backward(activation, h[lo:hi], w[lo:hi] * acc)
        assert rel_l2(d_h[lo:hi].float(), ref) < TOL, e
        assert rel_l2(act_scaled[lo:hi].float(), w[lo:hi] * act[lo:hi]) < TOL, e
        dots = (acc * act[lo:hi]).sum(1)
        assert torch.allclose(dots_part[lo:hi].sum(1), dots, rtol=1e-4,
                              atol=1e-4 * dots.abs().max())
    # Where the clamp is active the gradient is cut: exact zeros.
    g, u = h[:used].float().chunk(2, dim=-1)
    assert torch.count_nonzero(d_h[:used, :inter][g > activation.clamp]) == 0
    assert torch.count_nonzero(d_h[:used, inter:][u.abs() > activation.clamp]) == 0
    # The unrouted variant (no router weights) gives the GLU backward of dy @ w2 itself.
    d_h_plain = gg.dgrad_swiglu(dy, w2, h, offsets, num_rows, glu=glu)[:used]
    e, lo, hi = segments(offs)[-1]
    ref = A.glu_backward(activation, h[lo:hi], dy[lo:hi].float() @ w2[e].float())
    assert rel_l2(d_h_plain[lo:hi].float(), ref) < TOL


@pytest.mark.parametrize("routing", list(COUNTS))
def test_segment_column_sums_are_exact_per_expert_sums(routing):
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    rows = rand_bf16(capacity, 1416, seed=21, real=real)
    scale = torch.rand(capacity, generator=torch.Generator().manual_seed(22)).cuda()
    for s in (None, scale):
        out = gg.segment_column_sums(rows, offsets, num_rows, scale=s)
        assert torch.equal(out, gg.segment_column_sums(rows, offsets, num_rows, scale=s))
        for e in range(len(offs) - 1):
            lo, hi = offs[e], offs[e + 1]
            seg = rows[lo:hi].double() * (1 if s is None else s[lo:hi, None].double())
            # fp32 sums of up to 300 rows (~2e-5 off); a row missed or added is ~1 off.
            torch.testing.assert_close(out[e].double(), seg.sum(0), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="scale must be"):
        gg.segment_column_sums(rows, offsets, num_rows, scale=scale[:-1])


@pytest.mark.parametrize("routing", list(COUNTS))
def test_segment_row_dots_are_each_rows_dot_with_its_experts_vector(routing):
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    rows = rand_bf16(capacity, 2888, seed=31, real=real)
    vecs = rand_bf16(len(offs) - 1, 2888, seed=32)
    out = gg.segment_row_dots(rows, vecs, offsets, num_rows)
    assert torch.equal(out, gg.segment_row_dots(rows, vecs, offsets, num_rows))
    for e in range(len(offs) - 1):
        lo, hi = offs[e], offs[e + 1]
        ref = rows[lo:hi].double() @ vecs[e].double()
        torch.testing.assert_close(out[lo:hi].double(), ref, rtol=1e-4, atol=1e-3)
    assert torch.count_nonzero(out[offs[-1]:]) == 0  # past num_rows


def _layer_inputs(seed, hidden=512, inter=384, experts=8, topk=4, tokens=600):
    inputs = make_moe_inputs(num_tokens=tokens, hidden=hidden, inter=inter,
                             num_local_experts=experts, topk=topk, seed=seed,
                             drop_fraction=0.05, device="cuda")
    g = torch.Generator().manual_seed(seed + 7)
    # |h| past GPT-OSS's clamp of 7 for ~0.1 % of the values. (Near the clamp the kernels'
    # backward masks the gradient by the bf16 h the forward saved, the fp32 spec by its fp32
    # h: a value within one bf16 step of the clamp can fall on the other side. Measured on
    # an H100: with w1 scaled 4x (|h| > 7 for ~8 %) that alone put dx 2.8 % off the spec.)
    inputs["w1"] = (inputs["w1"].float() * 2).bfloat16()
    inputs["b1"] = (torch.randn(experts, 2 * inter, generator=g)).bfloat16().cuda()
    inputs["b2"] = (torch.randn(experts, hidden, generator=g) * 0.1).bfloat16().cuda()
    return inputs


GRAD_NAMES = ("x", "topk_w", "w1", "w2", "b1", "b2")


def _run(inputs, config, dy):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, config=config)
    y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in GRAD_NAMES}


@pytest.mark.parametrize("activation", [A.GPT_OSS, A.SWIGLU], ids=lambda a: a.describe())
def test_layer_with_glu_and_biases_matches_reference_on_every_path(activation, monkeypatch):
    inputs = _layer_inputs(seed=5)
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(6)).bfloat16().cuda()
    kernel = MoKConfig(backend="kernel", activation=activation, expert_bias=True)
    if activation.clamp is not None:  # the clamp is exercised
        h = inputs["x"].float() @ inputs["w1"].float().flatten(0, 1).t()
        assert int((h.abs() > activation.clamp).sum()) > 100
    y_ref, g_ref = _run(inputs, MoKConfig(backend="reference", activation=activation,
                                          expert_bias=True), dy)
    results = {}
    for name, forward, backward in (("chain", "launches", "launches"),
                                    ("megakernels", "megakernel-spread", "megakernel"),
                                    ("direct", "megakernel", "megakernel")):
        monkeypatch.setenv("MOK_FORWARD", forward)
        monkeypatch.setenv("MOK_BACKWARD", backward)
        y, grads = _run(inputs, kernel, dy)
        assert rel_l2(y, y_ref) < TOL, name
        for k in GRAD_NAMES:
            assert grads[k].dtype == inputs[k].dtype, (name, k)
            assert rel_l2(grads[k], g_ref[k]) < TOL, (name, k)
        y2, grads2 = _run(inputs, kernel, dy)  # bitwise deterministic
        assert torch.equal(y, y2) and all(torch.equal(grads[k], grads2[k]) for k in GRAD_NAMES)
        results[name] = (y, grads)
    y0, g0 = results["chain"]
    for name, (y, grads) in results.items():  # the megakernels are the chain's bits
        assert torch.equal(y, y0), name
        assert all(torch.equal(grads[k], g0[k]) for k in GRAD_NAMES), name


def test_autotune_times_the_glu_and_bias_epilogues_under_their_own_key(tmp_path, monkeypatch):
    """tune() / tune_backward() with GPT-OSS's config and biases run that layer's epilogues
    (the tuned forward's output equals the chain's with the biases in it) and store the
    winners under the variant's key, which the biased GLU layer then reads; the plain
    SwiGLU key stays empty."""
    from megatron_mok.kernels import autotune, backend, tuning
    monkeypatch.setenv("MOK_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("MOK_FORWARD", raising=False)
    monkeypatch.delenv("MOK_BACKWARD", raising=False)
    autotune.forget_cache()
    inputs = _layer_inputs(seed=9)
    config = MoKConfig(backend="kernel", activation=A.GPT_OSS, expert_bias=True)
    x, w1, w2, b1, b2 = (inputs[k] for k in ("x", "w1", "w2", "b1", "b2"))
    tokens, topk = inputs["topk_idx"].shape
    ws = mok.get_workspace(config, None, device="cuda", num_local_tokens=tokens,
                           hidden_size=x.shape[1], topk=topk, num_local_experts=w1.shape[0])
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    plans = [autotune.ForwardPlan("launches", 0, 0),
             autotune.ForwardPlan("megakernel-spread", 0, 512)]
    best, timings = tuning.tune(ws, sched, x, w1, w2, plans=plans, warmup=1, iters=2,
                                config=config, b1=b1, b2=b2)
    assert set(timings) == {autotune.plan_name(p) for p in plans}
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).bfloat16().cuda()
    best_b, timings_b = tuning.tune_backward(ws, sched, x, inputs["topk_w"], w1, w2, dy,
                                             warmup=1, iters=2, config=config, b1=b1, b2=b2)
    assert len(timings_b) >= 1 and all(ms > 0 for ms in timings_b.values())
    autotune.forget_cache()  # read back from disk
    inter = w1.shape[1] // 2
    assert autotune.forward_plan(ws, inter, config) == best
    assert autotune.backward_plan(ws, inter, config, dy.dtype, True) == best_b
    assert autotune.lookup(autotune.workspace_key(ws, inter)) is None  # SwiGLU's: untouched
    y, _ = backend.forward(ws, sched, x, inputs["topk_w"], w1, w2, None, None, False, config,
                           b1, b2)
    monkeypatch.setenv("MOK_FORWARD", "launches")
    y_chain, _ = backend.forward(ws, sched, x, inputs["topk_w"], w1, w2, None, None, False,
                                 config, b1, b2)
    assert torch.equal(y, y_chain)
    autotune.forget_cache()
