"""Forward megakernel (pull -> fc1 + SwiGLU -> fc2 -> push in one launch) on the GPU:
bit-equal to the v1 launch chain on the same core, independent of comm SMs and minibatch,
counters reset for the next launch (repeats, CUDA graphs), the launch count of a layer
forward, and the watchdog; at EP = 1 in direct mode (fc1 gathers, fc2 scatters, no comm
CTAs) and with comm CTAs (megakernel-comm). MOK_FORWARD=megakernel selects it for the
whole module; the v1
suite (test_gpu_backend.py) runs on it with MOK_FORWARD=megakernel set for the run."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megatron_mok import functional as mok
from megatron_mok.kernels import megakernel, ops
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs, rel_l2

pytestmark = pytest.mark.gpu

KERNEL = MoKConfig(backend="kernel")


@pytest.fixture(autouse=True)
def _megakernel_forward(monkeypatch):
    monkeypatch.setenv("MOK_FORWARD", "megakernel")


def _layer(hidden=2048, inter=768, experts=16, topk=8, tokens=1000, seed=0, shared=None):
    inputs = make_moe_inputs(num_tokens=tokens, hidden=hidden, inter=inter,
                             num_local_experts=experts, topk=topk, shared_inter=shared,
                             seed=seed, drop_fraction=0.05, device="cuda")
    ws = mok.get_workspace(KERNEL, None, device="cuda", num_local_tokens=tokens,
                           hidden_size=hidden, topk=topk, num_local_experts=experts)
    sched = mok.build_schedule(ws, KERNEL, inputs["topk_idx"])
    return inputs, ws, sched


def _poison(ws, hidden, inter):
    """NaN in the (t, k) slots and in the blocks the caching allocator hands out next, so a
    row that a path forgets to write cannot pass for one an earlier run left behind."""
    ws.arena.view("slots").fill_(float("nan"))
    ws.arena.view("d_topk_w").fill_(float("nan"))
    junk = [torch.full((ws.capacity, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            for n in (hidden, hidden, inter, 2 * inter, hidden, hidden)]
    del junk


def _training_step(inputs, dy):
    """y and the gradients of x, topk_w, w1, w2 and shared_w1 of one forward + backward."""
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, config=KERNEL)
    y.backward(dy)
    return [y.detach()] + [leaves[k].grad for k in ("x", "topk_w", "w1", "w2", "shared_w1")]


def _forward(inputs, ws, sched, config=KERNEL):
    y, ctx = mok.forward(config, ws, sched, inputs["x"], inputs["topk_w"], inputs["w1"],
                         inputs["w2"], inputs.get("shared_w1"), inputs.get("shared_w2"))
    return y, ctx.saved


def test_megakernel_is_selected_by_the_env(monkeypatch):
    assert megakernel.available()
    assert megakernel.forward_path(2048) == "megakernel"
    monkeypatch.setenv("MOK_FORWARD", "megakernel-comm")
    assert megakernel.forward_path(2048) == "megakernel-comm"
    assert megakernel.forward_path(megakernel.MAX_HIDDEN + 8) == "launches"
    monkeypatch.delenv("MOK_FORWARD")
    assert megakernel.forward_path(2048) == "launches"


@pytest.mark.parametrize("path, gather, mover_warps", [
    ("megakernel", "tma", 1), ("megakernel", "lines", 1), ("megakernel", "rows", 1),
    ("megakernel-comm", "lines", 1), ("megakernel-comm", "lines", 2),
    ("megakernel-comm", "lines", 4), ("megakernel-comm", "lines", 8),
    ("megakernel-spread", "lines", 1)])
@pytest.mark.parametrize("shape", [(2048, 768, 16, 8), (7168, 2048, 32, 8), (4096, 1024, 64, 10),
                                   (1032, 520, 8, 4)])  # H, I not multiples of 64
def test_bit_equal_to_the_launch_chain(shape, path, gather, mover_warps, monkeypatch):
    hidden, inter, experts, topk = shape
    inputs, ws, sched = _layer(hidden, inter, experts, topk, tokens=700, seed=3)
    monkeypatch.setenv("MOK_FORWARD", path)
    monkeypatch.setenv("MOK_MEGAKERNEL_GATHER", gather)
    monkeypatch.setenv("MOK_MOVER_WARPS", str(mover_warps))
    monkeypatch.setenv("MOK_WGRAD_GATHER", "0")  # 1: no forward keeps x rows at EP = 1
    _poison(ws, hidden, inter)
    y, saved = _forward(inputs, ws, sched)
    monkeypatch.setenv("MOK_FORWARD", "launches")
    _poison(ws, hidden, inter)
    y_ref, saved_ref = _forward(inputs, ws, sched)
    rows = int(sched.num_rows.item())
    assert (saved.x_rows is None) == (path == "megakernel")  # direct mode gathers on the fly
    for name in ("x_rows", "h"):  # what the forward keeps (no act or y rows since v3)
        if getattr(saved, name) is not None:
            assert torch.equal(getattr(saved, name)[:rows], getattr(saved_ref, name)[:rows]), name
    assert torch.equal(y, y_ref)
    y_spec = mok.fused_moe(inputs["x"], inputs["topk_idx"], inputs["topk_w"], inputs["w1"],
                           inputs["w2"], config=MoKConfig(backend="reference"))
    assert rel_l2(y, y_spec) < 1e-2


def test_training_step_bit_equal_to_the_launch_chain(monkeypatch):
    inputs = make_moe_inputs(num_tokens=600, hidden=1024, inter=512, num_local_experts=8,
                             topk=4, shared_inter=256, seed=9, drop_fraction=0.05, device="cuda")
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()

    fused = _training_step(inputs, dy)
    monkeypatch.setenv("MOK_FORWARD", "launches")
    chain = _training_step(inputs, dy)
    for a, b in zip(fused, chain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["launches", "megakernel", "megakernel-spread"])
def test_rows_combine_bit_equal_to_slots(path, monkeypatch):
    """MOK_EP1_COMBINE=rows (no pushes, combines read the rows in place): the same bits as
    the slots path in a training step, on the chain and on the direct megakernel."""
    inputs = make_moe_inputs(num_tokens=640, hidden=1024, inter=512, num_local_experts=8,
                             topk=4, shared_inter=256, seed=21, drop_fraction=0.05, device="cuda")
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    monkeypatch.setenv("MOK_FORWARD", path)

    monkeypatch.setenv("MOK_EP1_COMBINE", "slots")
    slots = _training_step(inputs, dy)
    with torch.no_grad():
        y_slots = mok.fused_moe(**inputs, config=KERNEL)
    # Spies: the rows path must run (two combines per step, no scatter in the megakernel),
    # and NaN in the slots and fresh buffers must not reach its results.
    calls = {"combine_rows": 0, "scatter": []}
    combine_rows, moe_forward = ops.combine_rows, megakernel.moe_forward

    def combine_rows_spy(*args, **kwargs):
        calls["combine_rows"] += 1
        return combine_rows(*args, **kwargs)

    def moe_forward_spy(*args, **kwargs):
        calls["scatter"].append(kwargs.get("scatter", True))
        return moe_forward(*args, **kwargs)

    monkeypatch.setattr(ops, "combine_rows", combine_rows_spy)
    monkeypatch.setattr(megakernel, "moe_forward", moe_forward_spy)
    monkeypatch.setenv("MOK_EP1_COMBINE", "rows")
    ws = mok.get_workspace(KERNEL, None, device="cuda", num_local_tokens=640, hidden_size=1024,
                           topk=4, num_local_experts=8)
    _poison(ws, 1024, 512)
    rows = _training_step(inputs, dy)
    for a, b in zip(rows, slots):
        assert torch.equal(a, b)
    _poison(ws, 1024, 512)
    with torch.no_grad():  # no saved context: y rows stored only because nothing scatters
        assert torch.equal(mok.fused_moe(**inputs, config=KERNEL), y_slots)
    assert calls["combine_rows"] == 3
    assert calls["scatter"] == ([] if path == "launches" else [False, False])
    y_spec = mok.fused_moe(inputs["x"], inputs["topk_idx"], inputs["topk_w"], inputs["w1"],
                           inputs["w2"], inputs["shared_w1"], inputs["shared_w2"],
                           config=MoKConfig(backend="reference"))
    assert rel_l2(rows[0], y_spec) < 1e-2


@pytest.mark.parametrize("num_comm", [0, 2, 8, 24, 40])  # 0: spread mode; 40: direct mode
@pytest.mark.parametrize("minibatch", [256, 1024, 4096])
def test_bitwise_identical_across_comm_sms_and_minibatch(num_comm, minibatch, monkeypatch):
    inputs, ws, sched = _layer(tokens=1500, seed=7, shared=512)
    y_base, _ = _forward(inputs, ws, sched, KERNEL)
    monkeypatch.setenv("MOK_FORWARD", {0: "megakernel-spread", 40: "megakernel"}.get(
        num_comm, "megakernel-comm"))
    config = dataclasses.replace(KERNEL, fwd_num_comm_sms=num_comm or KERNEL.fwd_num_comm_sms,
                                 minibatch_size=minibatch,
                                 macrobatch_size=max(minibatch, KERNEL.macrobatch_size))
    y, _ = _forward(inputs, ws, sched, config)
    assert torch.equal(y, y_base)


@pytest.mark.parametrize("ring_tiles, minibatch, mover_warps",
                         [(2, 256, 1), (2, 256, 4), (5, 384, 2), (3, 256, 1), (4, 512, 2)])
def test_x_rows_ring_wraps_without_changing_a_bit(ring_tiles, minibatch, mover_warps,
                                                  monkeypatch):
    """A ring of 2 to 5 row tiles (fewer than, as many as, or not a multiple of the 4 comm
    CTAs and the minibatch) wraps 19-48 times over the ~96 tiles of the table: the same
    act, h, y rows and slots as with a row per route. A deadlock fails in 5 s (watchdog)."""
    inputs, ws, sched = _layer(tokens=1500, seed=23)
    x, w1, w2 = inputs["x"], inputs["w1"], inputs["w2"]
    hidden, inter = x.shape[1], w2.shape[2]
    kwargs = dict(save_h=True, num_comm_sms=4, minibatch_rows=minibatch, direct=False)
    rows = int(sched.num_rows.item())
    assert rows > 10 * ring_tiles * 128  # it must wrap
    routed = inputs["topk_idx"] >= 0
    monkeypatch.setenv("MOK_MOVER_WARPS", str(mover_warps))
    _poison(ws, hidden, inter)
    full = [t.clone() for t in megakernel.moe_forward(ws, sched, x, w1, w2, **kwargs)[1:]]
    slots_full = ws.arena.view("slots").view(*routed.shape, hidden)[routed].clone()
    _poison(ws, hidden, inter)
    ring = megakernel.moe_forward(ws, sched, x, w1, w2, ring_rows=ring_tiles * 128,
                                  timeout_ms=5000, **kwargs)
    assert ring[0] is None  # the ring keeps no x rows for the backward
    for a, b in zip(full, ring[1:]):
        assert torch.equal(a[:rows], b[:rows])
    assert torch.equal(ws.arena.view("slots").view(*routed.shape, hidden)[routed], slots_full)


def test_counters_reset_between_launches_and_in_graphs():
    inputs, ws, sched = _layer(tokens=384, seed=11)
    first, _ = _forward(inputs, ws, sched)
    torch.cuda.synchronize()
    assert int(ws.forward_counters.abs().sum()) == 0  # the last CTA zeroed them
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _forward(inputs, ws, sched)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph, _ = _forward(inputs, ws, sched)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_graph, first)


def test_one_kernel_between_schedule_and_combine():
    inputs, ws, sched = _layer(tokens=512, seed=5)
    _forward(inputs, ws, sched)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _forward(inputs, ws, sched)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # EP = 1: no barrier, x is read in place (direct mode: no comm CTAs, no copies), the
    # combine reads the schedule's route -> row map: the megakernel and the combine.
    assert len(kernels) <= 2, kernels
    assert any("moe_forward_kernel" in k for k in kernels), kernels


@pytest.mark.parametrize("path", ["megakernel", "megakernel-spread"])
def test_launches_of_a_layer_forward_with_the_gpu_schedule(path, monkeypatch):
    """Issue 5's launch budget for the whole routed forward at EP = 1 (schedule, megakernel,
    combine; no barrier at EP = 1): the row table's memsets and three kernels, then two, and
    the routing-error status copy."""
    monkeypatch.setenv("MOK_SCHEDULE", "kernel")
    monkeypatch.setenv("MOK_FORWARD", path)
    inputs, ws, _ = _layer(tokens=512, seed=6)
    ids = inputs["topk_idx"].to(torch.int32).unsqueeze(0)  # the layer's int32 routing

    def layer_forward():
        sched = mok.build_schedule(ws, KERNEL, ids[0])
        return _forward(inputs, ws, sched)

    layer_forward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer_forward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # One async copy per layer forward (after the schedule): the routing-error status word
    # to its pinned ring (routing_errors.record; no host sync). Memsets and that copy are not kernels.
    copies = [n for n in names if "memcpy" in n.lower()]
    assert len(copies) == 1 and "dtoh" in copies[0].lower(), copies
    kernels = [n for n in names if "memset" not in n.lower() and "memcpy" not in n.lower()]
    assert sum("schedule_" in k for k in kernels) == 3, kernels
    assert sum("moe_forward_kernel" in k for k in kernels) == 1, kernels
    assert sum("combine_kernel" in k for k in kernels) == 1, kernels
    assert len(kernels) == 5, kernels  # nothing else: no tensor ops per forward


def test_bad_knobs_raise_before_launch():
    inputs, ws, sched = _layer(tokens=256, seed=2)
    # (num_comm_sms = 0 without direct is spread mode, a valid plan.)
    for kwargs, match in (({"num_comm_sms": -1, "minibatch_rows": 256, "direct": False}, "comm"),
                          ({"num_comm_sms": 10_000, "minibatch_rows": 256, "direct": False},
                           "comm SMs"),
                          ({"num_comm_sms": 4, "minibatch_rows": 100}, "minibatch"),
                          ({"num_comm_sms": 0, "minibatch_rows": 256, "direct": True,
                            "ring_rows": 256}, "ring"),
                          ({"num_comm_sms": 4, "minibatch_rows": 512, "direct": False,
                            "ring_rows": 256}, "ring"),
                          ({"num_comm_sms": 4, "minibatch_rows": 256, "direct": False,
                            "scatter": False}, "slots")):
        with pytest.raises(ValueError, match=match):
            megakernel.moe_forward(ws, sched, inputs["x"], inputs["w1"], inputs["w2"],
                                   save_h=False, **kwargs)


@pytest.mark.parametrize("direct", [True, False])
def test_cycle_probes_count_every_task_and_change_no_bit(direct):
    inputs, ws, sched = _layer(tokens=777, seed=17)
    x, w1, w2 = inputs["x"], inputs["w1"], inputs["w2"]
    kwargs = dict(save_h=True, num_comm_sms=0 if direct else 6, minibatch_rows=256,
                  direct=direct)
    plain = [t.clone() for t in megakernel.moe_forward(ws, sched, x, w1, w2, **kwargs)[1:]]
    probe = megakernel.new_probe(x.device)
    probed = megakernel.moe_forward(ws, sched, x, w1, w2, probe=probe, **kwargs)[1:]
    torch.cuda.synchronize()
    num_rows = int(sched.num_rows.item())  # rows past it are capacity padding, never written
    assert all(torch.equal(a[:num_rows], b[:num_rows]) for a, b in zip(plain, probed))
    summary = megakernel.probe_summary(probe)
    row_tiles = -(-num_rows // 128)
    inter, hidden = w2.shape[2], w2.shape[1]
    assert summary["fc1"]["tasks"] == row_tiles * -(-inter // 128)  # fc1: 128 act columns
    assert summary["fc2"]["tasks"] == row_tiles * -(-hidden // 256)
    assert summary["fc1"]["k_steps"] == summary["fc1"]["tasks"] * -(-hidden // 64)
    for kind in ("fc1", "fc2"):  # a K step cannot beat the tensor cores' peak
        assert summary[kind]["cycles_per_k_step"] > 900
        assert summary[kind]["epilogue_cycles_per_task"] > 0
    assert summary["consumer_cycles"] > summary["fc1"]["mainloop_cycles"]


_STUCK = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from megatron_mok import functional as mok
from megatron_mok.kernels import megakernel
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs
cfg = MoKConfig(backend="kernel")
inputs = make_moe_inputs(num_tokens=512, hidden=1024, inter=512, num_local_experts=8, topk=4,
                         seed=1, device="cuda")
ws = mok.get_workspace(cfg, None, device="cuda", num_local_tokens=512, hidden_size=1024, topk=4,
                       num_local_experts=8)
sched = mok.build_schedule(ws, cfg, inputs["topk_idx"])
megakernel.moe_forward(ws, sched, inputs["x"], inputs["w1"], inputs["w2"], save_h=False,
                       num_comm_sms={num_comm}, minibatch_rows=256, direct=False, hold_tile=1,
                       timeout_ms=300)
try:
    mok.synchronize(ws)
except RuntimeError as err:
    print("ERROR:", err)
"""


