"""A tiny GPT-MoE built by megatron-core with `mok` vs the stock `alltoall` dispatcher,
on CPU with gloo, EP=1 and EP=2 (two processes), with and without a shared expert:
the same parameters (one state dict loads into both), the same loss and the same
gradient for every parameter, router included, within fp32 tolerance. Checkpoints
written through Megatron's distributed checkpointing load across dispatchers."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron_mok import knobs

VOCAB, SEQ, BATCH = 64, 16, 4


def _setup(ep_size):
    from megatron_mok.megatron.cpu_shims import apply_cpu_shims
    apply_cpu_shims()
    import megatron_mok.megatron  # noqa: F401  (registers the "mok" dispatcher type)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size)
    model_parallel_cuda_manual_seed(123)


def _build(dispatcher, shared, seed=7):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_mok.config import MoKConfig
    from megatron_mok.megatron import gpt_decoder_block_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=shared, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=dist.get_world_size(), moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        moe_router_dtype="fp32", init_method_std=0.2, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False)
    if dispatcher == "mok":
        spec = gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      mok_config=MoKConfig(backend="reference"))
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def _loss(model, seed=0):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    clear_aux_losses_tracker()
    per_token = model(tokens, position_ids, None, labels=labels)
    return per_token.float().mean()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity_fn(rank, ep_size, shared):
    _setup(ep_size)
    ref, mok = _build("alltoall", shared), _build("mok", shared)
    from megatron_mok.megatron import MokMoELayer
    assert any(isinstance(m, MokMoELayer) for m in mok.modules())
    assert not any(isinstance(m, MokMoELayer) for m in ref.modules())
    # Same parameter names and shapes: alltoall's weights load as they are.
    mok.load_state_dict(ref.state_dict(), strict=True)
    # ... into memory that keeps each weight's experts back to back: read without a copy.
    from megatron_mok.megatron.expert_weights import stacked_alias
    from megatron_mok.megatron.layer import expert_weight_list
    for layer in (m for m in mok.modules() if isinstance(m, MokMoELayer)):
        for weights in expert_weight_list(layer.experts):
            assert stacked_alias(weights) is not None
    g_mok = _assert_same_step(ref, mok, _loss(ref), _loss(mok), rank)
    assert any("router" in n for n in g_mok) and any("experts" in n for n in g_mok)


def _assert_same_step(ref, mok, loss_ref, loss_mok, rank):
    """Backward both; the losses within fp32 tolerance and every parameter's gradient
    within 2e-4 of its largest entry. Returns mok's gradients."""
    loss_ref.backward()
    loss_mok.backward()
    torch.testing.assert_close(loss_mok, loss_ref, rtol=1e-5, atol=1e-6)
    g_ref, g_mok = _grads(ref), _grads(mok)
    assert g_ref.keys() == g_mok.keys()
    for name in g_ref:
        scale = g_ref[name].abs().max().clamp_min(1e-12)
        err = (g_mok[name] - g_ref[name]).abs().max() / scale
        assert err < 2e-4, f"rank {rank} {name}: max rel err {float(err):.2e}"
    return g_mok


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("shared", [None, 32])
def test_mok_matches_alltoall(ep_size, shared):
    run_distributed(_parity_fn, ep_size, shared)


def _folded_parity_fn(rank, ep_size):
    # The shared expert as wide as the routed ones (24), folded into the fused pass.
    knobs.set_env("MOK_SHARED_EXPERT", "folded")
    import megatron_mok.shared_fold as shared_fold
    folds = []
    fold = shared_fold.fold_routing
    shared_fold.fold_routing = lambda *a: folds.append(1) or fold(*a)
    _parity_fn(rank, ep_size, 24)
    assert folds, "the shared expert was not folded"


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_mok_with_folded_shared_expert_matches_alltoall(ep_size):
    run_distributed(_folded_parity_fn, ep_size)


def _backwards_fn(rank, ep_size):
    """The distributed optimizer's layout of a TEGroupedMLP: each weight's experts re-homed
    back to back in reverse order. The layer reads them in place, backwards, with the
    routing renumbered to match, and still matches alltoall exactly."""
    import warnings
    from megatron_mok.megatron import MokMoELayer
    from megatron_mok.megatron.layer import expert_weight_list
    _setup(ep_size)
    ref, mok = _build("alltoall", None), _build("mok", None)
    mok.load_state_dict(ref.state_dict(), strict=True)
    layers = [m for m in mok.modules() if isinstance(m, MokMoELayer)]
    for layer in layers:
        for weights in expert_weight_list(layer.experts):
            flat = torch.stack([p.detach() for p in weights[::-1]])  # expert E-1 first
            for e, p in enumerate(weights):
                p.data = flat[len(weights) - 1 - e]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss_ref, loss_mok = _loss(ref), _loss(mok)
    # No "moved after construction": read in place, backwards.
    assert not [w for w in seen if "moved after construction" in str(w.message)]
    assert all(layer._reverse for layer in layers)
    _assert_same_step(ref, mok, loss_ref, loss_mok, rank)


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_experts_laid_out_backwards_are_read_in_place(ep_size):
    run_distributed(_backwards_fn, ep_size)


