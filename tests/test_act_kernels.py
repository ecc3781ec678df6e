"""The kernel backend's non-gated experts (squared-ReLU: Nemotron-style MoE; GeLU, relu,
silu): fc1 with the activation (and b1) in the core's kAct epilogue, fc2's dgrad with the
activation's backward and the router weights in its kActBwd epilogue, each against fp32
per-expert math, bitwise independent of the grid; and the layer forward and backward
against the reference, deterministic, on the launch chain whatever MOK_FORWARD asks."""

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
FUNCTIONS = ["squared_relu", "gelu", "gelu_tanh", "relu", "silu", "quick_gelu"]  # alpha 1.702
DIMS = [(320, 200), (512, 1408)]  # (H, I): column tails of every tile width


def _non_gated(function):
    return A.ExpertActivation(function, gated=False)


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_fc1_act_matches_fp32(function, routing, hidden, inter):
    activation = _non_gated(function)
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(COUNTS[routing])
    x = rand_bf16(capacity, hidden, seed=1, real=real)
    w1 = rand_bf16(E, inter, hidden, seed=2, scale=2 * hidden ** -0.5)
    b1 = rand_bf16(E, inter, seed=3)
    used = int(num_rows.item())  # rows past it are never written
    for bias in (None, b1):
        act, h = gg.fc1_act(x, w1, offsets, num_rows, activation, bias=bias)
        act_1, h_1 = gg.fc1_act(x, w1, offsets, num_rows, activation, bias=bias, max_ctas=3)
        assert torch.equal(act[:used], act_1[:used]) and torch.equal(h[:used], h_1[:used])
        act_only, none = gg.fc1_act(x, w1, offsets, num_rows, activation, bias=bias,
                                    save_h=False)
        assert none is None and torch.equal(act_only[:used], act[:used])
        negative = 0
        for e, lo, hi in segments(offs):
            h_ref = x[lo:hi].float() @ w1[e].float().t()
            if bias is not None:
                h_ref = h_ref + bias[e].float()
            negative += int((h_ref < 0).sum())
            assert rel_l2(h[lo:hi].float(), h_ref) < TOL, e
            assert rel_l2(act[lo:hi].float(), activation(h_ref)) < TOL, e
        assert negative > 0  # relu's cut is exercised


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("hidden, inter", DIMS)
def test_dgrad_act_routed_matches_its_closed_form(function, routing, hidden, inter,
                                                  monkeypatch):
    """d_h = f'(h) * w * (dy @ w2), the partials sum to <acc, f(h)>, act_scaled = w f(h);
    the same bits for h through the ring or from global memory and any grid size."""
    activation = _non_gated(function)
    offsets, num_rows, capacity, real, offs = row_table(COUNTS[routing])
    E = len(COUNTS[routing])
    dy = rand_bf16(capacity, hidden, seed=11, real=real)
    h = rand_bf16(capacity, inter, seed=12, scale=2.0, real=real)
    w2 = rand_bf16(E, hidden, inter, seed=13, scale=inter ** -0.5)
    row_w = (torch.rand(capacity, generator=torch.Generator().manual_seed(14)) * real).cuda()
    used = int(num_rows.item())
    runs = []
    for h_path, max_ctas in (("ring", 0), ("ring", 5), ("global", 0)):
        monkeypatch.setenv("MOK_DGRAD_H", h_path)
        runs.append([t[:used] for t in gg.dgrad_act_routed(dy, row_w, w2, h, offsets, num_rows,
                                                            activation, max_ctas=max_ctas)])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, runs[0]))
    d_h, dots_part, act_scaled = runs[0]
    act = activation(h.float())
    w = row_w[:, None]
    for e, lo, hi in segments(offs):
        acc = dy[lo:hi].float() @ w2[e].float()
        ref = A.activation_backward(activation, h[lo:hi], w[lo:hi] * acc)
        assert rel_l2(d_h[lo:hi].float(), ref) < TOL, e
        assert rel_l2(act_scaled[lo:hi].float(), w[lo:hi] * act[lo:hi]) < TOL, e
        dots = (acc * act[lo:hi]).sum(1)
        assert torch.allclose(dots_part[lo:hi].sum(1), dots, rtol=1e-4,
                              atol=1e-4 * dots.abs().max())
    if function in ("relu", "squared_relu"):  # the cut gradient is exact zeros
        assert torch.count_nonzero(d_h[h[:used] <= 0]) == 0


