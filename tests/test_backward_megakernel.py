"""Backward megakernel (pull dy rows and weights -> fc2 dgrad with the weights and the
SwiGLU backward -> fc1 dgrad -> weight gradients in one launch, EP = 1;
MOK_BACKWARD=megakernel) on the GPU: its outputs are the bits of the launch chain's
pull_rows + dgrad_swiglu_routed + rows_matmul + wgrad (also
added into main_grad planes), a whole training step's gradients are the chain's and within
tolerance of the reference, and they do not depend on the minibatch or the run; a row
that is never pulled becomes a watchdog error."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_mok import functional as mok
from megatron_mok.kernels import grouped_gemm, backend as kernel_backend, megakernel, ops
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs, rel_l2

pytestmark = pytest.mark.gpu

KERNEL = MoKConfig(backend="kernel")


@pytest.fixture(autouse=True)
def _spread_forward(monkeypatch):
    # The forward the backward follows: the EP = 1 default (spread, rows combined in place).
    monkeypatch.setenv("MOK_FORWARD", "megakernel-spread")
    monkeypatch.setenv("MOK_EP1_COMBINE", "rows")


def _inputs(hidden=2048, inter=768, experts=16, topk=8, tokens=700, seed=0, shared=None):
    return make_moe_inputs(num_tokens=tokens, hidden=hidden, inter=inter,
                           num_local_experts=experts, topk=topk, shared_inter=shared, seed=seed,
                           drop_fraction=0.05, device="cuda")


def _training_step(inputs, dy, config=KERNEL, **kw):
    """y and the gradients of every floating-point input of one forward + backward."""
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v
              for k, v in inputs.items()}
    y = mok.fused_moe(**leaves, config=config, **kw)
    y.backward(dy)
    names = [k for k in ("x", "topk_w", "w1", "w2", "shared_w1", "shared_w2") if k in leaves
             and leaves[k] is not None]
    return {"y": y.detach(), **{f"d_{k}": leaves[k].grad for k in names}}


@pytest.mark.parametrize("shape", [(2048, 768, 16, 8), (7168, 2048, 32, 8), (4096, 1024, 64, 10),
                                   (1032, 520, 8, 4),  # H, I not multiples of 64
                                   (136, 72, 4, 2)])   # 17 vectors a row: most lanes idle
def test_outputs_are_the_launch_chains_bits(shape):
    hidden, inter, experts, topk = shape
    inputs = _inputs(hidden, inter, experts, topk, seed=3)
    ws = mok.get_workspace(KERNEL, None, device="cuda", num_local_tokens=700,
                           hidden_size=hidden, topk=topk, num_local_experts=experts)
    sched = mok.build_schedule(ws, KERNEL, inputs["topk_idx"])
    rows, cap = int(sched.num_rows.item()), ws.capacity
    gen = torch.Generator(device="cuda").manual_seed(5)
    dy = torch.randn(700, hidden, device="cuda", generator=gen).bfloat16()
    h = torch.randn(cap, 2 * inter, device="cuda", generator=gen).bfloat16()
    w1, w2 = inputs["w1"].contiguous(), inputs["w2"].contiguous()
    topk_w = inputs["topk_w"].float().contiguous()

    # The chain: pull_rows (rows and weights), dgrad_swiglu_routed, rows_matmul.
    arena = ws.arena
    arena.view("dy").copy_(dy)
    arena.view("topk_w").copy_(topk_w)
    dy_rows_ref = torch.full((cap, hidden), float("nan"), device="cuda").bfloat16()
    row_w_ref = torch.full((cap,), float("nan"), device="cuda")
    ops.pull_rows(arena.peer_base, arena.offset("dy"), sched, topk, dy_rows_ref,
                  w_offset=arena.offset("topk_w"), row_w=row_w_ref)
    d_h_ref, dots_ref, act_s_ref = grouped_gemm.dgrad_swiglu_routed(
        dy_rows_ref, row_w_ref, w2, h, sched.expert_offsets, sched.num_rows)
    dx_ref = grouped_gemm.rows_matmul(d_h_ref, w1, sched.expert_offsets, sched.num_rows,
                                      w_transposed=True)

    junk = torch.full((6, cap, max(hidden, 2 * inter)), float("nan"), device="cuda").bfloat16()
    del junk  # the caching allocator hands these NaN blocks out next
    out = megakernel.moe_backward(ws, sched, dy, topk_w, w1, w2, h, minibatch_rows=256)
    torch.cuda.synchronize()
    assert torch.equal(out.dy_rows[:rows], dy_rows_ref[:rows])
    assert torch.equal(out.row_w[:rows], row_w_ref[:rows])
    assert torch.equal(out.dots_part[:rows], dots_ref[:rows])
    assert torch.equal(out.act_scaled[:rows], act_s_ref[:rows])
    assert torch.equal(out.d_h[:rows], d_h_ref[:rows])
    assert torch.equal(out.dx_rows[:rows], dx_ref[:rows])
    assert torch.isfinite(out.dx_rows[:rows].float()).all()
    # The pull itself, against the routing: row j holds dy[token] and w[token, k].
    valid = sched.peer_rank[:rows] >= 0
    tok, k = sched.peer_token[:rows].long(), sched.peer_k[:rows].long()
    assert torch.equal(out.dy_rows[:rows][valid], dy[tok[valid]])
    assert torch.equal(out.row_w[:rows][valid], topk_w[tok[valid], k[valid]])
    assert torch.count_nonzero(out.dy_rows[:rows][~valid]) == 0


def _fp32_wgrad(a, b, offsets):
    """dw[e] = a[rows of e]^T @ b[rows of e] in fp32 (the independent reference)."""
    bounds = offsets.tolist()
    return torch.stack([a[lo:hi].float().t() @ b[lo:hi].float()
                        for lo, hi in zip(bounds[:-1], bounds[1:])])


def _planes_apart(experts, m, n, gap, gen):
    """fp32 [E, m, n] planes `gap` elements apart in one buffer (random start values), as
    Megatron's grad buffer may lay out per-expert main_grads."""
    flat = torch.randn(experts * (m * n + gap) + 64, device="cuda", generator=gen)
    planes = flat[16:16 + experts * (m * n + gap)].as_strided((experts, m, n),
                                                               (m * n + gap, n, 1))
    return flat, planes


