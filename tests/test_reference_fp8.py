"""The blockwise-FP8 MoE layer of the spec (megatron_mok.reference_fp8): its forward is the
explicit quantise -> fp32 GEMM chain, its gradients use the documented quantisation points,
and it stays within FP8's error of the BF16 spec."""

import pytest
import torch

from megatron_mok import reference, reference_fp8 as R8
from megatron_mok.fp8_formats import quantize_blockwise
from moe_inputs import make_moe_inputs, rel_l2

SHAPE = dict(num_tokens=96, hidden=256, inter=128, num_local_experts=4, topk=2,
             drop_fraction=0.1)


def _inputs(seed=0, shared=None):
    return make_moe_inputs(**SHAPE, shared_inter=shared, seed=seed)


def _leaves(inputs):
    return {k: (v.detach().clone().requires_grad_() if v.is_floating_point() else v)
            for k, v in inputs.items()}


def _dq(t, rows):
    return quantize_blockwise(t.float(), block_rows=rows).dequantize()


def test_forward_is_the_explicit_quantised_chain():
    inp = _inputs(1)
    y = R8.moe_reference_fp8(**inp)
    x, idx, w = inp["x"], inp["topk_idx"], inp["topk_w"]
    want = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            h = _dq(x[t:t + 1], 1) @ _dq(inp["w1"][e], 128).t()
            g, u = h.chunk(2, dim=-1)
            act = (torch.nn.functional.silu(g) * u).to(x.dtype).float()  # rounded between the GEMMs
            out = (_dq(act, 1) @ _dq(inp["w2"][e], 128).t()).bfloat16().float()
            want[t] += w[t, k] * out[0]
    assert rel_l2(y, want.bfloat16()) < 1e-3 and y.abs().sum() > 0


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fp8_layer_within_fp8_error_of_the_bf16_spec(wgrad):
    """Relative L2 against the BF16 spec: a few % for y and every gradient (FP8 keeps 3
    mantissa bits), far above BF16's own rounding (so FP8 really ran)."""
    inp = _inputs(2, shared=128)
    dy = torch.randn(SHAPE["num_tokens"], SHAPE["hidden"],
                     generator=torch.Generator().manual_seed(9)).bfloat16()
    fp8, bf16 = _leaves(inp), _leaves(inp)
    y8 = R8.moe_reference_fp8(**fp8, wgrad=wgrad)
    y = reference.moe_reference(**bf16)
    y8.backward(dy)
    y.backward(dy)
    errs = {"y": rel_l2(y8, y)}
    errs |= {n: rel_l2(fp8[n].grad, bf16[n].grad)
             for n in ("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2")}
    print(wgrad, {k: f"{v:.1e}" for k, v in errs.items()})
    for name, err in errs.items():
        assert err < 0.1, (name, err)
    assert errs["y"] > 5e-3 and errs["x"] > 5e-3  # the routed part is FP8
    assert errs["shared_w1"] < 1e-2  # the shared expert stays BF16 (only its input grad differs)


def test_dgrad_uses_the_quantised_gradient_and_transposed_weight_blocks():
    """One expert, all rows routed to it: dx of fc2's input is dq(q(dY)) @ dq(q(w2^T))^T."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(256, 128, generator=g).requires_grad_()
    w = (torch.randn(256, 128, generator=g) * 0.1).requires_grad_()
    out = R8._FP8Linear.apply(a, w, False, "fp8")
    d_out = torch.randn(256, 256, generator=g)
    out.backward(d_out)
    want_da = _dq(d_out, 1) @ _dq(w.detach().t().contiguous(), 128).t()
    torch.testing.assert_close(a.grad, want_da)
    want_dw = _dq(d_out.t().contiguous(), 1) @ _dq(a.detach().t().contiguous(), 1).t()
    torch.testing.assert_close(w.grad, want_dw)
    assert rel_l2(a.grad, d_out @ w.detach()) > 1e-3  # not the unquantised product


def test_deterministic_and_bad_input():
    inp = _inputs(4)
    assert torch.equal(R8.moe_reference_fp8(**inp), R8.moe_reference_fp8(**inp))
    small = make_moe_inputs(num_tokens=16, hidden=96, inter=128)
    with pytest.raises(ValueError, match="multiples of 128"):
        R8.moe_reference_fp8(**small)
    with pytest.raises(ValueError, match="wgrad"):
        R8.moe_reference_fp8(**inp, wgrad="fp4")


def test_fc2_dgrad_quantises_the_unweighted_dy(monkeypatch):
    """The kernels quantise each route's dy as it is and apply the router weight to the fp32
    dgrad; so does the spec: the rows fc2's dgrad quantises are dy's rows, not w * dy's, and
    d_topk_w is <dy, out> per route."""
    inp = _inputs(5)
    leaves = _leaves(inp)
    y = R8.moe_reference_fp8(**leaves, wgrad="bf16")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(y.dtype)
    quantised, dq_act = [], R8._dq_act
    monkeypatch.setattr(R8, "_dq_act", lambda t, pow2: quantised.append(t) or dq_act(t, pow2))
    y.backward(dy)
    hidden = inp["x"].shape[1]
    dy_rows = [t for t in quantised if t.shape[1] == hidden]  # fc2 dgrads' A: [rows, H]
    idx = inp["topk_idx"]
    for e in range(inp["w1"].shape[0]):  # expert e's rows: its routes in (token, k) order
        tokens = (idx == e).nonzero()[:, 0]
        if tokens.numel():
            want = dy.float()[tokens]
            assert any(t.shape == want.shape and torch.equal(t, want) for t in dy_rows), e
    assert bool((leaves["topk_w"].grad != 0).any())
