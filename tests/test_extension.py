"""The compiled extension: built whenever nvcc is present, its CPU kernel against the spec."""

import shutil

import pytest
import torch

from megatron_mok import reference
from megatron_mok.kernels import ops


def test_extension_built_when_nvcc_present():
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc: the package was installed without the extension")
    assert ops.extension_available(), ops.EXTENSION_ERROR


def _inputs(dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randn(37, 5, 64, generator=g).to(dtype)
    idx = torch.randint(-1, 9, (37, 5), generator=g, dtype=torch.int32)
    w = torch.rand(37, 5, generator=g)
    shared = torch.randn(37, 64, generator=g).to(dtype)
    return [t.to(device) for t in (slots, idx, w, shared)]


@pytest.mark.skipif(not ops.extension_available(), reason="extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_epilogue_cpu_equals_spec(dtype, with_shared):
    slots, idx, w, shared = _inputs(dtype)
    shared = shared if with_shared else None
    got = ops.combine_epilogue(slots, idx, w, shared)
    expected = reference.combine(slots.float(), idx, w, None if shared is None else shared.float(),
                                 dtype)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.skipif(not ops.extension_available(), reason="extension not built")
def test_combine_epilogue_rejects_bad_input():
    slots, idx, w, shared = _inputs(torch.bfloat16)
    with pytest.raises(TypeError, match="topk_w must be fp32"):
        ops.combine_epilogue(slots, idx, w.double(), shared)
    with pytest.raises(ValueError, match=r"topk_idx and topk_w must be \[T, K\]"):
        ops.combine_epilogue(slots, idx[:, :4], w, shared)


@pytest.mark.skipif(not ops.extension_available(), reason="extension not built")
def test_combine_epilogue_fake_impl_gives_shapes():
    slots, idx, w, shared = _inputs(torch.bfloat16, device="meta")
    out = ops.combine_epilogue(slots, idx, w, shared)
    assert out.shape == (37, 64) and out.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_epilogue_cuda(dtype):
    slots, idx, w, shared = _inputs(dtype, device="cuda")
    got = ops.combine_epilogue(slots, idx, w, shared)
    expected = reference.combine(slots.float(), idx, w, shared.float(), dtype)
    # The GPU kernel fuses multiply-add (one rounding less than the spec's mul, add).
    assert (got.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
    assert torch.equal(got, ops.combine_epilogue(slots, idx, w, shared))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [3, 8, 10, 17])  # one batch of 8 loads, several, a ragged tail
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_rows_cuda_batches_and_alignment(topk, with_shared):
    """The combine's batched loads: the sum is fma over k ascending whatever K, so rows read
    in place equal the slots path bit for bit, a misaligned buffer (scalar loads) gives the
    same bits as an aligned one (vector loads), and both stay within the spec's tolerance."""
    g = torch.Generator().manual_seed(topk)
    tokens, hidden, rows_n = 301, 136, 301 * 17 + 50
    rows = torch.randn(rows_n, hidden, generator=g).to(torch.bfloat16).cuda()
    route_row = torch.randperm(rows_n, generator=g)[:tokens * topk].view(tokens, topk).int()
    route_row[torch.rand(tokens, topk, generator=g) < 0.2] = -1  # unrouted (t, k)
    route_row = route_row.cuda()
    w = torch.rand(tokens, topk, generator=g).cuda()
    shared = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda() if with_shared else None
    got = ops.combine_rows(rows, route_row, w, shared)

    idx = torch.where(route_row >= 0, 0, -1).int()
    slots = rows[route_row.clamp(min=0).long()]  # [T, K, H]
    assert torch.equal(got, ops.combine_epilogue(slots, idx, w, shared))

    def misaligned(t):  # same values, base pointer 2 bytes off a 16-byte boundary
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16 != 0
        return view

    assert torch.equal(got, ops.combine_rows(misaligned(rows), route_row, w,
                                             None if shared is None else misaligned(shared)))
    expected = reference.combine(slots.float(), idx, w, None if shared is None else shared.float(),
                                 torch.bfloat16)
    assert (got.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
    # The arithmetic itself, independently of the kernel: acc = fma(w[t, k], row, acc) in
    # fp32 over k ascending from the shared row, rounded once to bf16. fp32 fma emulated in
    # float64 (the fp32 x bf16 product is exact there; the sum's double rounding differs
    # from a true fma with probability ~2^-29 per step).
    acc = (shared.double() if shared is not None
           else torch.zeros(tokens, hidden, dtype=torch.float64, device="cuda"))
    for k in range(topk):
        routed = (route_row[:, k] >= 0).unsqueeze(1)
        step = (w[:, k:k + 1].double() * slots[:, k].double() + acc).float().double()
        acc = torch.where(routed, step, acc)
    assert torch.equal(got, acc.float().to(torch.bfloat16))