@pytest.mark.parametrize("mode", ["bf16", "main_grad", "main_grad_reversed"])
@pytest.mark.parametrize("shape", [(2048, 768, 16, 8), (1032, 520, 8, 4), (136, 72, 4, 2)])
def test_weight_gradient_phase_is_the_wgrad_launches_bits(shape, mode):
    """Phase 2 (MOK_BACKWARD_WGRAD=fused): dw2 = dy_rows^T act_scaled and dw1 = d_h^T x_rows per
    expert, bf16 or added into fp32 planes lying apart (reversed as in Megatron's buffer),
    are the bits of grouped_gemm.wgrad on the same operands and near an fp32 reference; an
    expert without rows gets zeros (adds nothing)."""
    hidden, inter, experts, topk = shape
    inputs = _inputs(hidden, inter, experts, topk, seed=4)
    inputs["topk_idx"][inputs["topk_idx"] == 1] = -1  # expert 1 gets no rows
    ws = mok.get_workspace(KERNEL, None, device="cuda", num_local_tokens=700,
                           hidden_size=hidden, topk=topk, num_local_experts=experts)
    sched = mok.build_schedule(ws, KERNEL, inputs["topk_idx"])
    cap, offsets = ws.capacity, sched.expert_offsets
    assert offsets[1] == offsets[2]
    gen = torch.Generator(device="cuda").manual_seed(6)
    dy = torch.randn(700, hidden, device="cuda", generator=gen).bfloat16()
    h = torch.randn(cap, 2 * inter, device="cuda", generator=gen).bfloat16()
    x_rows = torch.randn(cap, hidden, device="cuda", generator=gen).bfloat16()
    w1, w2 = inputs["w1"].contiguous(), inputs["w2"].contiguous()
    topk_w = inputs["topk_w"].float().contiguous()
    accumulate, reverse = mode != "bf16", mode == "main_grad_reversed"
    if accumulate:
        _, dw2 = _planes_apart(experts, hidden, inter, 8, gen)
        _, dw1 = _planes_apart(experts, 2 * inter, hidden, 4, gen)
    else:
        dw2 = torch.full((experts, hidden, inter), float("nan"), device="cuda").bfloat16()
        dw1 = torch.full((experts, 2 * inter, hidden), float("nan"), device="cuda").bfloat16()
    start2, start1 = dw2.clone(), dw1.clone()
    targets = megakernel.WgradTargets(x_rows, dw2, dw1, accumulate=accumulate,
                                      reverse2=reverse, reverse1=reverse)
    out = megakernel.moe_backward(ws, sched, dy, topk_w, w1, w2, h, minibatch_rows=256,
                                  wgrad=targets)
    d_out, act, d_h = out.dy_rows, out.act_scaled, out.d_h
    # The chain's wgrad launches on the megakernel's own dy rows, act_scaled and d_h
    # (themselves the chain's bits: test_outputs_are_the_launch_chains_bits).
    if accumulate:
        ref2, ref1 = start2.clone(), start1.clone()
        grouped_gemm.wgrad(d_out, act, offsets, accumulate_into=ref2, reverse_experts=reverse)
        grouped_gemm.wgrad(d_h, x_rows, offsets, accumulate_into=ref1, reverse_experts=reverse)
    else:
        ref2 = grouped_gemm.wgrad(d_out, act, offsets)
        ref1 = grouped_gemm.wgrad(d_h, x_rows, offsets)
    torch.cuda.synchronize()
    assert torch.equal(dw2, ref2) and torch.equal(dw1, ref1)
    order = torch.arange(experts - 1, -1, -1) if reverse else torch.arange(experts)
    added2 = (dw2.float() - (start2.float() if accumulate else 0))[order]
    added1 = (dw1.float() - (start1.float() if accumulate else 0))[order]
    assert rel_l2(added2, _fp32_wgrad(d_out, act, offsets)) < 1e-2
    assert rel_l2(added1, _fp32_wgrad(d_h, x_rows, offsets)) < 1e-2
    assert torch.count_nonzero(added2[1]) == 0 and torch.count_nonzero(added1[1]) == 0


