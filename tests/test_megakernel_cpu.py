"""CPU parts of the megakernel's helpers: megakernel.probe_summary (the per-CTA cycle slots
of csrc/megakernel/forward.cuh, ProbeSlot, summed and turned into per-K-step and per-task
means) and kernel_backend.route_rows (the row of each route, for the in-place combine)."""

import types

import pytest
import torch

from megatron_mok.kernels import backend as kernel_backend, launch_chain, megakernel


def test_probe_summary_sums_ctas_and_derives_means():
    probe = torch.zeros(3, megakernel.PROBE_SLOTS, dtype=torch.int64)
    # CTA 0: 2 fc1 tasks, 10 K steps, 12 000 mainloop and 900 epilogue cycles; fc2 1 task.
    probe[0, 0:4] = torch.tensor([2, 10, 12_000, 900])
    probe[0, 4:8] = torch.tensor([1, 4, 5_000, 700])
    probe[1, 0:4] = torch.tensor([1, 5, 6_000, 300])
    probe[2, 8] = 400   # queue wait
    probe[2, 9] = 250   # producer dependency wait
    probe[2, 12:16] = 10 ** 12  # scratch timestamps must not leak into the sums
    s = megakernel.probe_summary(probe)
    assert s["fc1"]["tasks"] == 3 and s["fc1"]["k_steps"] == 15
    assert s["fc1"]["cycles_per_k_step"] == 18_000 / 15
    assert s["fc1"]["epilogue_cycles_per_task"] == 1_200 / 3
    assert s["fc2"]["cycles_per_k_step"] == 5_000 / 4
    assert s["queue_wait_cycles"] == 400 and s["dependency_wait_cycles"] == 250
    assert s["consumer_cycles"] == 18_000 + 1_200 + 5_000 + 700 + 400


def test_probe_summary_of_an_empty_launch():
    s = megakernel.probe_summary(torch.zeros(2, megakernel.PROBE_SLOTS, dtype=torch.int64))
    assert s["fc1"]["cycles_per_k_step"] == 0.0 and s["consumer_cycles"] == 0


