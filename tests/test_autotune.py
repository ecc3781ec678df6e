"""Autotune cache and plan resolution (CPU): keys, the JSON cache, precedence of
MOK_FORWARD / MOK_BACKWARD over the cache over the config, candidates per EP size, the
config flag and its Megatron argument. The GPU side (tune() and tune_backward() timing
real plans) is in test_megakernel.py and test_backward_megakernel.py."""

import argparse
import types

import pytest
import torch

from megatron_mok.kernels import autotune, megakernel
from megatron_mok.config import MoKConfig


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOK_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("MOK_FORWARD", raising=False)
    monkeypatch.delenv("MOK_BACKWARD", raising=False)
    monkeypatch.delenv("MOK_BACKWARD_MINIBATCH", raising=False)
    autotune.forget_cache()
    yield
    autotune.forget_cache()


def _ws(ep_size=1, hidden=2048):
    return types.SimpleNamespace(device=torch.device("cpu"), num_tokens=4096, hidden_size=hidden,
                                 num_local_experts=16, topk=8, ep_size=ep_size)


def test_plan_key_names_gpu_and_shape():
    key = autotune.plan_key("NVIDIA H200", 8192, 7168, 2048, 32, 8, 1)
    assert key == "NVIDIA H200|T=8192|H=7168|I=2048|E_loc=32|K=8|EP=1"
    assert autotune.workspace_key(_ws(), 768) == "cpu|T=4096|H=2048|I=768|E_loc=16|K=8|EP=1"


def test_store_then_lookup_from_disk():
    plan = autotune.ForwardPlan("megakernel", 0, 2048)
    autotune.store("k", plan, {"launches": 1.5, "megakernel-direct/mb2048": 1.2})
    autotune.forget_cache()  # a new process reads the file
    assert autotune.lookup("k") == plan
    assert autotune.lookup("other") is None


def test_unreadable_cache_is_ignored_with_a_warning():
    autotune.cache_file().write_text("{not json")
    with pytest.warns(UserWarning, match="autotune cache"):
        assert autotune.lookup("k") is None


def test_cached_plan_with_an_unknown_path_is_ignored():
    autotune.store("k", autotune.ForwardPlan("warp-drive", 0, 0), {})
    assert autotune.lookup("k") is None


def test_precedence_env_over_cache_over_config(monkeypatch):
    monkeypatch.setattr(megakernel, "available", lambda: True)
    config = MoKConfig(fwd_num_comm_sms=12, minibatch_size=1024)
    ws = _ws()
    # No cache entry: the spread megakernel at EP = 1 where it runs, else the chain.
    default = autotune.ForwardPlan("megakernel-spread", 12, 1024)
    assert autotune.forward_plan(ws, 768, config) == default
    big = _ws(hidden=megakernel.MAX_HIDDEN + 8)
    assert autotune.forward_plan(big, 768, config) == autotune.ForwardPlan("launches", 12, 1024)
    cached = autotune.ForwardPlan("megakernel", 0, 4096)
    autotune.store(autotune.workspace_key(ws, 768), cached, {})
    assert autotune.forward_plan(ws, 768, config) == cached
    assert autotune.forward_plan(ws, 768, MoKConfig(autotune=False)) == \
        autotune.ForwardPlan("megakernel-spread", 24, 4096)
    monkeypatch.setenv("MOK_FORWARD", "launches")
    assert autotune.forward_plan(ws, 768, config) == autotune.ForwardPlan("launches", 12, 1024)
    monkeypatch.setenv("MOK_FORWARD", "megakernel")
    assert autotune.forward_plan(ws, 768, config) == autotune.ForwardPlan("megakernel", 12, 1024)


