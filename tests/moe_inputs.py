"""Random inputs of the fused MoE pass (never zeros), shared by the tests."""

import torch

from megatron_mok.reference import rel_l2  # noqa: F401  (the tests' tolerance metric)


def make_routing(num_tokens, num_experts, topk, generator, drop_fraction=0.0, device="cpu"):
    """Distinct experts per token (uniform), optionally some -1 routes."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    idx = scores.topk(topk, dim=1).indices.int()
    if drop_fraction:
        drop = torch.rand(num_tokens, topk, generator=generator) < drop_fraction
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    weights = torch.rand(num_tokens, topk, generator=generator) + 0.05
    return idx.contiguous().to(device), weights.to(device)


def make_moe_inputs(num_tokens=48, hidden=32, inter=16, num_local_experts=4, topk=2,
                    shared_inter=None, dtype=torch.bfloat16, seed=0, ep_size=1,
                    drop_fraction=0.1, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    idx, w = make_routing(num_tokens, num_local_experts * ep_size, topk, g, drop_fraction, device)
    inputs = dict(
        x=rnd(num_tokens, hidden), topk_idx=idx, topk_w=w,
        w1=rnd(num_local_experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=rnd(num_local_experts, hidden, inter, scale=inter ** -0.5))
    if shared_inter:
        inputs["shared_w1"] = rnd(2 * shared_inter, hidden, scale=hidden ** -0.5)
        inputs["shared_w2"] = rnd(hidden, shared_inter, scale=shared_inter ** -0.5)
    return inputs