@pytest.mark.parametrize("num_comm, mover_warps", [(4, 1), (4, 4), (0, 1)])  # 0: spread mode
def test_watchdog_reports_a_tile_that_is_never_pulled(num_comm, mover_warps):
    script = _STUCK.format(tests=os.path.dirname(__file__), num_comm=num_comm)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "MOK_MOVER_WARPS": str(mover_warps)})
    assert "stuck in the forward megakernel" in done.stdout, done.stdout + done.stderr
    assert "row tile 1" in done.stdout, done.stdout


def test_autotune_times_plans_and_the_forward_uses_the_winner(tmp_path, monkeypatch):
    from megatron_mok.kernels import autotune, tuning
    monkeypatch.setenv("MOK_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    autotune.forget_cache()
    inputs, ws, sched = _layer(tokens=512, seed=13)
    plans = [autotune.ForwardPlan("launches", 0, 0), autotune.ForwardPlan("megakernel", 0, 256),
             autotune.ForwardPlan("megakernel-comm", 4, 512)]
    best, timings = tuning.tune(ws, sched, inputs["x"], inputs["w1"], inputs["w2"],
                                  plans=plans, warmup=1, iters=2)
    assert len(timings) == 3 and all(ms > 0 for ms in timings.values())
    assert best == min(plans, key=lambda p: timings[autotune.plan_name(p)])
    autotune.forget_cache()  # read back from disk
    monkeypatch.delenv("MOK_FORWARD")
    assert autotune.forward_plan(ws, inputs["w1"].shape[1] // 2, KERNEL) == best
    y, _ = _forward(inputs, ws, sched)  # on the tuned plan
    monkeypatch.setenv("MOK_FORWARD", "launches")
    y_ref, _ = _forward(inputs, ws, sched)
    assert torch.equal(y, y_ref)
    autotune.forget_cache()