def test_act_ops_refuse_glus_and_bad_shapes():
    offsets, num_rows, capacity, real, _ = row_table(COUNTS["balanced"])
    x = rand_bf16(capacity, 64, seed=1, real=real)
    w1 = rand_bf16(4, 32, 64, seed=2)
    with pytest.raises(ValueError, match="is a GLU"):
        gg.fc1_act(x, w1, offsets, num_rows, A.SWIGLU)
    with pytest.raises(ValueError, match="w1 must be"):
        gg.fc1_act(x, w1[:, :, :32].contiguous(), offsets, num_rows, A.SQUARED_RELU)
    with pytest.raises(ValueError, match="b1 must be"):
        gg.fc1_act(x, w1, offsets, num_rows, A.SQUARED_RELU, bias=rand_bf16(4, 64, seed=3))
    dy = rand_bf16(capacity, 64, seed=4, real=real)
    w2 = rand_bf16(4, 64, 32, seed=5)
    row_w = torch.ones(capacity, device="cuda")
    with pytest.raises(ValueError, match="h must be"):
        gg.dgrad_act_routed(dy, row_w, w2, rand_bf16(capacity, 64, seed=6), offsets, num_rows,
                            A.SQUARED_RELU)


def _layer_inputs(seed, biases, hidden=512, inter=384, experts=8, topk=4, tokens=600,
                  shared=False):
    inputs = make_moe_inputs(num_tokens=tokens, hidden=hidden, inter=inter,
                             num_local_experts=experts, topk=topk, seed=seed,
                             shared_inter=inter if shared else None,
                             drop_fraction=0.05, device="cuda")
    inputs["w1"] = inputs["w1"][:, :inter].contiguous()  # non-gated: [E, I, H]
    if shared:
        inputs["shared_w1"] = inputs["shared_w1"][:inter].contiguous()  # [I, H]
    if biases:
        g = torch.Generator().manual_seed(seed + 7)
        inputs["b1"] = (torch.randn(experts, inter, generator=g) * 0.5).bfloat16().cuda()
        inputs["b2"] = (torch.randn(experts, hidden, generator=g) * 0.1).bfloat16().cuda()
    return inputs


def _run(inputs, config, dy):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, config=config)
    y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in leaves if leaves[k].is_floating_point()}


@pytest.mark.parametrize("function", ["squared_relu", "gelu"])
@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
def test_non_gated_layer_matches_reference_and_is_deterministic(function, biases, monkeypatch):
    activation = _non_gated(function)
    inputs = _layer_inputs(seed=5, biases=biases)
    dy = torch.randn(inputs["x"].shape,
                     generator=torch.Generator().manual_seed(6)).bfloat16().cuda()
    y_ref, g_ref = _run(inputs, MoKConfig(backend="reference", activation=activation,
                                          expert_bias=biases), dy)
    kernel = MoKConfig(backend="kernel", activation=activation, expert_bias=biases)
    y, grads = _run(inputs, kernel, dy)
    assert rel_l2(y, y_ref) < TOL
    assert set(grads) == set(g_ref)
    for k in grads:
        assert grads[k].dtype == inputs[k].dtype, k
        assert rel_l2(grads[k], g_ref[k]) < TOL, k
    y2, grads2 = _run(inputs, kernel, dy)
    assert torch.equal(y, y2) and all(torch.equal(grads[k], grads2[k]) for k in grads)
    # The megakernels run GLUs only: asked for, the pass stays on the chain, same bits.
    monkeypatch.setenv("MOK_FORWARD", "megakernel")
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    y3, grads3 = _run(inputs, kernel, dy)
    assert torch.equal(y, y3) and all(torch.equal(grads[k], grads3[k]) for k in grads)


@pytest.mark.parametrize("fold", ["separate", "folded"])
def test_non_gated_layer_with_a_shared_expert(fold, monkeypatch):
    """A non-gated shared expert ([I, H] fc1) beside the routed ones, in its own GEMMs or
    folded into the expert pass as one more expert (MOK_SHARED_EXPERT=folded: the kAct
    epilogues then run it too): against the reference, the two modes within rounding."""
    monkeypatch.setenv("MOK_SHARED_EXPERT", fold)
    activation = _non_gated("squared_relu")
    inputs = _layer_inputs(seed=8, biases=False, shared=True)
    dy = torch.randn(inputs["x"].shape,
                     generator=torch.Generator().manual_seed(9)).bfloat16().cuda()
    y_ref, g_ref = _run(inputs, MoKConfig(backend="reference", activation=activation), dy)
    y, grads = _run(inputs, MoKConfig(backend="kernel", activation=activation), dy)
    assert rel_l2(y, y_ref) < TOL
    for k in ("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2"):
        assert rel_l2(grads[k], g_ref[k]) < TOL, k
