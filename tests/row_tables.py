"""Row tables and operands of the grouped-GEMM ops' GPU tests (segments padded to 128
rows, padding rows zero), shared by the GLU and the non-gated activation tests."""

import torch

COUNTS = {"balanced": [256, 256, 256, 256], "ragged": [1, 0, 300, 129, 0, 77]}


def row_table(counts):
    """(offsets, num_rows, capacity, real, offsets as a list): a table of segments of the
    given row counts, each padded to 128 rows, plus one spare tile; `real` marks the rows
    that hold tokens."""
    padded = [-(-c // 128) * 128 for c in counts]
    offsets = [0]
    for p in padded:
        offsets.append(offsets[-1] + p)
    capacity = offsets[-1] + 128
    real = torch.zeros(capacity, dtype=torch.bool)
    for e, c in enumerate(counts):
        real[offsets[e]:offsets[e] + c] = True
    return (torch.tensor(offsets, dtype=torch.int32, device="cuda"),
            torch.tensor([offsets[-1]], dtype=torch.int32, device="cuda"), capacity, real, offsets)


def rand_bf16(*shape, seed, scale=1.0, real=None):
    """Seeded normal values as a CUDA bf16 tensor; rows outside `real` zero."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * scale
    if real is not None:
        t[~real] = 0
    return t.bfloat16().cuda()


def segments(offsets):
    """(expert, first row, end row) of every non-empty segment."""
    return [(e, offsets[e], offsets[e + 1]) for e in range(len(offsets) - 1)
            if offsets[e + 1] > offsets[e]]
