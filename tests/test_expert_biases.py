"""Expert biases (Megatron's --add-bias-linear, GPT-OSS) through the functional API on the
reference backend: fused_moe's output and every gradient (b1 and b2 included, each under
its own name) against an independent per-route float64 evaluation of the spec's formula,
recompute, and the refusals (one bias, wrong shapes, the kernel backend)."""

import pytest
import torch

from megatron_mok import activations as A
from megatron_mok import functional as mok
from megatron_mok.backend_choice import resolve_backend
from megatron_mok.config import MoKConfig
from megatron_mok.validation import check_kernel_config
from moe_inputs import make_moe_inputs, rel_l2

REFERENCE = MoKConfig(backend="reference")


def _biased_inputs(seed, activation=A.SWIGLU, dtype=torch.float32, shared=None):
    inputs = make_moe_inputs(num_tokens=40, hidden=32, inter=16, num_local_experts=4, topk=2,
                             shared_inter=shared, dtype=dtype, seed=seed, drop_fraction=0.1)
    g = torch.Generator().manual_seed(seed + 100)
    e_loc, fc1_rows, hidden = inputs["w1"].shape
    if not activation.gated:
        inputs["w1"] = inputs["w1"][:, :fc1_rows // 2].contiguous()
        fc1_rows //= 2
        if shared:
            inputs["shared_w1"] = inputs["shared_w1"][:shared].contiguous()
    inputs["b1"] = (torch.randn(e_loc, fc1_rows, generator=g) * 0.5).to(dtype)
    inputs["b2"] = (torch.randn(e_loc, hidden, generator=g) * 0.5).to(dtype)
    return inputs


def _per_route(inputs, activation):
    """y = sum_k p_k (act(x W1^T + b1) W2^T + b2) per route, float64 (the activation in fp32:
    tested against Megatron's in test_activations), no rounding; the
    shared expert (no biases: Megatron's shared expert is its own module) added after."""
    x, idx, p = inputs["x"].double(), inputs["topk_idx"], inputs["topk_w"].double()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            h = x[t] @ inputs["w1"][e].double().t() + inputs["b1"][e].double()
            out = activation(h).double() @ inputs["w2"][e].double().t() + inputs["b2"][e].double()
            y[t] += p[t, k] * out
    if inputs.get("shared_w1") is not None:
        y += activation(x @ inputs["shared_w1"].double().t()).double() @ inputs["shared_w2"].double().t()
    return y


_GRADS = {"x": "dx", "topk_w": "d_topk_w", "w1": "dw1", "w2": "dw2", "b1": "db1", "b2": "db2"}


@pytest.mark.parametrize("activation", [A.SWIGLU, A.GPT_OSS, A.SQUARED_RELU],
                         ids=lambda a: a.describe())
@pytest.mark.parametrize("recompute", [False, True])
def test_fused_moe_with_biases_matches_the_per_route_formula(activation, recompute):
    inputs = _biased_inputs(seed=3, activation=activation, shared=8)
    config = MoKConfig(backend="reference", activation=activation)
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, config=config, recompute=recompute)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    y.backward(dy)

    ref = {k: v.double().requires_grad_() if v.is_floating_point() else v
           for k, v in inputs.items()}
    y_ref = _per_route(ref, activation)
    y_ref.backward(dy.double())
    assert rel_l2(y, y_ref) < 1e-5
    for name in _GRADS:
        assert leaves[name].grad is not None, name
        assert rel_l2(leaves[name].grad, ref[name].grad) < 1e-5, name
    assert leaves["b2"].grad.abs().sum() > 0 and leaves["b1"].grad.abs().sum() > 0
    # The biases change the output (the test would not see them otherwise).
    no_bias = {k: v for k, v in inputs.items() if k not in ("b1", "b2")}
    assert rel_l2(mok.fused_moe(**no_bias, config=config), y_ref) > 0.05


def test_grads_keep_their_names_without_a_shared_expert():
    """MoKGrads names each gradient: with no shared expert, db1/db2 must not land in the
    shared expert's fields (they are absent from the leaves in between)."""
    inputs = _biased_inputs(seed=4)
    config = MoKConfig(backend="reference", expert_bias=True)
    ws = mok.get_workspace(config, None, device="cpu", num_local_tokens=40, hidden_size=32,
                           topk=2, num_local_experts=4, dtype=torch.float32)
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    y, ctx = mok.forward(config, ws, sched, inputs["x"], inputs["topk_w"], inputs["w1"],
                         inputs["w2"], b1=inputs["b1"], b2=inputs["b2"])
    g = mok.backward(config, ws, sched, ctx, torch.ones_like(y))
    assert g.d_shared_w1 is None and g.d_shared_w2 is None
    assert g.db1.shape == inputs["b1"].shape and g.db2.shape == inputs["b2"].shape
    # d b2[e] = sum over the routes to e of p * dy (dy = 1): the routing weight scales b2.
    idx, p = inputs["topk_idx"], inputs["topk_w"]
    for e in range(4):
        want = p[idx == e].sum() * torch.ones(32)
        assert torch.allclose(g.db2[e], want, rtol=1e-5), e


def test_bias_refusals_name_what_to_pass():
    inputs = _biased_inputs(seed=5)
    base = {k: v for k, v in inputs.items() if k not in ("b1", "b2")}
    with pytest.raises(ValueError, match="together"):
        mok.fused_moe(**base, b1=inputs["b1"], config=REFERENCE)
    with pytest.raises(ValueError, match="b1 must be"):
        mok.fused_moe(**base, b1=inputs["b1"][:, :8].contiguous(), b2=inputs["b2"],
                      config=REFERENCE)
    with pytest.raises(TypeError, match="b2 must have dtype"):
        mok.fused_moe(**base, b1=inputs["b1"], b2=inputs["b2"].bfloat16(), config=REFERENCE)
    with pytest.raises(ValueError, match="contiguous"):
        mok.fused_moe(**base, b1=inputs["b1"], b2=inputs["b2"].t().contiguous().t(),
                      config=REFERENCE)
    # The explicit API: biases and MoKConfig.expert_bias must agree.
    ws = mok.get_workspace(REFERENCE, None, device="cpu", num_local_tokens=40, hidden_size=32,
                           topk=2, num_local_experts=4, dtype=torch.float32)
    sched = mok.build_schedule(ws, REFERENCE, inputs["topk_idx"])
    with pytest.raises(ValueError, match="expert_bias is False"):
        mok.forward(REFERENCE, ws, sched, inputs["x"], inputs["topk_w"], inputs["w1"],
                    inputs["w2"], b1=inputs["b1"], b2=inputs["b2"])
    # The kernel backend adds the biases in its epilogues: the config is not refused (on
    # this CPU machine the kernel backend itself is not available).
    check_kernel_config(MoKConfig(expert_bias=True, activation=A.GPT_OSS))
    with pytest.raises(RuntimeError, match="not available"):
        resolve_backend(MoKConfig(backend="kernel", expert_bias=True), torch.device("cpu"))
    with pytest.raises(ValueError, match="expert_bias must be a bool"):
        MoKConfig(expert_bias=1)
