"""megatron_mok.megatron.expert_weights: Megatron's per-expert parameters laid back to back
(share_one_storage) are read stacked without a copy (stack_experts), gradients reach every
parameter as with torch.stack, and anything that breaks the layout falls back to a copy."""

import torch

from megatron_mok.megatron.expert_weights import share_one_storage, stack_experts, stacked_alias


def _params(n=4, shape=(6, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for _ in range(n)]


def test_shared_storage_is_read_without_a_copy_and_grads_match_stack():
    params = _params()
    values = [p.detach().clone() for p in params]
    assert share_one_storage(params)
    for p, v in zip(params, values):  # same values, same parameter objects
        assert torch.equal(p, v) and isinstance(p, torch.nn.Parameter)
    w = stack_experts(params)
    assert w.data_ptr() == params[0].data_ptr()  # an alias, not a copy
    assert torch.equal(w, torch.stack(values))
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    (w * upstream).sum().backward()
    for e, p in enumerate(params):
        assert torch.equal(p.grad, upstream[e])


def test_in_place_updates_are_seen_by_the_next_stack():
    params = _params()
    share_one_storage(params)
    with torch.no_grad():  # an optimizer step
        for p in params:
            p.add_(1.0)
    assert torch.equal(stack_experts(params), torch.stack([p.detach() for p in params]))


def test_layouts_that_do_not_allow_an_alias_fall_back_to_a_copy():
    separate = _params()  # each in its own storage
    assert stacked_alias(separate) is None
    shuffled = _params(seed=2)
    share_one_storage(shuffled)
    order = [shuffled[1], shuffled[0], shuffled[2], shuffled[3]]
    assert stacked_alias(order) is None  # not in expert order
    rehomed = _params(seed=3)
    share_one_storage(rehomed)
    rehomed[2].data = rehomed[2].data.clone()  # e.g. a DDP buffer took one over
    assert stacked_alias(rehomed) is None
    for params in (separate, order, rehomed):
        w = stack_experts(params)
        assert w.data_ptr() != params[0].data_ptr()
        assert torch.equal(w, torch.stack([p.detach() for p in params]))
        upstream = torch.randn(w.shape)
        (w * upstream).sum().backward()
        for e, p in enumerate(params):
            assert torch.equal(p.grad, upstream[e])


def test_mismatched_parameters_are_left_alone():
    params = _params() + [torch.nn.Parameter(torch.randn(3, 5))]
    before = [p.data_ptr() for p in params]
    assert not share_one_storage(params)
    assert [p.data_ptr() for p in params] == before


def test_dtensor_like_subclasses_fall_back_to_a_copy():
    class Wrapped(torch.Tensor):  # a tensor subclass stands in for DTensor here
        pass

    params = [torch.nn.Parameter(torch.randn(3, 4).as_subclass(Wrapped)) for _ in range(3)]
    assert not share_one_storage(params)
    assert stacked_alias(params) is None
    assert torch.equal(stack_experts(params), torch.stack([p.detach() for p in params]))


def test_adjacent_memory_of_another_storage_is_not_aliased():
    # Two storages back to back in memory (as the caching allocator can place them): the
    # addresses continue, but an alias over the first storage would run past its end.
    import numpy as np
    memory = np.zeros(16, dtype=np.float32)
    first = torch.from_numpy(memory[:8]).view(2, 4)
    second = torch.from_numpy(memory[8:]).view(2, 4)
    assert second.data_ptr() == first.data_ptr() + 32
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert stacked_alias([first, second]) is None
    assert stack_experts([first, second]).data_ptr() != first.data_ptr()  # a copy


def test_backwards_layout_is_read_in_place_in_reverse():
    # Megatron's distributed optimizer re-homes a TEGroupedMLP's weights backwards.
    from megatron_mok.megatron.expert_weights import reverse_local_experts
    memory = torch.randn(4, 3, 2)
    params = [torch.nn.Parameter(memory[3 - e]) for e in range(4)]  # expert e at slot 3 - e
    assert stacked_alias(params) is None
    w = stack_experts(params, reverse=True)
    assert w.data_ptr() == memory.data_ptr()  # an alias: plane j is expert 3 - j
    assert all(torch.equal(w[j], params[3 - j]) for j in range(4))
    grad = torch.randn(4, 3, 2)
    w.backward(grad)
    assert all(torch.equal(params[e].grad, grad[3 - e]) for e in range(4))
    # The routing that matches, every rank's local experts backwards (4 per rank).
    idx = torch.tensor([[0, 3, -1], [4, 7, 5]])
    assert reverse_local_experts(idx, 4).tolist() == [[3, 0, -1], [7, 4, 6]]