@pytest.mark.parametrize("layout", ["stacked", "te", "sequential", "uneven"])
def test_main_grad_through_the_megakernel_is_the_chains(layout, monkeypatch):
    """Megatron's gradient-accumulation fusion with MOK_BACKWARD=megakernel and
    MOK_BACKWARD_WGRAD=fused: where each
    weight's main_grads are one run of equally spaced planes (stacked, TE's backwards
    buffer, SequentialMLP's interleaved one) phase 2 adds into them; otherwise (uneven) the
    wgrad launches do. Either way the buffers end as the launch chain leaves them, bit for
    bit, over two backwards."""
    from megatron_mok.grad_accumulation import ExpertGradAccumulator
    from test_gpu_backend import _main_grad_buffers
    monkeypatch.setenv("MOK_BACKWARD_WGRAD", "fused")
    inputs = _inputs(2048, 768, 16, 8, tokens=1000, seed=8)
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    calls = []
    moe_backward = megakernel.moe_backward
    monkeypatch.setattr(megakernel, "moe_backward",
                        lambda *a, **k: calls.append(k["wgrad"]) or moe_backward(*a, **k))
    ends = {}
    for path in ("megakernel", "launches"):
        monkeypatch.setenv("MOK_BACKWARD", path)
        flat, fc1, fc2 = _main_grad_buffers(layout, inputs["w1"], inputs["w2"])
        flat.copy_(torch.randn(flat.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(1)))
        accs = (ExpertGradAccumulator(fc1), ExpertGradAccumulator(fc2))
        for _ in range(2):
            step = _training_step(inputs, dy, accumulators=accs)
        ends[path] = (flat.clone(), step)
    assert len(calls) == 2 and all((c is not None) == (layout != "uneven") for c in calls)
    assert all(c.accumulate for c in calls if c is not None)
    assert torch.equal(ends["megakernel"][0], ends["launches"][0])
    for name in ("d_x", "d_topk_w"):
        assert torch.equal(ends["megakernel"][1][name], ends["launches"][1][name]), name


