"""The spec (reference.py) against an independent per-token loop, and its properties."""

import pytest
import torch
import torch.nn.functional as F

from megatron_mok import reference
from moe_inputs import make_moe_inputs, rel_l2

GRAD_NAMES = ("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2")


def naive_moe(x, topk_idx, topk_w, w1, w2, shared_w1=None, shared_w2=None, rounding=None):
    """Token by token in float64; `rounding` applies the contract's rounding points."""
    rnd = (lambda t: t.to(rounding).double()) if rounding else (lambda t: t)
    xd = x.double()

    def expert(row, a, b):
        h = a.double() @ row
        inter = h.shape[0] // 2
        return rnd(b.double() @ rnd(F.silu(h[:inter]) * h[inter:]))

    out = []
    for t in range(x.shape[0]):
        acc = expert(xd[t], shared_w1, shared_w2) if shared_w1 is not None else \
            xd.new_zeros(x.shape[1])
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e >= 0:
                acc = acc + topk_w[t, k].double() * expert(xd[t], w1[e], w2[e])
        out.append(acc)
    return torch.stack(out)


def _leaves(inputs):
    return {k: (v.clone().requires_grad_() if v.is_floating_point() else v)
            for k, v in inputs.items()}


@pytest.mark.parametrize("shared", [None, 24])
def test_bf16_forward_matches_rounded_token_loop(shared):
    inputs = make_moe_inputs(shared_inter=shared, seed=1)
    y = reference.moe_reference(**inputs)
    expected = naive_moe(**inputs, rounding=torch.bfloat16).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    # One bf16 ulp of slack for fp32 accumulation-order differences.
    assert rel_l2(y, expected) < 2e-3
    assert rel_l2(y, naive_moe(**inputs)) < 1e-2


@pytest.mark.parametrize("shared", [None, 24])
def test_bf16_gradients_match_float64_autograd(shared):
    inputs = make_moe_inputs(shared_inter=shared, seed=2)
    ours, exact = _leaves(inputs), _leaves(inputs)
    dy = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(3))
    reference.moe_reference(**ours).backward(dy.bfloat16())
    naive_moe(**exact).backward(dy.double())
    for name in GRAD_NAMES:
        if name in ours:
            assert ours[name].grad is not None, name
            assert rel_l2(ours[name].grad, exact[name].grad) < 1e-2, name


def test_fp32_is_plain_fp32_moe():
    inputs = make_moe_inputs(dtype=torch.float32, shared_inter=16, seed=4)
    ours, exact = _leaves(inputs), _leaves(inputs)
    y = reference.moe_reference(**ours)
    assert rel_l2(y, naive_moe(**inputs)) < 1e-6
    dy = torch.randn_like(y)
    y.backward(dy)
    naive_moe(**exact).backward(dy.double())
    for name in GRAD_NAMES:
        assert rel_l2(ours[name].grad, exact[name].grad) < 1e-5, name


def test_d_topk_w_is_dot_of_dy_and_expert_output():
    inputs = make_moe_inputs(seed=5, drop_fraction=0.2)
    leaves = _leaves(inputs)
    y = reference.moe_reference(**leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    y.backward(dy)
    slots = reference.routed_slots(inputs["x"], inputs["topk_idx"], inputs["w1"], inputs["w2"])
    expected = torch.einsum("th,tkh->tk", dy.float(), slots)
    expected = torch.where(inputs["topk_idx"] >= 0, expected, 0.0)
    assert leaves["topk_w"].grad.dtype == torch.float32
    assert rel_l2(leaves["topk_w"].grad, expected) < 1e-5
    assert torch.all(leaves["topk_w"].grad[inputs["topk_idx"] < 0] == 0)


def test_unrouted_token_gets_exactly_shared_output_or_zero():
    inputs = make_moe_inputs(seed=7, shared_inter=8)
    inputs["topk_idx"][5] = -1
    y = reference.moe_reference(**inputs)
    shared_only = reference.swiglu_expert(inputs["x"][5:6].float(), inputs["shared_w1"],
                                          inputs["shared_w2"], torch.bfloat16)
    assert torch.equal(y[5], shared_only[0].bfloat16())
    del inputs["shared_w1"], inputs["shared_w2"]
    assert torch.equal(reference.moe_reference(**inputs)[5], torch.zeros(32, dtype=torch.bfloat16))


def test_every_token_on_one_expert():
    inputs = make_moe_inputs(seed=8, topk=1, drop_fraction=0.0)
    inputs["topk_idx"].fill_(2)
    y = reference.moe_reference(**inputs)
    assert rel_l2(y, naive_moe(**inputs, rounding=torch.bfloat16)) < 2e-3


def test_bitwise_deterministic():
    inputs = make_moe_inputs(seed=9, shared_inter=16)
    runs = []
    for _ in range(2):
        leaves = _leaves(inputs)
        y = reference.moe_reference(**leaves)
        y.float().square().sum().backward()
        runs.append([y] + [leaves[n].grad for n in GRAD_NAMES])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