def test_cached_megakernel_plan_falls_back_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(megakernel, "available", lambda: True)
    ws = _ws(hidden=megakernel.MAX_HIDDEN + 8)
    autotune.store(autotune.workspace_key(ws, 768), autotune.ForwardPlan("megakernel", 0, 2048), {})
    assert autotune.forward_plan(ws, 768, MoKConfig()).path == "launches"
    monkeypatch.setattr(megakernel, "available", lambda: False)
    ws = _ws()
    autotune.store(autotune.workspace_key(ws, 768), autotune.ForwardPlan("megakernel", 0, 2048), {})
    assert autotune.forward_plan(ws, 768, MoKConfig()).path == "launches"


def test_candidates_per_ep_size():
    ep1 = autotune.candidates(1, 132)
    assert ep1[0].path == "launches"
    assert {p.minibatch_rows for p in ep1 if p.path == "megakernel"} == set(autotune.MINIBATCHES)
    assert all(p.num_comm_sms == 0 for p in ep1 if p.path == "megakernel")
    ep8 = autotune.candidates(8, 132)
    assert not any(p.path == "megakernel" and p.num_comm_sms == 0 for p in ep8)  # no direct
    assert all(0 < p.num_comm_sms < 20 for p in autotune.candidates(8, 20)
               if p.path in ("megakernel", "megakernel-comm") and p.num_comm_sms)
    for plans in (ep1, ep8):  # spread mode (no comm CTAs) at every EP
        assert {p.num_comm_sms for p in plans if p.path == "megakernel-spread"} == {0}
        assert any(p.path == "megakernel-spread" for p in plans)


def test_config_flag_and_megatron_argument():
    with pytest.raises(ValueError, match="autotune"):
        MoKConfig(autotune="yes")
    from megatron_mok.megatron.args import add_mok_args, mok_config_from_args
    parser = add_mok_args(argparse.ArgumentParser())
    assert mok_config_from_args(parser.parse_args([])).autotune
    assert not mok_config_from_args(parser.parse_args(["--mok-no-autotune"])).autotune
    # Upstream Megatron-LM's MoK knob names are aliases of ours.
    config = mok_config_from_args(parser.parse_args([
        "--mok-fwd-num-comm-sms", "8", "--mok-bwd-num-comm-sms", "4",
        "--mok-schedule-capacity-multiplier", "0.9"]))
    assert (config.fwd_num_comm_sms, config.bwd_num_comm_sms,
            config.schedule_capacity_multiplier) == (8, 4, 0.9)


def test_backward_plan_precedence_env_over_cache_over_default(monkeypatch):
    monkeypatch.setattr(megakernel, "backward_available", lambda: True)
    ws, bf16 = _ws(), torch.bfloat16
    launches = autotune.BackwardPlan("launches", 2048)
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, True) == launches  # default
    cached = autotune.BackwardPlan("megakernel", 4096)
    autotune.store(autotune.backward_key(ws, 768), cached, {"launches": 2.0})
    autotune.forget_cache()  # from disk, next to the forward's entries
    assert autotune.backward_key(ws, 768) == autotune.workspace_key(ws, 768) + "|bwd"
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, True) == cached
    assert autotune.backward_plan(ws, 768, MoKConfig(autotune=False), bf16, True) == launches
    # Where the megakernel cannot run (slots at EP = 1, fp32, not built): the chain.
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, False) == launches
    assert autotune.backward_plan(ws, 768, MoKConfig(), torch.float32, True) == launches
    monkeypatch.setenv("MOK_BACKWARD", "launches")
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, True) == launches
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    monkeypatch.setenv("MOK_BACKWARD_MINIBATCH", "1024")
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, True) == \
        autotune.BackwardPlan("megakernel", 1024)
    monkeypatch.setattr(megakernel, "backward_available", lambda: False)
    autotune.forget_cache()  # resolved plans are memoised (the build does not change)
    assert autotune.backward_plan(ws, 768, MoKConfig(), bf16, True).path == "launches"


def test_backward_candidates_and_unknown_cached_path():
    plans = autotune.backward_candidates()
    assert plans[0] == autotune.BackwardPlan("launches", 0)
    assert {p.minibatch_rows for p in plans[1:]} == set(autotune.BACKWARD_MINIBATCHES)
    autotune.store("k|bwd", autotune.BackwardPlan("warp-drive", 0), {})
    assert autotune.lookup_backward("k|bwd") is None


