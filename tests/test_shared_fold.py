"""The shared expert folded into the routed experts (MOK_SHARED_EXPERT=folded): the
routing and weight transforms, and the pass against the separate shared expert on the
reference backend, EP 1 and EP 2 (CPU). The kernel backend's run is in
tests/test_gpu_backend.py."""

import pytest
import torch

from dist_utils import run_distributed
from megatron_mok import MoKConfig, shared_fold
from megatron_mok.functional import fused_moe
from megatron_mok import knobs

REFERENCE = MoKConfig(backend="reference")
E, I, H, K, T = 4, 24, 32, 2, 40


def test_routing_puts_the_shared_expert_first_and_renumbers():
    idx = torch.tensor([[0, 3], [5, -1], [7, 4]])
    w = torch.tensor([[0.5, 0.25], [0.75, 0.0], [0.1, 0.2]])
    ext_idx, ext_w = shared_fold.fold_routing(idx, w, num_local_experts=4, ep_rank=1)
    # Rank r owns ids r * 5 .. r * 5 + 4, its shared expert is r * 5 + 4.
    assert ext_idx.tolist() == [[9, 0, 3], [9, 6, -1], [9, 8, 5]]
    assert torch.equal(ext_w, torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.75, 0.0],
                                            [1.0, 0.1, 0.2]]))


def test_adjacent_shared_weight_is_read_in_place_else_copied():
    storage = torch.randn(E + 1, 2 * I, H)
    w, shared = storage[:E].requires_grad_(True), storage[E].requires_grad_(True)
    ext = shared_fold.append_expert(w, shared)
    assert ext.data_ptr() == storage.data_ptr() and ext.shape == (E + 1, 2 * I, H)
    grad = torch.randn(E + 1, 2 * I, H)
    ext.backward(grad)
    assert torch.equal(w.grad, grad[:E]) and torch.equal(shared.grad, grad[E])
    apart = torch.randn(2 * I, H)
    copied = shared_fold.append_expert(w.detach(), apart)
    assert copied.data_ptr() != storage.data_ptr()
    assert torch.equal(copied[:E], w.detach()) and torch.equal(copied[E], apart)


def _inputs(seed, dtype=torch.bfloat16, ep_size=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E * ep_size, generator=g)[:K] for _ in range(T)])
    idx[::7, 1] = -1  # some tokens with one route only
    topk_w = torch.rand(T, K, generator=g)
    storage1 = (torch.randn(E + 1, 2 * I, H, generator=g) * 0.2).to(dtype)
    storage2 = (torch.randn(E + 1, H, I, generator=g) * 0.2).to(dtype)
    dy = torch.randn(T, H, generator=g).to(dtype)
    return x, idx, topk_w, storage1, storage2, dy


def _run(inputs, group=None):
    x, idx, topk_w, storage1, storage2, dy = inputs
    s1, s2 = storage1.clone(), storage2.clone()  # shared weights right after the experts'
    leaves = [x.clone(), topk_w.clone(), s1[:E], s2[:E], s1[E], s2[E]]
    leaves = [t.requires_grad_(True) for t in leaves]
    y = fused_moe(leaves[0], idx, leaves[1], *leaves[2:], group=group, config=REFERENCE)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def _compare(folded, separate, grads_tol):
    (y_f, g_f), (y_s, g_s) = folded, separate
    # Same rounding points and the same fp32 sums in the same order: the same bits.
    torch.testing.assert_close(y_f, y_s, rtol=0, atol=0)
    # The gradients' contributions add up in another order (x: the shared and the routed
    # paths; weights: the same rows), so they agree to rounding.
    for name, a, b in zip(("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2"), g_f, g_s):
        torch.testing.assert_close(a.float(), b.float(), rtol=grads_tol, atol=grads_tol,
                                   msg=name)


