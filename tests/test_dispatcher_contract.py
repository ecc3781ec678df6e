"""MokTokenDispatcher keeps Megatron's MoETokenDispatcher contract (contract mode): driven
step by step and inside a stock MoELayer it matches MoEAlltoAllTokenDispatcher exactly,
at EP = 1 and EP = 2 (two processes, gloo on the CPU); it says once that it runs
unfused; and MokMoELayer still gets the metadata-only fused mode."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from test_megatron_parity import _setup

HIDDEN, SEQ, BATCH, EXPERTS = 16, 8, 3, 4


def _config(dispatcher, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    base = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=32,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=dist.get_world_size(),
        moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        moe_router_dtype="fp32", init_method_std=0.2, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, moe_permute_fusion=False)
    return TransformerConfig(**{**base, **overrides})


def _dispatchers(**overrides):
    """(mok, alltoall) dispatchers of this rank's local experts, each with its own config."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron_mok.megatron import MokTokenDispatcher
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = EXPERTS // ep
    indices = list(range(rank * local, (rank + 1) * local))
    pgs = get_default_pg_collection()
    mok = MokTokenDispatcher(local, indices, config=_config("mok", **overrides),
                             pg_collection=pgs)
    ref = MoEAlltoAllTokenDispatcher(local, indices, config=_config("alltoall", **overrides),
                                     pg_collection=pgs)
    assert not mok.fused and isinstance(mok.unfused, MoEAlltoAllTokenDispatcher)
    return mok, ref


def _routing(g, drop):
    """hidden [S, B, H], routing_map bool [T, E] (K distinct experts per token, some
    routes removed when drop, as capacity dropping leaves them), probs [T, E] (nonzero
    exactly where routed)."""
    tokens = SEQ * BATCH
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    chosen = torch.rand(tokens, EXPERTS, generator=g).topk(2, dim=1).indices
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter_(1, chosen, True)
    if drop:
        routing_map &= torch.rand(tokens, EXPERTS, generator=g) > 0.25
    probs = torch.where(routing_map, torch.rand(tokens, EXPERTS, generator=g) + 0.05, 0.0)
    return hidden, routing_map, probs


def _six_steps(dispatcher, hidden, routing_map, probs, weights):
    """dispatch_preprocess -> token_dispatch -> dispatch_postprocess -> per-expert
    tanh(x W_e) * prob -> combine_preprocess -> token_combine -> combine_postprocess.
    Returns (output [S, B, H], tokens_per_expert, permuted tokens, permuted probs)."""
    x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, tokens_per_expert, p = dispatcher.dispatch_postprocess(x, p)
    chunks = torch.split(x, tokens_per_expert.tolist())
    y = torch.cat([torch.tanh(c @ w) for c, w in zip(chunks, weights)]) * p.unsqueeze(-1)
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    return dispatcher.combine_postprocess(y), tokens_per_expert, x, p


def _six_steps_fn(rank, ep_size):
    _setup(ep_size)
    for drop, overrides in ((False, {}), (True, {"moe_expert_capacity_factor": 1.0})):
        g = torch.Generator().manual_seed(100 + rank + 10 * drop)
        hidden, routing_map, probs = _routing(g, drop)
        weights = torch.randn(EXPERTS // ep_size, HIDDEN, HIDDEN, generator=g) * HIDDEN ** -0.5
        grad_out = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        mok, ref = _dispatchers(**overrides)
        results = []
        for dispatcher in (mok, ref):
            h, pr = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
            out, tpe, x, p = _six_steps(dispatcher, h, routing_map, pr, weights)
            (out * grad_out).sum().backward()
            results.append((out, tpe, x, p, h.grad, pr.grad))
        (out, tpe, x, p, gh, gp), expected = results
        assert out.shape == hidden.shape and out.abs().sum() > 0
        # What the experts are handed: int64 counts on the host, one prob per token row.
        assert tpe.dtype == torch.int64 and tpe.device.type == "cpu"
        assert tpe.shape == (EXPERTS // ep_size,) and int(tpe.sum()) == x.shape[0]
        assert p.shape == (x.shape[0],)
        if ep_size == 1:
            assert torch.equal(tpe, routing_map.sum(0))
        for name, got, want in zip(("output", "tokens_per_expert", "permuted tokens",
                                    "permuted probs", "grad hidden", "grad probs"),
                                   (out, tpe, x, p, gh, gp), expected):
            assert got.dtype == want.dtype and got.device == want.device, name
            assert torch.equal(got, want), f"rank {rank} drop={drop}: {name} differs"


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_six_steps_match_alltoall(ep_size):
    run_distributed(_six_steps_fn, ep_size)


def _moe_layer(dispatcher, **overrides):
    """A stock MoELayer (SequentialMLP experts) from Megatron's local MoE spec."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    build = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(5)
    return build(config=_config(dispatcher, **overrides), layer_number=1)


def _step(layer, seed):
    """Forward one random batch [S, B, H], backward a random cotangent: (output, grads)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g).requires_grad_()
    clear_aux_losses_tracker()
    layer.zero_grad(set_to_none=True)
    out, bias = layer(hidden)
    assert bias is None
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), hidden.grad, grads


