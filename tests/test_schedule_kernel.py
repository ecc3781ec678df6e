"""The row table's CUDA op (MOK_SCHEDULE=kernel, the default; csrc/comm/schedule.cu)
against schedule.build_row_table's tensor ops on the same GPU routing: every field equal
(and the route -> row map at EP = 1), over EP sizes, drops, skew, overflow, invalid ids,
many chunks and local experts past 64. The knob's checks run on the CPU."""

import pytest
import torch

from megatron_mok import schedule

FIELDS = ("peer_rank", "peer_token", "peer_k", "tokens_per_expert", "expert_offsets",
          "num_rows", "overflow", "invalid_ids")


def test_the_knob_defaults_to_the_kernel_and_is_checked(monkeypatch):
    ids = torch.zeros(1, 4, 2, dtype=torch.int32)
    monkeypatch.delenv("MOK_SCHEDULE", raising=False)
    assert not schedule.schedule_kernel_enabled(ids)  # CPU routing: always the tensor ops
    if torch.cuda.is_available():
        from megatron_mok.kernels import ops
        assert schedule.schedule_kernel_enabled(ids.cuda()) == ops.extension_available()
        monkeypatch.setenv("MOK_SCHEDULE", "torch")
        assert not schedule.schedule_kernel_enabled(ids.cuda())
    with pytest.raises(ValueError, match="MOK_SCHEDULE"):
        monkeypatch.setenv("MOK_SCHEDULE", "cuda")


def _routing(ep, tokens, topk, experts, seed, drop=0.05, skew=False, bad=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most routes to the first experts
        ids = (torch.rand(ep, tokens, topk, generator=g) ** 4 * experts).long()
    else:
        ids = torch.randint(0, experts, (ep, tokens, topk), generator=g)
    ids[torch.rand(ids.shape, generator=g) < drop] = -1
    if bad:
        ids[0, 0, 0] = experts + 3
        ids[0, 1, 0] = -2
    return ids.int().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("ep, tokens, topk, experts, capacity, skew, bad", [
    (1, 700, 8, 16, 8192, False, False),
    (1, 4096, 8, 128, 40960, False, False),   # 32 chunks, 128 local experts (two groups of 64)
    (2, 300, 4, 16, 2560, False, False),
    (2, 600, 8, 400, 8192, False, False),     # rank 1: first expert 200, 200 local (4 groups)
    (8, 1000, 8, 256, 16384, True, False),    # skewed, 32 local experts
    (4, 512, 2, 8, 256, True, False),         # overflow: rows dropped past the capacity
    (1, 100, 4, 16, 1024, False, True),       # invalid ids (-2 and E + 3)
    (1, 100, 4, 600, 1024, False, False),     # E_loc = 600 > 512: the tensor ops build it
    (1, 0, 4, 8, 128, False, False),          # no tokens
])
def test_kernel_table_equals_the_tensor_ops(ep, tokens, topk, experts, capacity, skew, bad,
                                            monkeypatch):
    ids = _routing(ep, tokens, topk, experts, seed=ep * 7 + tokens, skew=skew, bad=bad)
    local = experts // ep
    for rank in range(ep):
        # The latched status (routing_errors) starts from an earlier error of another rank
        # on half the ranks: the first error's details must stay.
        status_ref = torch.zeros(16, dtype=torch.int32, device="cuda")
        if rank % 2:
            status_ref[0], status_ref[1:] = 3, torch.arange(1, 16)
        status_got = status_ref.clone()
        monkeypatch.setenv("MOK_SCHEDULE", "torch")
        ref = schedule.build_row_table(ids, rank, local, capacity, num_experts=experts,
                                       status=status_ref, list_dropped=True)
        monkeypatch.setenv("MOK_SCHEDULE", "kernel")
        # The op runs wherever it applies (and is not silently skipped).
        assert schedule.schedule_kernel_enabled(ids, local, capacity) == (local <= 512)
        got = schedule.build_row_table(ids, rank, local, capacity,
                                       num_experts=None if experts == ep * local else experts,
                                       status=status_got, list_dropped=True)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(ref, name).int()), (rank, name)
        assert torch.equal(status_got, status_ref), (rank, status_got, status_ref)
        # The same dropped routes (the kernel lists them in any order).
        count = int(ref.dropped[0])
        assert int(got.dropped[0]) == count
        assert torch.equal(got.dropped[1:1 + count].sort().values,
                           ref.dropped[1:1 + count].sort().values)
        if status_ref[0] & 1 and rank % 2 == 0:  # this rank's overflow, latched
            assert status_ref[2] == ref.num_rows[0] and status_ref[6] == count > 0
        # The inverse map (route -> row) exists at EP = 1 only, written by the place kernel.
        if ep == 1:
            assert torch.equal(got.route_row, ref.route_row), rank
        else:
            assert got.route_row is None and ref.route_row is None
    if bad:
        assert int(got.invalid_ids.item()) == 1
