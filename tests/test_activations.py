"""The expert activations of the spec (megatron_mok.activations) against their formulas,
Megatron's own, and through the reference MoE layer; the kernel backend refuses the ones it
does not run before any launch."""

import pytest
import torch
import torch.nn.functional as F

from megatron_mok import activations as A
from megatron_mok import reference
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs, rel_l2


def _h(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 4


def test_swiglu_is_silu_gate_times_up():
    h = _h(64, 2 * 24)
    g, u = h.chunk(2, dim=-1)
    assert torch.equal(A.SWIGLU(h), F.silu(g) * u)


def test_swiglu_backward_closed_form_matches_autograd():
    h = _h(64, 48).double().requires_grad_()
    d = _h(64, 24, seed=1).double()
    (auto,) = torch.autograd.grad(A.SWIGLU(h), h, d)
    torch.testing.assert_close(A.swiglu_backward(h.detach(), d).double(), auto, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("activation", [
    A.GPT_OSS, A.SWIGLU, A.ExpertActivation("silu", True, clamp=2.5, linear_offset=0.5),
    A.ExpertActivation("quick_gelu", True)], ids=lambda a: a.describe())
def test_glu_backward_closed_form_matches_autograd(activation):
    """The closed form the kernels' GLU epilogues compute (|h| up to ~16: both clamps cut)."""
    h = _h(64, 48).requires_grad_()
    d = _h(64, 24, seed=1)
    (auto,) = torch.autograd.grad(activation(h), h, d)
    closed = A.glu_backward(activation, h.detach(), d)
    torch.testing.assert_close(closed, auto, rtol=1e-5, atol=1e-5)
    if activation.clamp is not None:  # the cut gradients are exact zeros in both
        gate, up = h.detach().chunk(2, dim=-1)
        assert torch.count_nonzero(closed[:, :24][gate > activation.clamp]) == 0
        assert torch.count_nonzero(closed[:, 24:][up.abs() > activation.clamp]) == 0
        assert (gate > activation.clamp).any() and (up.abs() > activation.clamp).any()


def test_kernel_glu_parameters():
    assert A.SWIGLU.kernel_glu is None and A.SWIGLU.kernel_runs  # its own epilogue
    assert A.GPT_OSS.kernel_glu == (1.702, 7.0, 1.0)
    assert A.ExpertActivation("silu", True, clamp=3.0).kernel_glu == (1.0, 3.0, 0.0)
    assert A.ExpertActivation("quick_gelu", True).kernel_glu == (1.702, float("inf"), 0.0)
    geglu = A.ExpertActivation("gelu", True)  # a GLU of a function the epilogues lack
    assert not geglu.kernel_runs and geglu.kernel_glu is None and geglu.kernel_act is None
    for other in (A.SQUARED_RELU, geglu):
        with pytest.raises(ValueError, match="no closed-form GLU backward"):
            A.glu_backward(other, _h(4, 8), _h(4, 4))


def test_kernel_act_codes_of_the_non_gated_functions():
    """Every non-gated function of the spec runs in the kernels' kAct epilogues, with the
    codes csrc/gemm/tile.cuh's ActFn gives them."""
    assert A.SQUARED_RELU.kernel_runs and A.SQUARED_RELU.kernel_act == (1, 1.0)
    assert A.SQUARED_RELU.kernel_glu is None
    codes = {f: A.ExpertActivation(f, gated=False).kernel_act for f in A.FUNCTIONS}
    assert codes == {"silu": (4, 1.0), "quick_gelu": (4, 1.702), "gelu": (2, 1.0),
                     "gelu_tanh": (3, 1.0), "squared_relu": (1, 1.0), "relu": (0, 1.0)}
    assert A.SWIGLU.kernel_act is None and A.GPT_OSS.kernel_act is None


@pytest.mark.parametrize("function", sorted(A.FUNCTIONS))
def test_non_gated_derivative_closed_form_matches_autograd(function):
    """The f'(h) the kActBwd epilogue computes, against autograd of the spec's f (float64,
    values near 0 included)."""
    activation = A.ExpertActivation(function, gated=False)
    h = torch.cat([_h(64, 24).flatten(), torch.linspace(-1e-3, 1e-3, 7)]).double()
    h = h[h != 0].requires_grad_()
    d = torch.randn(h.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (auto,) = torch.autograd.grad(activation(h), h, d)
    closed = A.activation_backward(activation, h.detach(), d)
    torch.testing.assert_close(closed.double(), auto, rtol=2e-5, atol=1e-5)


def test_gpt_oss_clamped_glu_formula():
    """GPT-OSS: quick_gelu(min(g, 7)) * (clamp(u, -7, 7) + 1); values beyond the clamp
    exist in the input, so the clamp matters."""
    h = _h(64, 48) * 3
    g, u = h.chunk(2, dim=-1)
    assert g.max() > 7 and u.min() < -7
    want = g.clamp(max=7) * torch.sigmoid(1.702 * g.clamp(max=7)) * (u.clamp(-7, 7) + 1)
    torch.testing.assert_close(A.GPT_OSS(h), want)
    assert not torch.allclose(A.GPT_OSS(h), A.ExpertActivation("quick_gelu")(h))


def test_non_gated_activations():
    h = _h(64, 24)
    assert torch.equal(A.SQUARED_RELU(h), F.relu(h) ** 2)
    assert torch.equal(A.ExpertActivation("gelu", gated=False)(h), F.gelu(h))
    with pytest.raises(ValueError, match="gated"):
        A.ExpertActivation("squared_relu", gated=False, clamp=7.0)
    with pytest.raises(ValueError, match="unknown"):
        A.ExpertActivation("tanh")


@pytest.mark.parametrize("flags, want", [
    (dict(activation_func=F.silu, gated_linear_unit=True), A.SWIGLU),
    (dict(activation_func="quick_gelu", gated_linear_unit=True,
          activation_func_clamp_value=7.0, glu_linear_offset=1.0), A.GPT_OSS),
    (dict(activation_func="squared_relu", gated_linear_unit=False), A.SQUARED_RELU),
    (dict(activation_func=F.gelu, gated_linear_unit=False), A.ExpertActivation("gelu", False)),
])
def test_from_megatron_config_matches_megatrons_functions(flags, want):
    """The activation read from a TransformerConfig computes what Megatron's MLP does
    with the same flags (megatron.core.activations and its glu())."""
    from megatron.core import activations as MA
    from megatron.core.transformer.transformer_config import TransformerConfig
    func = flags.pop("activation_func")
    func = getattr(MA, func) if isinstance(func, str) else func
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               activation_func=func, bias_activation_fusion=False, **flags)
    got = A.from_megatron(config)
    assert got == want
    h = _h(64, 48 if want.gated else 24)
    if config.gated_linear_unit:  # Megatron's MLP.glu, as in megatron/core/transformer/mlp.py
        g, u = torch.chunk(h, 2, dim=-1)
        if config.activation_func_clamp_value is not None:
            c = config.activation_func_clamp_value
            g, u = g.clamp(max=c), u.clamp(-c, c)
        megatron = config.activation_func(g) * (u + config.glu_linear_offset)
    else:
        megatron = config.activation_func(h)
    torch.testing.assert_close(got(h), megatron)


@pytest.mark.parametrize("activation", [A.GPT_OSS, A.SQUARED_RELU], ids=lambda a: a.function)
def test_reference_layer_with_other_activations(activation):
    """moe_reference with a non-SwiGLU activation equals a per-route loop of the formula
    (fc1 -> activation -> round -> fc2 -> round, weighted fp32 sum), and its gradients
    flow to every input."""
    inter, r = 16, activation.fc1_rows_per_inter
    inputs = make_moe_inputs(inter=inter, shared_inter=8, seed=3)
    inputs["w1"] = inputs["w1"][:, :r * inter].contiguous()
    inputs["shared_w1"] = inputs["shared_w1"][:r * 8].contiguous()
    leaves = {k: (v.detach().clone().requires_grad_() if v.is_floating_point() else v)
              for k, v in inputs.items()}
    y = reference.moe_reference(**leaves, activation=activation)
    x = inputs["x"].float()

    def expert(rows, w1, w2):
        act = activation(rows @ w1.float().t()).bfloat16().float()
        return (act @ w2.float().t()).bfloat16().float()

    want = expert(x, inputs["shared_w1"], inputs["shared_w2"])
    for k in range(inputs["topk_idx"].shape[1]):
        e = inputs["topk_idx"][:, k]
        for t in range(x.shape[0]):
            if e[t] >= 0:
                want[t] += inputs["topk_w"][t, k] * expert(x[t:t + 1], inputs["w1"][e[t]],
                                                           inputs["w2"][e[t]])[0]
    assert rel_l2(y, want) < 1e-2 and y.abs().sum() > 0
    if activation.gated:  # and not SwiGLU's function
        assert rel_l2(y, reference.moe_reference(**inputs)) > 1e-2
    y.float().sum().backward()
    for name in ("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2"):
        assert leaves[name].grad is not None and leaves[name].grad.abs().sum() > 0, name


def test_non_gated_weights_are_checked():
    """A non-gated expert's w1 is [E_loc, I, H]: the SwiGLU layout is refused with the
    expected shape named."""
    inputs = make_moe_inputs(inter=16)  # w1 [E, 32, H], w2 [E, H, 16]
    with pytest.raises(ValueError, match="w2 must be .*I=32"):
        reference.moe_reference(**inputs, activation=A.SQUARED_RELU)
    inputs["w1"] = inputs["w1"][:, :16].contiguous()
    reference.moe_reference(**inputs, activation=A.SQUARED_RELU)


def test_kernel_backend_runs_glus_and_non_gated_and_refuses_other_glus_before_any_launch():
    from megatron_mok.validation import check_kernel_config
    check_kernel_config(MoKConfig())
    check_kernel_config(MoKConfig(activation=A.GPT_OSS))  # the GLU epilogues run it
    check_kernel_config(MoKConfig(activation=A.ExpertActivation("silu", True, clamp=5.0)))
    check_kernel_config(MoKConfig(activation=A.SQUARED_RELU))  # the kAct epilogues
    check_kernel_config(MoKConfig(activation=A.ExpertActivation("gelu", gated=False)))
    for refused in (A.ExpertActivation("gelu", gated=True),
                    A.ExpertActivation("squared_relu", gated=True)):
        with pytest.raises(ValueError, match="GLU experts of silu or quick_gelu.*"
                                             "--mok-backend reference"):
            check_kernel_config(MoKConfig(activation=refused))
    with pytest.raises(ValueError, match="ExpertActivation"):
        MoKConfig(activation="swiglu")


def test_expert_biases_scale_with_the_routing_weight():
    """b1 enters before the activation, b2 after fc2, and the routing weight scales the
    whole expert output, b2 included (Megatron's p * (fc2(act) + b2))."""
    inputs = make_moe_inputs(inter=16, seed=5, drop_fraction=0.0)
    g = torch.Generator().manual_seed(6)
    e_loc, two_i, hidden = inputs["w1"].shape
    b1 = torch.randn(e_loc, two_i, generator=g).bfloat16()
    b2 = torch.randn(e_loc, hidden, generator=g).bfloat16()
    y = reference.moe_reference(**inputs, activation=A.GPT_OSS, b1=b1, b2=b2)
    x, idx, w = inputs["x"].float(), inputs["topk_idx"], inputs["topk_w"]
    want = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = x[t] @ inputs["w1"][e].float().t() + b1[e].float()
            act = A.GPT_OSS(h).bfloat16().float()
            out = (act @ inputs["w2"][e].float().t() + b2[e].float()).bfloat16().float()
            want[t] += w[t, k] * out
    assert rel_l2(y, want.bfloat16()) < 1e-2
    assert rel_l2(y, reference.moe_reference(**inputs, activation=A.GPT_OSS)) > 0.05
    b1.requires_grad_(), b2.requires_grad_()
    reference.moe_reference(**inputs, activation=A.GPT_OSS, b1=b1, b2=b2).float().sum().backward()
    assert b1.grad.abs().sum() > 0 and b2.grad.abs().sum() > 0
    b1, b2 = b1.detach(), b2.detach()
    with pytest.raises(ValueError, match="together"):
        reference.moe_reference(**inputs, b1=b1)
    with pytest.raises(ValueError, match="b1 must be"):
        reference.moe_reference(**inputs, b1=b1[:, :8], b2=b2)
