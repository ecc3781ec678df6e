"""EP > 1 over torch.distributed (gloo): each rank's output and gradients equal the
single-process pass over all ranks' tokens with all experts."""

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_mok import functional as mok
from megatron_mok import reference
from moe_inputs import make_moe_inputs, rel_l2

T, H, I, E_LOC, K = 40, 32, 16, 3, 3


def _global_inputs(ep_size, shared, routing="random"):
    """All ranks' tokens and all experts: rank r owns tokens [rT, (r+1)T) and experts
    [r E_loc, (r+1) E_loc). "adversarial": every route goes to rank 0's experts, so the
    other ranks' experts get none (zero gradients, collectives still on every rank)."""
    g = make_moe_inputs(num_tokens=T * ep_size, hidden=H, inter=I,
                        num_local_experts=E_LOC * ep_size, topk=K, seed=21,
                        shared_inter=shared, drop_fraction=0.1)
    if routing == "adversarial":
        g["topk_idx"] = torch.arange(K, dtype=torch.int32).repeat(T * ep_size, 1)
    return g


def _rank_leaves(g, rank, shared):
    """Rank `rank`'s tokens and experts of the global inputs, as fresh autograd leaves."""
    tokens = slice(rank * T, (rank + 1) * T)
    experts = slice(rank * E_LOC, (rank + 1) * E_LOC)
    local = {"x": g["x"][tokens], "topk_idx": g["topk_idx"][tokens],
             "topk_w": g["topk_w"][tokens], "w1": g["w1"][experts], "w2": g["w2"][experts]}
    if shared:
        local.update(shared_w1=g["shared_w1"], shared_w2=g["shared_w2"])
    return {k: v.clone().contiguous().requires_grad_() if v.is_floating_point()
            else v.contiguous() for k, v in local.items()}


def _rank_fn(rank, ep_size, shared, routing, out_dir):
    g = _global_inputs(ep_size, shared, routing)
    tokens = slice(rank * T, (rank + 1) * T)
    leaves = _rank_leaves(g, rank, shared)
    y = mok.fused_moe(**leaves, group=dist.group.WORLD)
    dy = torch.randn(T * ep_size, H, generator=torch.Generator().manual_seed(22))[tokens]
    y.backward(dy.bfloat16())
    torch.save({"y": y.detach(), **{k: v.grad for k, v in leaves.items() if v.requires_grad}},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("ep_size, shared, routing", [(2, None, "random"), (2, 8, "random"),
                                                      (3, None, "random"),
                                                      (2, None, "adversarial")])
def test_ep_matches_single_process(tmp_path, ep_size, shared, routing):
    run_distributed(_rank_fn, ep_size, shared, routing, str(tmp_path))
    g = _global_inputs(ep_size, shared, routing)
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in g.items()}
    y = reference.moe_reference(**leaves)
    y.backward(torch.randn(T * ep_size, H, generator=torch.Generator().manual_seed(22)).bfloat16())
    for rank in range(ep_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        tokens = slice(rank * T, (rank + 1) * T)
        experts = slice(rank * E_LOC, (rank + 1) * E_LOC)
        # Same arithmetic per route; only the batch a matmul row sits in differs.
        assert rel_l2(got["y"], y[tokens]) < 1e-3
        assert rel_l2(got["x"], leaves["x"].grad[tokens]) < 1e-5
        assert rel_l2(got["topk_w"], leaves["topk_w"].grad[tokens]) < 1e-5
        assert rel_l2(got["w1"], leaves["w1"].grad[experts]) < 1e-2
        assert rel_l2(got["w2"], leaves["w2"].grad[experts]) < 1e-2
        if shared:
            # Each rank holds the gradient of its own tokens (DP-style partial sums).
            assert got["shared_w1"].shape == leaves["shared_w1"].shape


def _mismatch_fn(rank, ep_size):
    inputs = make_moe_inputs(num_tokens=16 + 8 * rank, num_local_experts=2, ep_size=ep_size)
    with pytest.raises(ValueError, match="same shapes"):
        mok.fused_moe(**inputs, group=dist.group.WORLD)


@pytest.mark.slow
def test_different_token_counts_across_ranks_raise():
    run_distributed(_mismatch_fn, 2)


FP8_SHAPE = dict(hidden=256, inter=128)  # the recipe's 128-multiples


def _fp8_inputs(ep_size):
    return make_moe_inputs(num_tokens=T * ep_size, num_local_experts=E_LOC * ep_size, topk=K,
                           seed=31, shared_inter=128, drop_fraction=0.1, **FP8_SHAPE)


def _fp8_rank_fn(rank, ep_size, wgrad, out_dir):
    from megatron_mok.config import MoKConfig
    g = _fp8_inputs(ep_size)
    tokens = slice(rank * T, (rank + 1) * T)
    leaves = _rank_leaves(g, rank, shared=True)
    config = MoKConfig(backend="reference", fp8="blockwise", fp8_wgrad=wgrad)
    y = mok.fused_moe(**leaves, group=dist.group.WORLD, config=config)
    dy = torch.randn(T * ep_size, FP8_SHAPE["hidden"],
                     generator=torch.Generator().manual_seed(32))[tokens]
    y.backward(dy.bfloat16())
    torch.save({"y": y.detach(), **{k: v.grad for k, v in leaves.items() if v.requires_grad}},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("ep_size, wgrad", [(2, "fp8"), (2, "bf16"), (3, "fp8")])
def test_fp8_ep_matches_single_process(tmp_path, ep_size, wgrad):
    """Blockwise FP8 at EP > 1 (reference backend): each rank's output and gradients are
    the single-process FP8 spec's over all tokens and experts. Every quantisation is per
    row or per expert over the same rows in the same order: the routed experts' weight
    gradients are those bits; y and dx differ by the order of fp32 sums (across ranks,
    and the BF16 shared expert's GEMMs over T rows instead of T * P)."""
    from megatron_mok import reference_fp8
    run_distributed(_fp8_rank_fn, ep_size, wgrad, str(tmp_path))
    g = _fp8_inputs(ep_size)
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in g.items()}
    y = reference_fp8.moe_reference_fp8(**leaves, wgrad=wgrad)
    y.backward(torch.randn(T * ep_size, FP8_SHAPE["hidden"],
                           generator=torch.Generator().manual_seed(32)).bfloat16())
    for rank in range(ep_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        tokens = slice(rank * T, (rank + 1) * T)
        experts = slice(rank * E_LOC, (rank + 1) * E_LOC)
        # The shared expert's GEMMs see T rows here, T * P there: y to bf16 rounding.
        assert rel_l2(got["y"], y[tokens]) < 1e-3
        assert rel_l2(got["x"], leaves["x"].grad[tokens]) < 1e-5
        assert rel_l2(got["topk_w"], leaves["topk_w"].grad[tokens]) < 1e-5
        assert torch.equal(got["w1"], leaves["w1"].grad[experts])
        assert torch.equal(got["w2"], leaves["w2"].grad[experts])