@pytest.mark.parametrize("wgrad", ["fused", "launches"])
def test_training_step_is_the_chains_and_near_the_reference(wgrad, monkeypatch):
    monkeypatch.setenv("MOK_BACKWARD_WGRAD", wgrad)
    inputs = _inputs(1024, 512, 8, 4, tokens=640, seed=9, shared=256)
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    calls = []
    moe_backward = megakernel.moe_backward

    wgrads = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("minibatch_rows"))
        wgrads.append(kwargs.get("wgrad"))
        return moe_backward(*args, **kwargs)

    monkeypatch.setattr(megakernel, "moe_backward", spy)
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    fused = _training_step(inputs, dy)
    assert calls == [kernel_backend.backward_minibatch()]  # the megakernel ran
    assert (wgrads[0] is not None) == (wgrad == "fused")  # with phase 2 where asked
    monkeypatch.setenv("MOK_BACKWARD", "launches")
    chain = _training_step(inputs, dy)
    assert calls == [kernel_backend.backward_minibatch()]  # and the chain did not call it
    for name in chain:
        assert torch.equal(fused[name], chain[name]), name
    ref = _training_step(inputs, dy, MoKConfig(backend="reference"))
    for name in ref:
        assert rel_l2(fused[name], ref[name]) < 1e-2, name


@pytest.mark.parametrize("minibatch", [128, 512, 4096])
def test_gradients_independent_of_minibatch_and_run(minibatch, monkeypatch):
    inputs = _inputs(2048, 768, 16, 8, tokens=1500, seed=7)
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    monkeypatch.setenv("MOK_BACKWARD", "megakernel")
    monkeypatch.setenv("MOK_BACKWARD_WGRAD", "fused")  # weight grads from phase 2 too
    monkeypatch.setenv("MOK_BACKWARD_MINIBATCH", "2048")
    base = _training_step(inputs, dy)
    monkeypatch.setenv("MOK_BACKWARD_MINIBATCH", str(minibatch))
    for _ in range(2):
        again = _training_step(inputs, dy)
        for name in base:
            assert torch.equal(again[name], base[name]), name


