"""Weight gradients added into caller-owned buffers (Megatron's main_grad): which layouts
one wgrad launch can add into, the multi-tensor fallback, and the autograd contract on the
reference backend (CPU). The kernel backend's adds are tests/test_gpu_backend.py's."""

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import ExpertGradAccumulator, fused_moe
from megatron_mok.reference import moe_reference

E, I, H = 4, 24, 32


def _megatron_buffer(shapes_in_param_order, dtype=torch.float32):
    """Views into one flat buffer laid out as Megatron's grad buffer: parameters backwards."""
    sizes = [torch.Size(s).numel() for s in shapes_in_param_order]
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0)).to(dtype)
    views, end = [None] * len(sizes), flat.numel()
    for i in range(len(sizes)):  # the first parameter ends the buffer
        views[i] = flat[end - sizes[i]:end].view(shapes_in_param_order[i])
        end -= sizes[i]
    return flat, views


def test_back_to_back_in_expert_order_is_one_tensor():
    stacked = torch.randn(E, 2 * I, H)
    acc = ExpertGradAccumulator(list(stacked.unbind(0)))
    planes, reverse = acc.fused_target
    assert not reverse and planes.data_ptr() == stacked.data_ptr()
    assert planes.stride() == stacked.stride()


def test_te_grouped_experts_lie_backwards_in_megatron_buffer():
    # TEGroupedMLP registers fc1.weight0..E-1, then fc2.weight0..E-1.
    _, views = _megatron_buffer([(2 * I, H)] * E + [(H, I)] * E)
    for weights in (views[:E], views[E:]):
        planes, reverse = ExpertGradAccumulator(weights).fused_target
        assert reverse
        for j in range(E):
            assert planes[j].data_ptr() == weights[E - 1 - j].data_ptr()


def test_sequential_mlp_interleaves_at_a_fixed_distance():
    # SequentialMLP registers expert 0's fc1, fc2, then expert 1's, ...
    _, views = _megatron_buffer([(2 * I, H), (H, I)] * E)
    fc1, fc2 = views[0::2], views[1::2]
    for weights in (fc1, fc2):
        planes, reverse = ExpertGradAccumulator(weights).fused_target
        assert reverse and planes.stride(0) == 3 * I * H
        for j in range(E):
            assert torch.equal(planes[j], weights[E - 1 - j])
            assert planes[j].data_ptr() == weights[E - 1 - j].data_ptr()


def test_layouts_one_launch_cannot_add_into_fall_back():
    flat = torch.zeros(E * 2 * I * H + 2 * I * H + 4)
    step = 2 * I * H
    uneven = [flat[o:o + step].view(2 * I, H) for o in (0, step, 3 * step, 4 * step)]
    acc = ExpertGradAccumulator(uneven)  # a gap between two experts: two launches
    assert acc.fused_target is None
    assert [(r[0], r[1], r[3]) for r in acc.fused_runs] == [(0, 2, False), (2, 2, False)]
    assert acc.fused_runs[1][2].data_ptr() == uneven[2].data_ptr()
    separate = [torch.zeros(2 * I, H) for _ in range(E)]  # separate storages: one each
    acc = ExpertGradAccumulator(separate)
    assert acc.fused_target is None and [r[:2] for r in acc.fused_runs] == [
        (e, 1) for e in range(E)]
    many = [torch.zeros(4, 4) for _ in range(9)]  # more runs than launches are worth
    assert ExpertGradAccumulator(many).fused_runs is None
    misaligned = [flat[1 + e * step:1 + (e + 1) * step].view(2 * I, H) for e in range(E)]
    acc = ExpertGradAccumulator(misaligned)  # not 16-byte aligned
    assert acc.fused_target is None and acc.fused_runs is None
    half = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)
    acc = ExpertGradAccumulator(list(half.unbind(0)))  # not fp32
    assert acc.fused_target is None and acc.fused_runs is None
    odd = torch.zeros(E * (2 * I * H + 1))  # equally spaced, but 4 bytes off 16
    apart = [odd[e * (2 * I * H + 1):e * (2 * I * H + 1) + 2 * I * H].view(2 * I, H)
             for e in range(E)]
    acc = ExpertGradAccumulator(apart)
    assert acc.fused_target is None and acc.fused_runs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_adds_each_expert_into_its_own_buffer(dtype):
    _, views = _megatron_buffer([(2 * I, H), (H, I)] * E, dtype)
    fc1 = views[0::2]
    start = [v.clone() for v in fc1]
    grad = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(1))
    ExpertGradAccumulator(fc1).add_(grad)
    for e in range(E):  # one rounding, of the fp32 sum
        assert torch.equal(fc1[e], (start[e].float() + grad[e]).to(dtype))
    with pytest.raises(ValueError, match="does not match the buffers"):
        ExpertGradAccumulator(fc1).add_(grad[:, :, :8])


