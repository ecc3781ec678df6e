"""Row table: every local route exactly once, in (rank, token, k) order, padded per expert."""

import torch

from megatron_mok.config import TILE_M, MoKConfig, schedule_capacity
from megatron_mok.schedule import build_row_table
from moe_inputs import make_routing


def _expected_segments(idx_all, ep_rank, num_local_experts):
    segments = []
    ep_size, num_tokens, topk = idx_all.shape
    for e in range(num_local_experts):
        g = ep_rank * num_local_experts + e
        segments.append([(r, t, k) for r in range(ep_size) for t in range(num_tokens)
                         for k in range(topk) if int(idx_all[r, t, k]) == g])
    return segments


def test_row_table_layout_multi_rank():
    g = torch.Generator().manual_seed(0)
    ep_size, num_tokens, topk, num_local = 3, 200, 4, 2
    idx_all = torch.stack([make_routing(num_tokens, ep_size * num_local, topk, g, 0.1)[0]
                           for _ in range(ep_size)])
    for rank in range(ep_size):
        cap = schedule_capacity(MoKConfig(), num_tokens, topk, ep_size, num_local)
        s = build_row_table(idx_all, rank, num_local, cap)
        expected = _expected_segments(idx_all, rank, num_local)
        offsets = s.expert_offsets.tolist()
        assert offsets[0] == 0 and int(s.num_rows) == offsets[-1] and int(s.overflow) == 0
        for e, rows in enumerate(expected):
            assert int(s.tokens_per_expert[e]) == len(rows)
            start, end = offsets[e], offsets[e + 1]
            assert start % TILE_M == 0 and end - start == -(-len(rows) // TILE_M) * TILE_M
            got = list(zip(s.peer_rank[start:end].tolist(), s.peer_token[start:end].tolist(),
                           s.peer_k[start:end].tolist()))
            assert got[:len(rows)] == rows
            assert all(r == (-1, -1, -1) for r in got[len(rows):])  # padding
        assert torch.all(s.peer_rank[offsets[-1]:] == -1)


def test_overflow_is_flagged_not_silent():
    g = torch.Generator().manual_seed(1)
    idx = make_routing(300, 4, 2, g)[0].unsqueeze(0)
    s = build_row_table(idx, 0, 4, capacity=256)
    assert int(s.overflow) == 1 and int(s.num_rows) > 256
    try:
        s.check_errors()
    except RuntimeError as err:
        assert "capacity" in str(err)
    else:
        raise AssertionError("overflow did not raise")


def test_skewed_routing_one_expert_takes_all():
    idx = torch.zeros(1, 333, 1, dtype=torch.int32)
    cap = schedule_capacity(MoKConfig(), 333, 1, 1, 3)
    s = build_row_table(idx, 0, 3, cap)
    assert s.tokens_per_expert.tolist() == [333, 0, 0]
    assert s.expert_offsets.tolist() == [0, 384, 384, 384]
    assert s.peer_token[:333].tolist() == list(range(333))


def test_capacity_never_overflows_at_ep1():
    for num_tokens, topk, num_local in ((1, 1, 1), (100, 8, 16), (4096, 6, 48)):
        cap = schedule_capacity(MoKConfig(), num_tokens, topk, 1, num_local)
        worst = num_tokens * topk + num_local * (TILE_M - 1)
        assert cap >= worst


def test_route_row_is_the_inverse_of_the_table_at_ep1():
    """The schedule's route -> row map (what the in-place combine reads) against the one
    built from the table, with dropped routes (ids -1) and rows lost to an overflow."""
    import types

    from megatron_mok.kernels import backend as kernel_backend
    g = torch.Generator().manual_seed(3)
    for num_tokens, topk, num_local, capacity in ((300, 4, 6, None), (300, 2, 4, 256)):
        idx = make_routing(num_tokens, num_local, topk, g, 0.15)[0].unsqueeze(0)
        assert bool((idx < 0).any())
        cap = capacity or schedule_capacity(MoKConfig(), num_tokens, topk, 1, num_local)
        s = build_row_table(idx, 0, num_local, cap)
        assert s.route_row.shape == (num_tokens, topk) and s.route_row.dtype == torch.int32
        table = types.SimpleNamespace(peer_rank=s.peer_rank, peer_token=s.peer_token,
                                      peer_k=s.peer_k)
        assert torch.equal(s.route_row, kernel_backend.route_rows(table, num_tokens, topk))
        if capacity:  # overflow: some routed (t, k) have no row
            assert int(s.overflow) == 1 and bool(((s.route_row < 0) & (idx[0] >= 0)).any())
    idx_all = torch.stack([make_routing(50, 4, 2, g)[0] for _ in range(2)])
    assert build_row_table(idx_all, 1, 2, 1024).route_row is None  # EP > 1: no such map
