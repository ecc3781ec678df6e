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
