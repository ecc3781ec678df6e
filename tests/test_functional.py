"""The functional API (MoK-shaped) against the spec, on the reference backend."""

import pytest
import torch

from megatron_mok import functional as mok
from megatron_mok import reference
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs

WEIGHTS = ("w1", "w2", "shared_w1", "shared_w2")


def _workspace(inputs, config):
    return mok.get_workspace(config, None, device="cpu", num_local_tokens=inputs["x"].shape[0],
                             hidden_size=inputs["x"].shape[1], topk=inputs["topk_idx"].shape[1],
                             num_local_experts=inputs["w1"].shape[0])


def _reference_grads(inputs, dy):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = reference.moe_reference(**leaves)
    y.backward(dy)
    return y, leaves


def test_forward_backward_equal_reference_bitwise():
    config = MoKConfig(backend="reference")
    inputs = make_moe_inputs(shared_inter=24, seed=11)
    ws = _workspace(inputs, config)
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    y, ctx = mok.forward(config, ws, sched, inputs["x"], inputs["topk_w"],
                         *[inputs[k] for k in WEIGHTS])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(12)).bfloat16()
    grads = mok.backward(config, ws, sched, ctx, dy)
    y_ref, leaves = _reference_grads(inputs, dy)
    assert torch.equal(y, y_ref)
    assert torch.equal(grads.dx, leaves["x"].grad)
    assert torch.equal(grads.d_topk_w, leaves["topk_w"].grad)
    for name in WEIGHTS:
        assert torch.equal(getattr(grads, "d" + name if name[0] == "w" else "d_" + name),
                           leaves[name].grad), name
    with pytest.raises(ValueError, match="recompute_forward_context"):
        mok.backward(config, ws, sched, ctx, dy)  # the graph was consumed


@pytest.mark.parametrize("recompute", [False, True])
def test_autograd_function_matches_reference(recompute):
    inputs = make_moe_inputs(seed=13, shared_inter=8)
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, recompute=recompute)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(14)).bfloat16()
    y.backward(dy)
    y_ref, ref = _reference_grads(inputs, dy)
    assert torch.equal(y, y_ref)
    for name in ("x", "topk_w") + WEIGHTS:
        assert torch.equal(leaves[name].grad, ref[name].grad), name


def test_recompute_forward_context_rebuilds_the_graph():
    config = MoKConfig()
    inputs = make_moe_inputs(seed=15)
    ws = _workspace(inputs, config)
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    args = (inputs["x"], inputs["topk_w"], inputs["w1"], inputs["w2"])
    y, ctx = mok.forward(config, ws, sched, *args)
    dy = torch.randn_like(y)
    first = mok.backward(config, ws, sched, ctx, dy)
    again = mok.backward(config, ws, sched, mok.recompute_forward_context(config, ws, sched, *args),
                         dy)
    assert torch.equal(first.dx, again.dx) and torch.equal(first.dw1, again.dw1)


def test_workspace_is_cached_per_shape():
    config = MoKConfig()
    a = make_moe_inputs(num_tokens=16)
    b = make_moe_inputs(num_tokens=32)
    assert _workspace(a, config) is _workspace(a, config)
    assert _workspace(a, config) is not _workspace(b, config)
    mok.clear_workspace_cache()
    assert _workspace(a, config).num_tokens == 16


def test_backend_choice():
    assert mok.resolve_backend(MoKConfig(backend="auto"), torch.device("cpu")) == "reference"
    assert mok.resolve_backend(MoKConfig(backend="reference"), torch.device("cpu")) == "reference"
    with pytest.raises(RuntimeError, match="backend='kernel' is not available"):
        mok.resolve_backend(MoKConfig(backend="kernel"), torch.device("cpu"))
    inputs = make_moe_inputs()
    with pytest.raises(RuntimeError, match="backend='kernel'"):
        mok.fused_moe(**inputs, config=MoKConfig(backend="kernel"))


def test_capacity_overflow_raises():
    inputs = make_moe_inputs(num_tokens=64, topk=2, num_local_experts=2, drop_fraction=0.0)
    config = MoKConfig(schedule_capacity_multiplier=0.01)
    ws = _workspace(inputs, config)
    ws.capacity = 128  # smaller than the 64 x 2 routes plus padding
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    with pytest.raises(RuntimeError, match="capacity"):
        mok.forward(config, ws, sched, inputs["x"], inputs["topk_w"], inputs["w1"], inputs["w2"])
    mok.clear_workspace_cache()


@pytest.mark.gpu
def test_reference_backend_on_gpu_matches_cpu():
    inputs = make_moe_inputs(shared_inter=24, seed=16)
    cuda = {k: v.cuda() for k, v in inputs.items()}
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in cuda.items()}
    y = mok.fused_moe(**leaves, config=MoKConfig(backend="reference"))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(17)).bfloat16()
    y.backward(dy.cuda())
    y_cpu, ref = _reference_grads(inputs, dy)
    from moe_inputs import rel_l2
    assert rel_l2(y.cpu(), y_cpu) < 1e-2
    for name in ("x", "topk_w") + WEIGHTS:
        assert rel_l2(leaves[name].grad.cpu(), ref[name].grad) < 1e-2, name


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_a_forward_without_backward_frees_its_context_at_once(monkeypatch, backend):
    """Dropping y frees what the pass saved, by reference counting alone: the context must
    not hold y (y's grad_fn holds the context), or every forward without a backward keeps
    its activations until the garbage collector runs (the kernel pass: cudaMalloc anew on
    every call). The kernel pass is stood in for on the CPU (its launches patched out)."""
    import dataclasses
    import gc
    import weakref

    config = MoKConfig(backend="reference")
    inputs = make_moe_inputs(seed=21)
    ws = _workspace(inputs, config)
    sched = mok.build_schedule(ws, config, inputs["topk_idx"])
    if backend == "kernel":
        monkeypatch.setattr(mok.kernel_backend, "forward",
                            lambda ws, sched, x, *args: (x * 2, object()))
        ws = dataclasses.replace(ws, arena=object())
    x = inputs["x"].clone().requires_grad_()
    gc.collect()
    gc.disable()
    try:
        y = mok.MoKFunction.apply(x, inputs["topk_w"], inputs["w1"], inputs["w2"], None, None,
                                  None, None, config, ws, sched, False, None, True)
        context = weakref.ref(y.grad_fn.mok[3])
        assert context() is not None
        del y
        assert context() is None, "the forward context outlived its output"
    finally:
        gc.enable()