_LAYER_CASES = {
    "dropless": {},
    "shared expert": {"moe_shared_expert_intermediate_size": 32},
    "probs on input": {"moe_router_topk": 1, "moe_router_pre_softmax": True,
                       "moe_apply_probs_on_input": True},
    "capacity, dropped": {"moe_expert_capacity_factor": 0.5},
    "capacity, padded": {"moe_expert_capacity_factor": 0.5,
                         "moe_pad_expert_input_to_capacity": True},
}


def _moe_layer_fn(rank, ep_size):
    from megatron_mok.megatron import MokTokenDispatcher
    _setup(ep_size)
    for case, overrides in _LAYER_CASES.items():
        ref, mok = _moe_layer("alltoall", **overrides), _moe_layer("mok", **overrides)
        assert isinstance(mok.token_dispatcher, MokTokenDispatcher), case
        assert not mok.token_dispatcher.fused, case
        mok.load_state_dict(ref.state_dict(), strict=True)
        for seed in (0, 1):
            (out_ref, gx_ref, g_ref), (out, gx, g) = _step(ref, seed), _step(mok, seed)
            assert out.abs().sum() > 0, case
            tight = dict(rtol=1e-6, atol=1e-7, msg=lambda m: f"rank {rank} {case}: {m}")
            torch.testing.assert_close(out, out_ref, **tight)
            torch.testing.assert_close(gx, gx_ref, **tight)
            assert g.keys() == g_ref.keys() and any("router" in n for n in g), case
            for name in g:
                torch.testing.assert_close(g[name], g_ref[name], **tight)


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_stock_moe_layer_with_mok_matches_alltoall(ep_size):
    run_distributed(_moe_layer_fn, ep_size)


def _fused_layer(**overrides):
    from megatron_mok.config import MoKConfig
    from megatron_mok.megatron import MokMoELayer
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(5)
    return MokMoELayer(_config("mok", **overrides), submodules=spec.keywords["submodules"],
                       layer_number=1, mok_config=MoKConfig(backend="reference"))


def _modes_fn(rank, world_size):
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron_mok.megatron import MokTokenDispatcher
    from megatron_mok.megatron.dispatcher import MokUnfusedWarning
    _setup(world_size)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = _fused_layer()
        assert not [w for w in seen if issubclass(w.category, MokUnfusedWarning)]
        stock = [_moe_layer("mok") for _ in range(2)]
        _dispatchers()
        assert isinstance(_moe_layer("allgather").token_dispatcher, MoEAllGatherTokenDispatcher)
    unfused = [w for w in seen if issubclass(w.category, MokUnfusedWarning)]
    assert len(unfused) == 1, [str(w.message) for w in seen]
    assert "gpt_decoder_block_spec" in str(unfused[0].message)
    assert all(not layer.token_dispatcher.fused for layer in stock)

    # MokMoELayer: metadata only, no alltoall inside; the pass receives top-k weights.
    dispatcher = fused.token_dispatcher
    assert type(dispatcher) is MokTokenDispatcher and dispatcher.fused
    assert dispatcher.unfused is None and dispatcher.cudagraph_attrs == ["routing_map", "topk_idx"]
    seen_probs = []
    preprocess = dispatcher.dispatch_preprocess

    def recording(*args):
        result = preprocess(*args)
        seen_probs.append(result[1])
        return result

    dispatcher.dispatch_preprocess = recording
    fused.load_state_dict(stock[0].state_dict(), strict=True)
    out_fused, gx_fused, g_fused = _step(fused, 0)
    assert seen_probs and seen_probs[0].shape == (SEQ * BATCH, 2)  # topk_w [T, K]
    # ... and computes what the contract mode does, to fp32 rounding.
    out, gx, g = _step(stock[0], 0)
    torch.testing.assert_close(out_fused, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_fused, gx, rtol=1e-5, atol=1e-6)
    for name in g:
        torch.testing.assert_close(g_fused[name], g[name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_unfused_warning_once_and_mok_layer_stays_fused():
    run_distributed(_modes_fn, 1)