def test_bad_buffers_raise():
    with pytest.raises(TypeError, match="one tensor per expert"):
        ExpertGradAccumulator([])
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        ExpertGradAccumulator([torch.zeros(4, 4), torch.zeros(4, 8)])
    with pytest.raises(TypeError, match="must be one of"):
        ExpertGradAccumulator([torch.zeros(4, 4, dtype=torch.int32)])


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    T, K = 40, 2
    x = torch.randn(T, H, generator=g)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    topk_w = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    dy = torch.randn(T, H, generator=g)
    return x, topk_idx, topk_w, w1, w2, dy


def test_fused_moe_adds_weight_grads_into_the_buffers_and_returns_placeholders():
    x, topk_idx, topk_w, w1, w2, dy = _inputs(2)
    config = MoKConfig(backend="reference")
    leaves = [t.clone().requires_grad_(True) for t in (x, topk_w, w1, w2)]
    moe_reference(leaves[0], topk_idx, *leaves[1:]).backward(dy)
    _, views = _megatron_buffer([(2 * I, H), (H, I)] * E)
    start = [v.clone() for v in views]
    calls = []
    accs = (ExpertGradAccumulator(views[0::2], on_added=lambda: calls.append("w1")),
            ExpertGradAccumulator(views[1::2], on_added=lambda: calls.append("w2")))
    args = [t.clone().requires_grad_(True) for t in (x, topk_w, w1, w2)]
    y = fused_moe(args[0], topk_idx, args[1], args[2], args[3], config=config,
                  accumulators=accs)
    y.backward(dy)
    assert sorted(calls) == ["w1", "w2"]
    for e in range(E):
        torch.testing.assert_close(views[2 * e], start[2 * e] + leaves[2].grad[e])
        torch.testing.assert_close(views[2 * e + 1], start[2 * e + 1] + leaves[3].grad[e])
    # The other gradients are untouched; the weights get placeholders of their shape.
    torch.testing.assert_close(args[0].grad, leaves[0].grad)
    torch.testing.assert_close(args[1].grad, leaves[1].grad)
    assert args[2].grad.shape == w1.shape and args[3].grad.shape == w2.shape


def test_a_frozen_weight_leaves_its_buffers_alone():
    x, topk_idx, topk_w, w1, w2, dy = _inputs(3)
    _, views = _megatron_buffer([(2 * I, H), (H, I)] * E)
    start = [v.clone() for v in views]
    calls = []
    accs = (ExpertGradAccumulator(views[0::2], on_added=lambda: calls.append("w1")),
            ExpertGradAccumulator(views[1::2], on_added=lambda: calls.append("w2")))
    w1 = w1.requires_grad_(True)
    y = fused_moe(x, topk_idx, topk_w, w1, w2, config=MoKConfig(backend="reference"),
                  accumulators=accs)
    y.backward(dy)
    assert calls == ["w1"]
    assert all(torch.equal(v, s) for v, s in zip(views[1::2], start[1::2]))
    assert not all(torch.equal(v, s) for v, s in zip(views[0::2], start[0::2]))


def test_mismatched_accumulators_raise_before_the_pass():
    x, topk_idx, topk_w, w1, w2, _ = _inputs(4)
    config = MoKConfig(backend="reference")
    wrong = ExpertGradAccumulator([torch.zeros(H, I) for _ in range(E - 1)])
    with pytest.raises(ValueError, match=r"w2's gradient buffers are \[3, 32, 24\]"):
        fused_moe(x, topk_idx, topk_w, w1, w2, config=config, accumulators=(None, wrong))
    with pytest.raises(TypeError, match="accumulators must be a pair"):
        fused_moe(x, topk_idx, topk_w, w1, w2, config=config, accumulators=[None, None])


def test_config_knob_and_megatron_flag():
    import argparse
    from megatron_mok.megatron.args import add_mok_args, mok_config_from_args
    with pytest.raises(ValueError, match="main_grad_fusion must be one of"):
        MoKConfig(main_grad_fusion="yes")
    parser = add_mok_args(argparse.ArgumentParser())
    assert mok_config_from_args(parser.parse_args([])).main_grad_fusion == "auto"
    args = parser.parse_args(["--mok-main-grad-fusion", "on"])
    assert mok_config_from_args(args).main_grad_fusion == "on"


def test_zero_placeholder_for_callers_that_add_it_anyway():
    # Megatron's DDP adds param.grad into main_grad even after the layer did when the
    # parameter has zero_out_wgrad: the placeholder must then be zeros.
    w = torch.randn(E, H, I)
    assert torch.equal(ExpertGradAccumulator([torch.zeros(H, I)] * 1, zero_placeholder=True)
                       .finish(w), torch.zeros_like(w))
    assert ExpertGradAccumulator([torch.zeros(H, I)]).finish(w).shape == w.shape