def test_route_rows_inverts_the_row_table():
    """kernel_backend.route_rows (MOK_EP1_COMBINE=rows): route (t, k) -> its row, -1 if none,
    whatever order the rows come in and however many padding rows there are."""
    gen = torch.Generator().manual_seed(5)
    T, K = 37, 3
    routed = torch.rand(T, K, generator=gen) > 0.2
    routes = routed.flatten().nonzero().flatten()
    order = routes[torch.randperm(routes.numel(), generator=gen)]
    pad = torch.full((11,), -1, dtype=torch.int64)
    flat = torch.cat([order[:10], pad[:5], order[10:], pad[5:]])  # padding inside and after
    valid = flat >= 0
    sched = types.SimpleNamespace(
        peer_rank=torch.where(valid, 0, -1).int(),
        peer_token=torch.where(valid, flat // K, -1).int(),
        peer_k=torch.where(valid, flat % K, -1).int())
    table = kernel_backend.route_rows(sched, T, K)
    assert table.shape == (T, K) and table.dtype == torch.int32
    assert torch.equal(table >= 0, routed)
    for j in valid.nonzero().flatten().tolist():
        assert table[int(flat[j]) // K, int(flat[j]) % K] == j


def test_rows_combine_is_the_ep1_default(monkeypatch):
    ep1, ep2 = types.SimpleNamespace(ep_size=1), types.SimpleNamespace(ep_size=2)
    monkeypatch.delenv("MOK_EP1_COMBINE", raising=False)
    assert kernel_backend.rows_combine(ep1) and not kernel_backend.rows_combine(ep2)
    monkeypatch.setenv("MOK_EP1_COMBINE", "slots")
    assert not kernel_backend.rows_combine(ep1)
    monkeypatch.setenv("MOK_EP1_COMBINE", "rows")
    assert kernel_backend.rows_combine(ep1) and not kernel_backend.rows_combine(ep2)
    with pytest.raises(ValueError, match="MOK_EP1_COMBINE"):  # checked when read
        monkeypatch.setenv("MOK_EP1_COMBINE", "inplace")


def test_backward_path_is_opt_in_and_checked(monkeypatch):
    ep1, ep2 = types.SimpleNamespace(ep_size=1), types.SimpleNamespace(ep_size=2)
    monkeypatch.setattr(megakernel, "backward_available", lambda: True)
    bf16 = torch.bfloat16
    monkeypatch.delenv("MOK_BACKWARD", raising=False)
    assert megakernel.backward_path(ep1, bf16, in_place=True) == "launches"  # the default
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    assert megakernel.backward_path(ep1, bf16, in_place=True) == "megakernel"
    assert megakernel.backward_path(ep2, bf16, in_place=False) == "megakernel"  # slots
    # Where it cannot run, the chain: EP = 1 with slots, fp32 gradients, not built.
    assert megakernel.backward_path(ep1, bf16, in_place=False) == "launches"
    assert megakernel.backward_path(ep1, torch.float32, in_place=True) == "launches"
    monkeypatch.setattr(megakernel, "backward_available", lambda: False)
    assert megakernel.backward_path(ep1, bf16, in_place=True) == "launches"
    with pytest.raises(ValueError, match="MOK_BACKWARD"):
        monkeypatch.setenv("MOK_BACKWARD", "fused")


def test_backward_minibatch_knob(monkeypatch):
    monkeypatch.delenv("MOK_BACKWARD_MINIBATCH", raising=False)
    assert kernel_backend.backward_minibatch() == 2048
    monkeypatch.setenv("MOK_BACKWARD_MINIBATCH", "512")
    assert kernel_backend.backward_minibatch() == 512
    for bad in ("100", "0", "-128", "lots"):
        with pytest.raises(ValueError, match="MOK_BACKWARD_MINIBATCH"):
            monkeypatch.setenv("MOK_BACKWARD_MINIBATCH", bad)


def test_moe_backward_rejects_bad_input_before_any_launch():
    ws = types.SimpleNamespace(ep_size=1, capacity=256)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="minibatch_rows"):
        megakernel.moe_backward(ws, None, x, None, None, None, None, minibatch_rows=200)
    w1 = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    h = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA bfloat16"):  # CPU tensors
        megakernel.moe_backward(ws, None, x, None, w1, w2, h, minibatch_rows=256)


def test_wgrad_targets_reject_bad_input():
    rows, hidden, inter, experts = 256, 64, 32, 2
    bf = dict(dtype=torch.bfloat16)
    good = dict(x_rows=torch.zeros(rows, hidden, **bf),
                dw2=torch.zeros(experts, hidden, inter, **bf),
                dw1=torch.zeros(experts, 2 * inter, hidden, **bf))
    check = lambda **kw: megakernel.WgradTargets(**kw).check(rows, hidden, inter, experts)
    with pytest.raises(ValueError, match=r"x_rows must be \[256, 64\]"):
        check(**dict(good, x_rows=torch.zeros(rows, hidden + 8, **bf)))
    with pytest.raises(ValueError, match=r"dw2 must be \[2, 64, 32\]"):  # dw1 / dw2 swapped
        check(**dict(good, dw2=good["dw1"], dw1=good["dw2"]))
    with pytest.raises(TypeError, match="x_rows must be torch.bfloat16"):
        check(**dict(good, x_rows=torch.zeros(rows, hidden)))
    with pytest.raises(TypeError, match=r"dw2 must be torch.float32 \(main_grad"):
        check(**good, accumulate=True)  # bf16 planes cannot take fp32 adds
    with pytest.raises(ValueError, match="x_rows must be on a CUDA device"):  # CPU tensors
        check(**good)
    with pytest.raises(ValueError, match="reversed planes need accumulate"):
        check(**good, reverse1=True)


def test_fused_wgrad_targets_follow_the_knob_and_the_accumulators(monkeypatch):
    experts, hidden, inter = 3, 16, 8
    saved = types.SimpleNamespace(
        x_rows=torch.zeros(128, hidden),
        w1=torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16),
        w2=torch.zeros(experts, hidden, inter, dtype=torch.bfloat16))
    monkeypatch.delenv("MOK_BACKWARD_WGRAD", raising=False)  # default: the wgrad launches
    assert launch_chain.fused_wgrad_targets(saved, None, None) is None
    monkeypatch.setenv("MOK_BACKWARD_WGRAD", "fused")
    plain = launch_chain.fused_wgrad_targets(saved, None, None)
    assert plain.dw2.shape == (experts, hidden, inter) and plain.dw2.dtype == torch.bfloat16
    assert plain.dw1.shape == (experts, 2 * inter, hidden) and not plain.accumulate
    planes1, planes2 = torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    acc1 = types.SimpleNamespace(fused_target=(planes1, True))
    acc2 = types.SimpleNamespace(fused_target=(planes2, False))
    fused = launch_chain.fused_wgrad_targets(saved, acc1, acc2)
    assert fused.dw1 is planes1 and fused.dw2 is planes2 and fused.accumulate
    assert fused.reverse1 and not fused.reverse2
    # Buffers one launch cannot add into, or one weight frozen: the wgrad launches.
    assert launch_chain.fused_wgrad_targets(
        saved, types.SimpleNamespace(fused_target=None), acc2) is None
    assert launch_chain.fused_wgrad_targets(saved, None, acc2) is None
    monkeypatch.setenv("MOK_BACKWARD_WGRAD", "launches")
    assert launch_chain.fused_wgrad_targets(saved, None, None) is None
    with pytest.raises(ValueError, match="MOK_BACKWARD_WGRAD"):
        monkeypatch.setenv("MOK_BACKWARD_WGRAD", "inside")