def _rehomed_fn(rank, world_size):
    import warnings
    from megatron_mok.megatron import MokMoELayer
    from megatron_mok.megatron.layer import expert_weight_list
    _setup(world_size)
    model = _build("mok", None)
    layers = [m for m in model.modules() if isinstance(m, MokMoELayer)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            in_place = _loss(model)
            # What a dtype cast or the distributed optimizer's buffer does: each expert's
            # weight gets its own memory. The layer must notice, say so once, and copy.
            for layer in layers:
                for weights in expert_weight_list(layer.experts):
                    for p in weights:
                        p.data = p.data.clone()
            copied, again = _loss(model), _loss(model)
    moved = [w for w in seen if "moved after construction" in str(w.message)]
    assert len(moved) == len(layers) == 2, [str(w.message) for w in seen]
    assert torch.equal(copied, in_place) and torch.equal(again, in_place)


@pytest.mark.slow
def test_rehomed_expert_weights_warn_once_and_still_match():
    run_distributed(_rehomed_fn, 1)


def _with_main_grads(model):
    """Megatron's DDP in miniature: one fp32 grad buffer holding the parameters backwards,
    each start padded to 64 elements (the distributed optimizer's layout), `main_grad`
    views into it, and the hook that adds param.grad unless the layer already added it."""
    params = [p for p in model.parameters() if p.requires_grad]
    starts, end = [], 0
    for p in reversed(params):
        end = -(-end // 64) * 64
        starts.append(end)
        end += p.numel()
    flat = torch.zeros(end)

    def hook(p):
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    for p, start in zip(reversed(params), starts):
        p.main_grad = flat[start:start + p.numel()].view(p.shape)
        p.grad_added_to_main_grad = False
        p.register_post_accumulate_grad_hook(hook)
    return flat


def _main_grad_fn(rank, world_size, folded=False):
    from megatron_mok.config import MoKConfig
    from megatron_mok.megatron import MokMoELayer
    from megatron_mok.megatron.layer import expert_weight_list
    _setup(world_size)
    shared = 24 if folded else None  # the routed experts' width: foldable
    unfused = _build("mok", shared)
    if folded:
        knobs.set_env("MOK_SHARED_EXPERT", "folded")  # read at construction
    fused = _build("mok", shared)
    knobs.set_env("MOK_SHARED_EXPERT", None)
    fused.load_state_dict(unfused.state_dict())
    layers = [m for m in fused.modules() if isinstance(m, MokMoELayer)]
    for layer in layers:
        layer.mok_config = MoKConfig(backend="reference", main_grad_fusion="on")
    buffers = [_with_main_grads(m) for m in (unfused, fused)]
    for seed in (0, 1):  # two micro-batches accumulate
        for model in (unfused, fused):
            _loss(model, seed).backward()
    assert buffers[0].abs().sum() > 0
    # Folded, the shared output joins the fp32 combine instead of MoELayer's later add:
    # the same gradients to fp32 rounding.
    tol = dict(rtol=1e-4, atol=1e-6) if folded else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(buffers[1], buffers[0], **tol)
    for layer in layers:
        fc1, fc2 = expert_weight_list(layer.experts)
        assert all(p.grad_added_to_main_grad and p.grad is None for p in (*fc1, *fc2))
        if folded:  # E_loc + 1 buffers, the shared weights' last and added too
            shared = layer.shared_experts
            assert all(len(acc.buffers) == len(fc1) + 1 for acc in layer._accumulators)
            assert shared.linear_fc1.weight.grad_added_to_main_grad
            assert shared.linear_fc2.weight.grad_added_to_main_grad
            # Here one buffer holds everything and the shared weights, registered right after
            # the experts, continue their spacing: one launch. (In Megatron the shared
            # expert's main_grad lies in the dense buffer: a second launch.)
            assert all([r[:2] for r in acc.fused_runs] == [(0, len(fc1) + 1)]
                       for acc in layer._accumulators)
            continue
        # SequentialMLP's fc1 and fc2 interleave backwards: one wgrad launch reaches all.
        assert all(acc.fused_target is not None and acc.fused_target[1]
                   for acc in layer._accumulators)
    assert not any(p.grad_added_to_main_grad for n, p in unfused.named_parameters())
    if folded:
        return
    # Not Megatron's DDP (no grad_added_to_main_grad), its FSDP, or main_grads the fused
    # add cannot take (mixed dtypes): the layer leaves main_grad to DDP's hook.
    layer = layers[0]
    fc1, fc2 = expert_weight_list(layer.experts)
    assert layer._main_grad_accumulators(fc1, fc2) is not None
    del fc1[0].grad_added_to_main_grad
    assert layer._main_grad_accumulators(fc1, fc2) is None
    fc1[0].grad_added_to_main_grad = False
    fc1[0].__fsdp_param__ = True
    assert layer._main_grad_accumulators(fc1, fc2) is None
    del fc1[0].__fsdp_param__
    fc2[0].main_grad = fc2[0].main_grad.double()
    assert layer._main_grad_accumulators(fc1, fc2) is None


@pytest.mark.slow
@pytest.mark.parametrize("folded", [False, True])
def test_expert_weight_grads_go_straight_into_main_grad(folded):
    run_distributed(_main_grad_fn, 1, folded)


def _checkpoint_fn(rank, ep_size, ckpt_root):
    from megatron.core import dist_checkpointing
    _setup(ep_size)
    for src, dst in (("alltoall", "mok"), ("mok", "alltoall")):
        saved = _build(src, 32, seed=11)
        path = os.path.join(ckpt_root, f"{src}_to_{dst}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(saved.sharded_state_dict(), path)
        loaded = _build(dst, 32, seed=99)  # different init: the checkpoint must overwrite it
        with torch.no_grad():
            before = _loss(loaded)
        state = dist_checkpointing.load(loaded.sharded_state_dict(), path)
        loaded.load_state_dict(state, strict=False)
        with torch.no_grad():
            loss_saved, loss_loaded = _loss(saved), _loss(loaded)
        assert not torch.allclose(before, loss_saved)
        torch.testing.assert_close(loss_loaded, loss_saved, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_checkpoint_moves_between_dispatchers(tmp_path, ep_size):
    run_distributed(_checkpoint_fn, ep_size, str(tmp_path))


@pytest.mark.parametrize("kwargs, flag", [
    ({"activation_func": torch.tanh}, "--swiglu"),
    ({"moe_mlp_glu_interleave_size": 32}, "--moe-mlp-glu-interleave-size"),
    ({"expert_tensor_parallel_size": 2}, "--expert-tensor-parallel-size"),
    ({"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_apply_probs_on_input": True}, "--moe-apply-probs-on-input"),
])
def test_unsupported_megatron_configs_fail_naming_the_flag(kwargs, flag):
    import megatron_mok.megatron  # noqa: F401  (registers "mok")
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_mok.megatron.layer import check_mok_supported
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, moe_token_dispatcher_type="mok")
    config = TransformerConfig(**{**base, **kwargs})
    with pytest.raises(ValueError, match=flag) as err:
        check_mok_supported(config)
    assert "; pass " in str(err.value)  # every refusal says what to pass instead
    check_mok_supported(TransformerConfig(**base))
    # FP8 weight copies (set after construction: without Transformer Engine Megatron's
    # own check refuses FP8 first).
    config = TransformerConfig(**base)
    config.fp8, config.fp8_recipe, config.fp8_param = "e4m3", "blockwise", True
    with pytest.raises(ValueError, match="--fp8-param-gather.*; pass "):
        check_mok_supported(config)


def _hooks_fn(rank, world_size):
    """The fused pass reads weights of modules whose forward never runs (the experts', a
    folded shared expert's); their forward pre-hooks (Megatron DDP's wait for the
    --overlap-param-gather all-gather) must run all the same, once per forward."""
    from megatron_mok.megatron import MokMoELayer
    _setup(world_size)
    knobs.set_env("MOK_SHARED_EXPERT", "folded")
    model = _build("mok", 24)
    knobs.set_env("MOK_SHARED_EXPERT", None)
    calls = []
    for layer in (m for m in model.modules() if isinstance(m, MokMoELayer)):
        assert layer._shared_weights is not None
        owners = [m for m in layer.experts.modules() if list(m.parameters(recurse=False))]
        owners += [layer.shared_experts.linear_fc1, layer.shared_experts.linear_fc2]
        for m in owners:
            m.register_forward_pre_hook(lambda module, args: calls.append(module))
            m.register_forward_pre_hook(lambda module, args, kwargs: calls.append(module),
                                        with_kwargs=True)
        expected = 2 * len(owners)
    with torch.no_grad():
        _loss(model)
    assert len(calls) == 2 * expected  # two layers, every hook once
    # Configurations where MoELayer must run the shared expert itself.
    from megatron_mok.megatron.layer import expert_weight_list
    knobs.set_env("MOK_SHARED_EXPERT", "folded")
    layer = next(m for m in model.modules() if isinstance(m, MokMoELayer))
    fc1, fc2 = expert_weight_list(layer.experts)
    assert layer._foldable_shared_weights(fc1, fc2) is not None
    for attr, value in (("tensor_model_parallel_size", 2), ("moe_shared_expert_gate", True),
                        ("cuda_graph_impl", "transformer_engine"),
                        ("moe_shared_expert_intermediate_size", 48)):
        before = getattr(layer.config, attr)
        setattr(layer.config, attr, value)
        assert layer._foldable_shared_weights(fc1, fc2) is None, attr
        setattr(layer.config, attr, before)
    # FP8 keeps the shared expert in BF16: never folded into the FP8 experts.
    import dataclasses
    bf16_config = layer.mok_config
    layer.mok_config = dataclasses.replace(bf16_config, fp8="blockwise")
    assert layer._foldable_shared_weights(fc1, fc2) is None
    layer.mok_config = bf16_config
    knobs.set_env("MOK_SHARED_EXPERT", None)


@pytest.mark.slow
def test_weight_modules_forward_pre_hooks_run():
    run_distributed(_hooks_fn, 1)