@pytest.mark.parametrize("dtype, grads_tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_folded_pass_equals_the_separate_shared_expert(monkeypatch, dtype, grads_tol):
    inputs = _inputs(1, dtype)
    folds = []
    fold = shared_fold.fold_routing
    monkeypatch.setattr(shared_fold, "fold_routing", lambda *a: folds.append(1) or fold(*a))
    separate = _run(inputs)
    assert not folds
    monkeypatch.setenv("MOK_SHARED_EXPERT", "folded")
    _compare(_run(inputs), separate, grads_tol)
    assert folds  # the folded run did fold


def test_a_shared_expert_of_another_width_stays_separate(monkeypatch):
    x, idx, topk_w, s1, s2, dy = _inputs(2)
    narrow1, narrow2 = torch.randn(16, H).bfloat16(), torch.randn(H, 8).bfloat16()
    assert not shared_fold.foldable(s1[:E], s2[:E], narrow1, narrow2)
    runs = []
    for value in ("separate", "folded"):
        monkeypatch.setenv("MOK_SHARED_EXPERT", value)
        runs.append(fused_moe(x, idx, topk_w, s1[:E], s2[:E], narrow1, narrow2,
                              config=REFERENCE))
    assert torch.equal(runs[0], runs[1])


def test_bad_mode_raises(monkeypatch):
    with pytest.raises(ValueError, match="MOK_SHARED_EXPERT must be separate or folded"):
        monkeypatch.setenv("MOK_SHARED_EXPERT", "fused")


def _ep_fn(rank, world_size):
    import os
    import torch.distributed as dist
    group = dist.group.WORLD
    inputs = list(_inputs(10 + rank, torch.float32, ep_size=world_size))
    # Every rank's experts differ; the routing reaches the other rank's experts.
    folds = []
    fold = shared_fold.fold_routing
    shared_fold.fold_routing = lambda *a: folds.append(1) or fold(*a)
    knobs.set_env("MOK_SHARED_EXPERT", "separate")
    separate = _run(inputs, group)
    assert not folds
    knobs.set_env("MOK_SHARED_EXPERT", "folded")
    _compare(_run(inputs, group), separate, 1e-5)
    assert folds


@pytest.mark.slow
def test_folded_pass_equals_the_separate_shared_expert_at_ep2():
    run_distributed(_ep_fn, 2)


def test_folded_with_accumulators_adds_the_shared_gradient_last():
    from megatron_mok.functional import ExpertGradAccumulator
    x, idx, topk_w, s1, s2, dy = _inputs(4, torch.float32)
    _, grads = _run((x, idx, topk_w, s1, s2, dy))  # separate: the gradients to expect
    bufs1 = [torch.zeros(2 * I, H) for _ in range(E + 1)]
    bufs2 = [torch.zeros(H, I) for _ in range(E + 1)]
    leaves = [t.clone().requires_grad_(True) for t in (x, topk_w, s1[:E], s2[:E], s1[E], s2[E])]
    y = fused_moe(leaves[0], idx, leaves[1], *leaves[2:], config=REFERENCE, fold_shared=True,
                  accumulators=(ExpertGradAccumulator(bufs1), ExpertGradAccumulator(bufs2)))
    y.backward(dy)
    torch.testing.assert_close(torch.stack(bufs1[:E]), grads[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(bufs2[:E]), grads[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bufs1[E], grads[4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bufs2[E], grads[5], rtol=1e-5, atol=1e-6)
    # Accumulators of E_loc buffers: the shared expert stays separate, its gradient returned.
    leaves = [t.clone().requires_grad_(True) for t in (x, topk_w, s1[:E], s2[:E], s1[E], s2[E])]
    accs = (ExpertGradAccumulator([torch.zeros(2 * I, H) for _ in range(E)]), None)
    y = fused_moe(leaves[0], idx, leaves[1], *leaves[2:], config=REFERENCE, fold_shared=True,
                  accumulators=accs)
    y.backward(dy)
    torch.testing.assert_close(leaves[4].grad, grads[4], rtol=1e-5, atol=1e-6)
