"""Bad input raises a TypeError/ValueError naming the argument, before any compute."""

import pytest
import torch

from megatron_mok import functional as mok
from megatron_mok import reference
from megatron_mok.activations import ExpertActivation
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs


def _call(**overrides):
    inputs = make_moe_inputs(shared_inter=8)
    inputs.update(overrides)
    return mok.fused_moe(**inputs)


@pytest.mark.parametrize("name, bad, error, match", [
    ("x", make_moe_inputs()["x"].int(), TypeError, "x must have dtype"),
    ("x", torch.randn(48, 32, 2).bfloat16(), ValueError, "x must be 2-D"),
    ("topk_idx", make_moe_inputs()["topk_idx"].float(), TypeError, "topk_idx must have dtype"),
    ("topk_idx", torch.zeros(47, 2, dtype=torch.int32), ValueError, "topk_idx has 47 rows"),
    ("topk_w", make_moe_inputs()["topk_w"].bfloat16(), TypeError, "topk_w must have dtype"),
    ("topk_w", torch.rand(48, 3), ValueError, "topk_w shape"),
    ("w1", make_moe_inputs()["w1"].float(), TypeError, "w1 must have dtype"),
    ("w1", torch.randn(4, 31, 32).bfloat16(), ValueError, "w1 must be"),
    ("w2", torch.randn(4, 32, 15).bfloat16(), ValueError, "w2 must be"),
    ("shared_w1", torch.randn(16, 31).bfloat16(), ValueError, "shared_w1 must be"),
    ("shared_w2", torch.randn(33, 8).bfloat16(), ValueError, "shared_w2 must be"),
    ("shared_w2", None, ValueError, "given together"),
])
def test_bad_shape_or_dtype(name, bad, error, match):
    with pytest.raises(error, match=match):
        _call(**{name: bad})


def test_device_mismatch():
    with pytest.raises(ValueError, match="topk_w is on meta"):
        _call(topk_w=torch.empty(48, 2, device="meta"))


def test_non_contiguous():
    w1 = make_moe_inputs()["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="w1 must be contiguous"):
        _call(w1=w1)


@pytest.mark.parametrize("bad_id", [4, 100, -2])
def test_expert_id_out_of_range(bad_id):
    idx = make_moe_inputs()["topk_idx"].clone()
    idx[7, 1] = bad_id
    with pytest.raises(ValueError, match=r"topk_idx holds expert ids .* must be in \[-1, 4\)"):
        _call(topk_idx=idx)
    with pytest.raises(ValueError, match="topk_idx holds expert ids"):
        reference.moe_reference(**{**make_moe_inputs(), "topk_idx": idx})


def test_schedule_rejects_routing_of_another_shape():
    inputs = make_moe_inputs()
    ws = mok.get_workspace(MoKConfig(), None, device="cpu", num_local_tokens=48, hidden_size=32,
                           topk=2, num_local_experts=4)
    with pytest.raises(ValueError, match="topk_idx must be"):
        mok.build_schedule(ws, MoKConfig(), inputs["topk_idx"][:40])


@pytest.mark.parametrize("field, value, match", [
    ("fwd_num_comm_sms", 0, "fwd_num_comm_sms"),
    ("bwd_num_comm_sms", 2.5, "bwd_num_comm_sms"),
    ("minibatch_size", 100, "minibatch_size"),
    ("macrobatch_size", 4096 + 128, "macrobatch_size"),
    ("schedule_capacity_multiplier", 0, "schedule_capacity_multiplier"),
    ("backend", "triton", "backend"),
])
def test_unsupported_config_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        MoKConfig(**{field: value})


def test_comm_sms_must_leave_compute_sms():
    with pytest.raises(ValueError, match="fwd_num_comm_sms=132"):
        MoKConfig(fwd_num_comm_sms=132).check_num_sms(132)
    MoKConfig(fwd_num_comm_sms=131, bwd_num_comm_sms=8).check_num_sms(132)


@pytest.mark.parametrize("config, match", [
    (MoKConfig(backend="kernel", activation=ExpertActivation("gelu", gated=True)),
     "GLU experts of silu or quick_gelu"),
    (MoKConfig(backend="kernel", fp8="blockwise"), "opt-in: set MOK_FP8_KERNELS=1"),
])
def test_kernel_backend_refuses_what_it_cannot_run_even_where_it_loads(monkeypatch, config,
                                                                       match):
    """With the extension loadable (patched: this is the CPU machine), the config itself
    is the reason given; 'auto' runs the reference for it instead."""
    import dataclasses

    from megatron_mok import backend_choice
    monkeypatch.setattr(backend_choice.ops, "kernel_backend_status",
                        lambda device, dtype=None: (True, ""))
    cpu = torch.device("cpu")
    assert backend_choice.resolve_backend(MoKConfig(backend="kernel"), cpu) == "kernel"
    with pytest.raises(RuntimeError, match=f"not available here: .*{match}"):
        backend_choice.resolve_backend(config, cpu)
    auto = dataclasses.replace(config, backend="auto")
    assert backend_choice.resolve_backend(auto, cpu) == "reference"


def test_a_kernel_pass_checks_its_own_config():
    """A pass whose config asks for what the kernel does not run by default (FP8 here) on a kernel
    workspace raises before any launch, not a silent BF16 pass."""
    import dataclasses

    inputs = make_moe_inputs(num_tokens=40, hidden=256, inter=128, num_local_experts=4,
                             topk=2, seed=3)
    reference_config = MoKConfig(backend="reference")
    ws = mok.get_workspace(reference_config, None, device="cpu", num_local_tokens=40,
                           hidden_size=256, topk=2, num_local_experts=4, dtype=torch.bfloat16)
    sched = mok.build_schedule(ws, reference_config, inputs["topk_idx"])
    kernel_ws = dataclasses.replace(ws, arena=object())  # never reached: refused first
    fp8 = MoKConfig(backend="reference", fp8="blockwise", fp8_wgrad="fp8")
    with pytest.raises(ValueError, match="opt-in: set MOK_FP8_KERNELS=1"):
        mok.forward(fp8, kernel_ws, sched, inputs["x"], inputs["topk_w"], inputs["w1"],
                    inputs["w2"])