def test_backward_autotune_stores_a_plan_the_backward_then_runs(monkeypatch, tmp_path):
    from megatron_mok.kernels import autotune, tuning
    monkeypatch.setenv("MOK_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("MOK_BACKWARD", raising=False)
    autotune.forget_cache()
    inputs = _inputs(2048, 768, 16, 8, tokens=1024, seed=11)
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    chain = _training_step(inputs, dy)  # no plan cached yet: the launch chain
    ws = mok.get_workspace(KERNEL, None, device="cuda", num_local_tokens=1024,
                           hidden_size=2048, topk=8, num_local_experts=16)
    sched = mok.build_schedule(ws, KERNEL, inputs["topk_idx"])
    plans = [autotune.BackwardPlan("launches", 0), autotune.BackwardPlan("megakernel", 1024)]
    for forced in plans:  # store each plan in turn: the backward follows the cache
        best, timings = tuning.tune_backward(ws, sched, inputs["x"], inputs["topk_w"],
                                               inputs["w1"], inputs["w2"], dy, plans=[forced],
                                               iters=2)
        assert best == forced and set(timings) == {autotune.backward_plan_name(forced)}
        calls = []
        moe_backward = megakernel.moe_backward
        monkeypatch.setattr(megakernel, "moe_backward",
                            lambda *a, **k: calls.append(k["minibatch_rows"]) or
                            moe_backward(*a, **k))
        step = _training_step(inputs, dy)
        monkeypatch.setattr(megakernel, "moe_backward", moe_backward)
        assert calls == ([1024] if forced.path == "megakernel" else [])
        for name in chain:
            assert torch.equal(step[name], chain[name]), (forced, name)
    best, timings = tuning.tune_backward(ws, sched, inputs["x"], inputs["topk_w"],
                                           inputs["w1"], inputs["w2"], dy, iters=3)
    assert set(timings) == {autotune.backward_plan_name(p) for p in autotune.backward_candidates()}
    print("backward autotune:", timings, "best", best)


# Subprocess scripts (a failure there is a trap or an abort): a kernel workspace and schedule
# for 512 tokens, H = 1024, I = 512, 8 experts, top-4.
_SETUP = r"""
import sys, threading, torch
sys.path.insert(0, {tests!r})
from megatron_mok import functional as mok
from megatron_mok.kernels import grouped_gemm, megakernel
from megatron_mok.config import MoKConfig
from moe_inputs import make_moe_inputs
cfg = MoKConfig(backend="kernel")
inputs = make_moe_inputs(num_tokens=512, hidden=1024, inter=512, num_local_experts=8, topk=4,
                         seed={seed}, device="cuda")
ws = mok.get_workspace(cfg, None, device="cuda", num_local_tokens=512, hidden_size=1024, topk=4,
                       num_local_experts=8)
sched = mok.build_schedule(ws, cfg, inputs["topk_idx"])
cap = ws.capacity
"""

_STUCK = _SETUP + r"""
dy = torch.randn(512, 1024, device="cuda").bfloat16()
h = torch.randn(cap, 1024, device="cuda").bfloat16()
megakernel.moe_backward(ws, sched, dy, inputs["topk_w"], inputs["w1"], inputs["w2"], h,
                        minibatch_rows=256, hold_tile=1, timeout_ms=300)
try:
    mok.synchronize(ws)
except RuntimeError as err:
    print("ERROR:", err)
"""


def test_watchdog_reports_a_row_tile_that_is_never_pulled():
    script = _STUCK.format(tests=os.path.dirname(__file__), seed=1)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert "stuck in the backward megakernel" in done.stdout, done.stdout + done.stderr
    assert "row tile 1" in done.stdout, done.stdout


_FRESH_THREAD = _SETUP + r"""
t = lambda *shape: torch.randn(*shape, device="cuda").bfloat16()
dy, h, x_rows = t(512, 1024), t(cap, 1024), t(cap, 1024)
targets = megakernel.WgradTargets(x_rows, t(8, 1024, 512), t(8, 1024, 1024))
out = {{}}
def run():  # this thread's first CUDA call encodes the megakernel's TMA descriptors
    grads = megakernel.moe_backward(ws, sched, dy, inputs["topk_w"], inputs["w1"],
                                    inputs["w2"], h, minibatch_rows=256, wgrad=targets)
    out["dw"] = grouped_gemm.wgrad(grads.dy_rows, grads.act_scaled, sched.expert_offsets)
thread = threading.Thread(target=run)
thread.start()
thread.join()
torch.cuda.synchronize()
print("OK" if torch.equal(out["dw"], targets.dw2) else "MISMATCH")
"""


def test_a_thread_without_a_cuda_context_can_launch():
    """Autograd runs the backward on its own device thread; at EP = 1 the backward
    megakernel can be that thread's first CUDA call, and the driver-API TMA encoding needs
    a current context (it failed with CUDA_ERROR_INVALID_CONTEXT and aborted the process
    before make_context_current). In a subprocess: the failure was an abort."""
    script = _FRESH_THREAD.format(tests=os.path.dirname(__file__), seed=2)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip().endswith("OK"), done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("forward", ["megakernel", "launches"])
@pytest.mark.parametrize("backward", ["megakernel", "launches"])
def test_wgrad_gathering_x_gives_the_same_bits(forward, backward, monkeypatch):
    """MOK_WGRAD_GATHER=1: dW1's launch gathers x's rows itself and the training step's
    every gradient is the bits of the default path; the backward materialises no x rows,
    and a forward that made them (the launch chain) does not keep them for the backward."""
    inputs = _inputs(2048, 768, 16, 8, tokens=1500, seed=13)
    dy = torch.randn(inputs["x"].shape, device="cuda").bfloat16()
    monkeypatch.setenv("MOK_FORWARD", forward)  # megakernel: direct at EP = 1, no x rows made
    monkeypatch.setenv("MOK_BACKWARD", backward)
    plain = _training_step(inputs, dy)
    gathered_rows, gathers, kept_rows = [], [], []
    gather_rows, wgrad = kernel_backend.gather_rows, grouped_gemm.wgrad
    saved_type = kernel_backend.KernelSaved
    monkeypatch.setattr(kernel_backend, "gather_rows",
                        lambda *a, **k: gathered_rows.append(1) or gather_rows(*a, **k))
    monkeypatch.setattr(grouped_gemm, "wgrad",
                        lambda *a, **k: gathers.append(k.get("gather") is not None) or
                        wgrad(*a, **k))
    monkeypatch.setattr(kernel_backend, "KernelSaved",
                        lambda *a: kept_rows.append(a[4] is not None) or saved_type(*a))
    monkeypatch.setenv("MOK_WGRAD_GATHER", "1")
    gathered = _training_step(inputs, dy)
    for name in plain:
        assert torch.equal(gathered[name], plain[name]), name
    assert not gathered_rows and gathers == [False, True]  # dW2 as before, dW1 read x
    assert kept_rows == [False]
