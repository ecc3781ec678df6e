"""Blockwise FP8 through the functional API and the Megatron adapter (reference backend):
fused_moe with MoKConfig(fp8="blockwise") runs the FP8 spec (megatron_mok.reference_fp8)
bit for bit, forward and backward; the shared expert stays BF16; MokMoELayer takes it from
--mok-fp8 or Megatron's --fp8-format e4m3 --fp8-recipe blockwise; what the spec does not
cover yet is refused, saying what to pass."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_mok import activations as A
from megatron_mok import knobs
from megatron_mok import functional as mok
from megatron_mok import reference, reference_fp8
from megatron_mok.backend_choice import resolve_backend
from megatron_mok.config import MoKConfig
from megatron_mok.validation import check_fp8_pass, check_kernel_config
from moe_inputs import make_moe_inputs, rel_l2

FP8 = MoKConfig(backend="reference", fp8="blockwise")
SHAPE = dict(num_tokens=80, hidden=256, inter=128, num_local_experts=4, topk=2,
             drop_fraction=0.1)


def _grads(fn, inputs, dy):
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = fn(**leaves)
    y.backward(dy)
    return y.detach(), {k: v.grad for k, v in leaves.items() if v.is_floating_point()}


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fused_moe_runs_the_fp8_spec_bit_for_bit(wgrad):
    inputs = make_moe_inputs(**SHAPE, shared_inter=128, seed=11)
    dy = torch.randn(80, 256, generator=torch.Generator().manual_seed(12)).bfloat16()
    config = MoKConfig(backend="reference", fp8="blockwise", fp8_wgrad=wgrad)
    y, g = _grads(lambda **kw: mok.fused_moe(**kw, config=config), inputs, dy)
    y_spec, g_spec = _grads(lambda **kw: reference_fp8.moe_reference_fp8(**kw, wgrad=wgrad),
                            inputs, dy)
    assert torch.equal(y, y_spec)
    assert g.keys() == g_spec.keys() == {"x", "topk_w", "w1", "w2", "shared_w1", "shared_w2"}
    for name in g:
        assert torch.equal(g[name], g_spec[name]), name
    # FP8 is really applied: a few % from the BF16 spec, not 0 (and not far off).
    y_bf16, g_bf16 = _grads(reference.moe_reference, inputs, dy)
    assert 1e-3 < rel_l2(y, y_bf16) < 0.1
    # The shared expert is BF16 (as MoK): dW2_shared = act_shared^T dy, no FP8 on its path.
    assert rel_l2(g["shared_w2"], g_bf16["shared_w2"]) < 1e-2


def test_recompute_gives_the_same_bits():
    inputs = make_moe_inputs(**SHAPE, seed=13)
    dy = torch.randn(80, 256, generator=torch.Generator().manual_seed(14)).bfloat16()
    y, g = _grads(lambda **kw: mok.fused_moe(**kw, config=FP8), inputs, dy)
    y_r, g_r = _grads(lambda **kw: mok.fused_moe(**kw, config=FP8, recompute=True), inputs, dy)
    assert torch.equal(y, y_r) and all(torch.equal(g[k], g_r[k]) for k in g)


def test_what_fp8_does_not_cover_yet_is_refused():
    inputs = make_moe_inputs(**{**SHAPE, "inter": 96}, seed=15)
    with pytest.raises(ValueError, match="multiples of 128.*or run the MoE layers in BF16"):
        mok.fused_moe(**inputs, config=FP8)
    ok = dict(hidden=256, inter=128, biases=False)
    check_fp8_pass(FP8, **ok)  # no EP limit: the spec runs at every EP size
    with pytest.raises(ValueError, match="SwiGLU experts.*--swiglu"):
        check_fp8_pass(MoKConfig(fp8="blockwise", activation=A.GPT_OSS), **ok)
    with pytest.raises(ValueError, match="without biases.*--disable-bias-linear"):
        check_fp8_pass(FP8, hidden=256, inter=128, biases=True)
    check_fp8_pass(MoKConfig(), hidden=8, inter=8, biases=True)  # BF16: no limits
    with pytest.raises(ValueError, match="opt-in: set MOK_FP8_KERNELS=1.*--mok-backend reference"):
        check_kernel_config(FP8)
    knobs.set_env("MOK_FP8_KERNELS", "1")
    try:
        with pytest.raises(ValueError, match="--mok-fp8-wgrad bf16.*--mok-backend reference"):
            check_kernel_config(dataclasses.replace(FP8, fp8_wgrad="fp8"))
        check_kernel_config(dataclasses.replace(FP8, fp8_wgrad="bf16"))  # the kernels' FP8
        with pytest.raises(ValueError, match="FP8 runs at EP = 1.*--expert-model-parallel-size 1"):
            check_kernel_config(dataclasses.replace(FP8, fp8_wgrad="bf16"), ep_size=2)
    finally:
        knobs.set_env("MOK_FP8_KERNELS", None)
    with pytest.raises(RuntimeError, match="not available"):
        resolve_backend(MoKConfig(backend="kernel", fp8="blockwise"), torch.device("cpu"))
    with pytest.raises(ValueError, match="MXFP8 is Blackwell's"):
        MoKConfig(fp8="mxfp8")
    with pytest.raises(ValueError, match="fp8_wgrad"):
        MoKConfig(fp8_wgrad="fp16")


def test_megatron_fp8_flags_select_blockwise_or_fail_naming_it():
    import megatron_mok.megatron  # noqa: F401
    from megatron_mok.megatron.layer import _check_fp8
    assert _check_fp8(SimpleNamespace(fp8=None, fp8_recipe="delayed")) is None
    assert _check_fp8(SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise")) == "blockwise"
    for recipe in ("mxfp8", "delayed", "tensorwise"):
        with pytest.raises(ValueError, match="on Hopper the FP8 recipe is blockwise.*; pass "
                                             "--fp8-recipe blockwise"):
            _check_fp8(SimpleNamespace(fp8="e4m3", fp8_recipe=recipe))
    with pytest.raises(ValueError, match="in E4M3.*; pass --fp8-format e4m3"):
        _check_fp8(SimpleNamespace(fp8="hybrid", fp8_recipe="blockwise"))


def test_mok_fp8_flag_reaches_the_config():
    import argparse
    from megatron_mok.megatron.args import add_mok_args, mok_config_from_args
    parser = add_mok_args(argparse.ArgumentParser())
    config = mok_config_from_args(parser.parse_args(["--mok-fp8", "blockwise",
                                                     "--mok-fp8-wgrad", "bf16"]))
    assert config.fp8 == "blockwise" and config.fp8_wgrad == "bf16"
    assert mok_config_from_args(parser.parse_args([])).fp8 is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--mok-fp8", "mxfp8"])
    # Given to a run of another dispatcher they would do nothing: a warning names them.
    from megatron_mok.megatron.args import warn_mok_flags_without_mok
    args = parser.parse_args(["--mok-fp8", "blockwise"])
    args.moe_token_dispatcher_type = "alltoall"
    with pytest.warns(UserWarning, match="--mok-fp8 only apply with --moe-token-dispatcher"):
        warn_mok_flags_without_mok(args)
    args.moe_token_dispatcher_type = "mok"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_mok_flags_without_mok(args)
        warn_mok_flags_without_mok(parser.parse_args([]))  # nothing set: nothing to say


def _layer_fn(rank, world_size):
    """MokMoELayer with --mok-fp8 blockwise: its output is the FP8 spec of its own router's
    choice and its experts' weights (at EP > 1 the spec over the EP group, this rank's
    experts); construction refuses H or I off the 128 grid."""
    import test_dispatcher_contract as contract
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron_mok.megatron import MokMoELayer
    from megatron_mok.megatron.layer import expert_weight_list
    contract._setup(world_size)
    spec = get_moe_module_spec(use_te=False, num_experts=contract.EXPERTS, moe_grouped_gemm=False)
    sizes = dict(hidden_size=128, ffn_hidden_size=256, moe_ffn_hidden_size=128)
    torch.manual_seed(5)
    layer = MokMoELayer(contract._config("mok", **sizes), submodules=spec.keywords["submodules"],
                        layer_number=1, mok_config=FP8)
    assert layer.mok_config.fp8 == "blockwise"
    hidden = torch.randn(8, 3, 128, generator=torch.Generator().manual_seed(1))
    probs, routing_map = layer.router(hidden.view(-1, 128))
    topk_w, topk_idx = probs.topk(2, dim=1)  # the router's top-2 (probs are 0 elsewhere)
    out, _ = layer(hidden)
    fc1, fc2 = expert_weight_list(layer.experts)
    from megatron.core import parallel_state
    group = parallel_state.get_expert_model_parallel_group() if world_size > 1 else None
    want = reference_fp8.moe_reference_fp8(
        hidden.view(-1, 128), topk_idx.int(), topk_w.float(), torch.stack(fc1),
        torch.stack(fc2), group=group)
    assert rel_l2(out.view(-1, 128), want) < 1e-6
    with pytest.raises(ValueError, match="multiples of 128"):
        MokMoELayer(contract._config("mok"), submodules=spec.keywords["submodules"],
                    layer_number=1, mok_config=FP8)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_mok_moe_layer_runs_fp8_from_its_config(ep_size):
    from dist_utils import run_distributed
    run_distributed(_layer_fn, ep_size)