def test_non_gated_experts_always_take_the_launch_chain(monkeypatch):
    """The megakernels' epilogues are the GLU ones: squared-ReLU / GeLU experts run the
    chain whatever MOK_FORWARD / MOK_BACKWARD or a cached plan say."""
    from megatron_mok.activations import SQUARED_RELU
    monkeypatch.setattr(megakernel, "backward_available", lambda: True)
    ws, bf16 = _ws(), torch.bfloat16
    config = MoKConfig(activation=SQUARED_RELU)
    for cfg in (MoKConfig(), config):  # megakernel plans under SwiGLU's key and its own
        autotune.store(autotune.workspace_key(ws, 768, cfg),
                       autotune.ForwardPlan("megakernel", 0, 1024), {"launches": 2.0})
        autotune.store(autotune.backward_key(ws, 768, cfg),
                       autotune.BackwardPlan("megakernel", 4096), {"launches": 2.0})
    autotune.forget_cache()
    assert autotune.forward_plan(ws, 768, MoKConfig()).path == "megakernel"  # SwiGLU: cached
    assert autotune.forward_plan(ws, 768, config).path == "launches"
    assert autotune.backward_plan(ws, 768, config, bf16, True).path == "launches"
    monkeypatch.setenv("MOK_FORWARD", "megakernel")
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    autotune.forget_cache()
    assert autotune.forward_plan(ws, 768, config).path == "launches"
    assert autotune.backward_plan(ws, 768, config, bf16, True).path == "launches"


def test_glu_and_biased_variants_are_keyed_and_looked_up_apart():
    """GPT-OSS's clamped GLU and biased experts run other epilogues: their plans live under
    their own keys (plain SwiGLU's key unchanged), and each layer reads its own entry."""
    from megatron_mok.activations import GPT_OSS
    ws = _ws()
    plain = autotune.workspace_key(ws, 768)
    assert autotune.workspace_key(ws, 768, MoKConfig()) == plain
    glu = MoKConfig(activation=GPT_OSS, expert_bias=True)
    assert autotune.workspace_key(ws, 768, glu) == \
        plain + "|act=quick_gelu-glu-clamp7-offset1|bias"
    assert autotune.workspace_key(ws, 768, MoKConfig(expert_bias=True)) == \
        plain + "|act=silu-glu|bias"
    assert autotune.backward_key(ws, 768, glu) == autotune.workspace_key(ws, 768, glu) + "|bwd"
    autotune.store(plain, autotune.ForwardPlan("megakernel", 0, 1024), {"launches": 2.0})
    autotune.store(autotune.workspace_key(ws, 768, glu), autotune.ForwardPlan("launches", 0, 0),
                   {"launches": 1.0})
    autotune.store(autotune.backward_key(ws, 768, glu), autotune.BackwardPlan("megakernel", 4096),
                   {"launches": 2.0})
    autotune.forget_cache()
    assert autotune.forward_plan(ws, 768, MoKConfig()).path == "megakernel"
    assert autotune.forward_plan(ws, 768, glu).path == "launches"
    # A variant nobody tuned falls back to the default, not to SwiGLU's entry.
    other = MoKConfig(activation=GPT_OSS)
    assert autotune.forward_plan(ws, 768, other) == \
        autotune.ForwardPlan("megakernel-spread", other.fwd_num_comm_sms, other.minibatch_size)


def test_tuning_refuses_non_gated_experts_and_half_biases():
    from megatron_mok.activations import SQUARED_RELU
    from megatron_mok.kernels import tuning
    with pytest.raises(ValueError, match="non-gated"):
        tuning.tune(None, None, None, None, None, config=MoKConfig(activation=SQUARED_RELU))
    with pytest.raises(ValueError, match="b1 and b2"):
        tuning.tune(None, None, None, None, None, b1=torch.zeros(1))
