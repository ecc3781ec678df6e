"""Reliability, the CPU half (docs/reliability.md): routing errors are latched with their
details and described naming the flag; the fallback to the reference is loud; Megatron's
step checks the latch before the optimizer; knobs, the workspace cache and the autotune
cache behave; every class of bad input gets its exception. The GPU half is
test_reliability_gpu.py."""

import json
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_mok import backend_choice as backend, knobs, reference, routing_errors, schedule, workspace
from megatron_mok.kernels import autotune
from megatron_mok import functional as mok
from megatron_mok.config import MoKConfig, schedule_capacity
from moe_inputs import make_moe_inputs, rel_l2

RS = routing_errors


def _status():
    return torch.zeros(RS.STATUS_SIZE, dtype=torch.int32)


def _adversarial(ep, tokens, topk, local, seed=0):
    """Every route of every rank to rank 0's experts (distinct per token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(local, generator=g)[:topk] for _ in range(ep * tokens)])
    return ids.view(ep, tokens, topk).int()


def test_overflow_is_latched_with_its_details_and_described():
    ep, tokens, topk, local = 4, 64, 3, 4
    ids = _adversarial(ep, tokens, topk, local)
    config = MoKConfig(schedule_capacity_multiplier=0.5)
    capacity = schedule_capacity(config, tokens, topk, ep, local)
    status = _status()
    sched = schedule.build_row_table(ids, 0, local, capacity, status=status, list_dropped=True)
    record = status.tolist()
    rows = int(sched.num_rows)
    assert rows > capacity and record[RS.BITS] == RS.OVERFLOW
    assert record[RS.ROWS_NEEDED] == rows and record[RS.CAPACITY] == capacity
    counts = torch.bincount(ids.flatten().long(), minlength=local)
    assert record[RS.BUSIEST_EXPERT] == int(counts.argmax())
    assert record[RS.BUSIEST_ROWS] == int(counts.max())
    # The dropped routes are exactly those the table does not hold.
    kept = {(r, t, k) for r, t, k in zip(sched.peer_rank.tolist(), sched.peer_token.tolist(),
                                          sched.peer_k.tolist()) if r >= 0}
    dropped = sched.dropped[1:1 + int(sched.dropped[0])].tolist()
    assert record[RS.DROPPED_ROUTES] == len(dropped) == ep * tokens * topk - len(kept) > 0
    assert not kept & {(d // (tokens * topk), d // topk % tokens, d % topk) for d in dropped}
    message = RS.describe(record)
    for part in ("EP rank 0", f"needs {rows} rows", f"holds {capacity}",
                 f"expert {record[RS.BUSIEST_EXPERT]}", "--mok-capacity-multiplier",
                 "schedule_capacity_multiplier"):
        assert part in message, (part, message)
    # The multiplier the message names is enough.
    needed = float(message.split("to at least ")[1].split(" ")[0])
    assert schedule_capacity(MoKConfig(schedule_capacity_multiplier=needed), tokens, topk, ep,
                             local) >= rows


def test_invalid_ids_are_latched_and_the_first_error_keeps_its_details():
    ids = torch.randint(0, 8, (2, 50, 3), generator=torch.Generator().manual_seed(1)).int()
    ids[1, 7, 2] = 99
    ids[1, 9, 0] = -5
    status = _status()
    schedule.build_row_table(ids, 0, 4, 1024, status=status)
    record = status.tolist()
    assert record[RS.BITS] == RS.INVALID_IDS
    assert record[RS.INVALID_RANK:] == [1, 7, 2, 99, 2]
    assert "99 at token 7, k = 2 of EP rank 1" in RS.describe(record)
    # A later pass's error does not overwrite the first one's details.
    ids[1, 7, 2], ids[0, 0, 0] = 3, 1000
    schedule.build_row_table(ids, 0, 4, 1024, status=status)
    assert status.tolist() == record


def test_a_clean_routing_latches_nothing():
    ids = _adversarial(1, 32, 2, 4)
    status = _status()
    sched = schedule.build_row_table(ids, 0, 4, 1024, status=status, list_dropped=True)
    assert status.abs().sum() == 0 and int(sched.dropped[0]) == 0


def test_ep1_tables_cannot_overflow():
    """At EP = 1 the table holds every route plus a tile of padding per expert."""
    for tokens, topk, local in ((1, 1, 1), (7, 10, 64), (4096, 8, 16)):
        ids = torch.zeros(1, tokens, topk, dtype=torch.int32)  # all on one expert
        capacity = schedule_capacity(MoKConfig(schedule_capacity_multiplier=1e-6), tokens,
                                     topk, 1, local)
        assert int(schedule.build_row_table(ids, 0, local, capacity).overflow) == 0


def test_auto_falls_back_loudly_on_a_gpu(monkeypatch):
    monkeypatch.setattr(backend.ops, "kernel_backend_status",
                        lambda device, dtype=None: (False, "the extension did not load (test)"))
    monkeypatch.setattr(backend, "_WARNED", set())
    cuda = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="the extension did not load"):
        assert backend.resolve_backend(MoKConfig(), cuda) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        assert backend.resolve_backend(MoKConfig(), cuda) == "reference"
        assert backend.resolve_backend(MoKConfig(), torch.device("cpu")) == "reference"
    with pytest.raises(RuntimeError, match="backend='kernel' is not available"):
        backend.resolve_backend(MoKConfig(backend="kernel"), cuda)


def test_megatron_checks_the_latch_before_the_optimizer_step(monkeypatch):
    from megatron_mok.megatron.layer import install_step_check

    calls = []
    monkeypatch.setattr(routing_errors, "check", lambda wait=True: calls.append(("check", wait)))

    class Config:
        finalize_model_grads_func = staticmethod(lambda *a, **k: calls.append(("finalize", a)))

    from megatron_mok.kernels import fp8_weight_cache

    config = Config()
    assert install_step_check(config)
    wrapped = config.finalize_model_grads_func
    assert install_step_check(config)  # once
    assert config.finalize_model_grads_func is wrapped
    step = fp8_weight_cache.current_step()
    config.finalize_model_grads_func([1])
    assert calls == [("finalize", ([1],)), ("check", True)]
    assert fp8_weight_cache.current_step() == step + 1  # the FP8 weights are stale now
    bare = type("Bare", (), {"finalize_model_grads_func": None})()
    assert not install_step_check(bare)  # nothing to wrap (forward only): no FP8 reuse
    assert bare.finalize_model_grads_func is None


@pytest.mark.parametrize("flag, kwargs", [
    ("--fp8-format", {"fp8": "e4m3"}),
    ("--fp4-format", {"fp4": "nvfp4"}),
])
def test_fp8_and_fp4_recipes_are_refused_naming_the_flag(flag, kwargs):
    from megatron_mok.megatron.layer import check_mok_supported

    class Config:  # the attributes check_mok_supported reads, as TransformerConfig has them
        activation_func = F.silu
        gated_linear_unit = True

    config = Config()
    for name, value in kwargs.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=flag):
        check_mok_supported(config)


def test_knobs_are_validated_once_for_python_and_cpp(monkeypatch):
    for name, bad in (("MOK_GEMM_CLUSTER", "3"), ("MOK_MOVER_WARPS", "16"),
                      ("MOK_GEMM_SCHEDULER", "dynamic"), ("MOK_DGRAD_H", "smem"),
                      ("MOK_FORWARD", "fast")):
        with pytest.raises(ValueError, match=name):
            monkeypatch.setenv(name, bad)
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOK_GEMM_CLUSTER", "2")
    assert knobs.get("MOK_GEMM_CLUSTER") == "2"
    # Read once: a change of the environment alone is not seen until reload().
    import os
    os.environ["MOK_GEMM_CLUSTER"] = "1"
    assert knobs.get("MOK_GEMM_CLUSTER") == "2"


def test_autotune_keys_carry_the_plan_knobs(monkeypatch):
    default = autotune.plan_key("H200", 8192, 2048, 768, 16, 8, 1)
    assert default == "H200|T=8192|H=2048|I=768|E_loc=16|K=8|EP=1"  # old entries still match
    monkeypatch.setenv("MOK_GEMM_CLUSTER", "2")
    clustered = autotune.plan_key("H200", 8192, 2048, 768, 16, 8, 1)
    assert clustered != default and "MOK_GEMM_CLUSTER=2" in clustered


def test_autotune_cache_writes_are_atomic_across_writers(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("MOK_AUTOTUNE_CACHE", str(path))
    monkeypatch.setattr(autotune, "_LOADED", {})
    plan = autotune.ForwardPlan("launches", 0, 0)
    errors = []

    def writer(i):
        try:
            for j in range(20):
                autotune.store(f"key-{i}-{j}", plan, {"launches": 1.0})
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert json.loads(path.read_text())  # whole JSON, never a torn file
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left behind


def test_the_workspace_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(workspace, "_CACHE", type(workspace._CACHE)())
    monkeypatch.setattr(workspace, "MAX_CACHED_WORKSPACES", 8)
    config = MoKConfig(backend="reference")
    workspace.set_workspace_cache_limit(3)
    made = [mok.get_workspace(config, None, device="cpu", num_local_tokens=t, hidden_size=32,
                              topk=2, num_local_experts=4) for t in range(1, 6)]
    assert len(workspace._CACHE) == 3
    assert mok.get_workspace(config, None, device="cpu", num_local_tokens=5, hidden_size=32,
                             topk=2, num_local_experts=4) is made[-1]  # still cached
    assert mok.get_workspace(config, None, device="cpu", num_local_tokens=1, hidden_size=32,
                             topk=2, num_local_experts=4) is not made[0]  # evicted, rebuilt
    with pytest.raises(ValueError, match="positive int"):
        workspace.set_workspace_cache_limit(0)


# --- bad inputs: one row of docs/reliability.md's table each ------------------------------

def _inputs(**overrides):
    inputs = make_moe_inputs(num_tokens=24, hidden=32, inter=16, num_local_experts=4, topk=2,
                             shared_inter=8, seed=3)
    inputs.update(overrides)
    return inputs


BAD_INPUTS = [
    ("x dtype", {"x": _inputs()["x"].int()}, TypeError, "x must have dtype"),
    ("x rank", {"x": torch.randn(24, 32, 1).bfloat16()}, ValueError, "x must be 2-D"),
    ("x on another device", {"x": torch.empty(24, 32, device="meta").bfloat16()}, ValueError,
     "is on cpu but x is on meta"),
    ("x non-contiguous", {"x": _inputs()["x"].t().contiguous().t()}, ValueError,
     "x must be contiguous"),
    ("topk_idx dtype", {"topk_idx": _inputs()["topk_idx"].float()}, TypeError,
     "topk_idx must have dtype"),
    ("topk_idx rows", {"topk_idx": _inputs()["topk_idx"][:23]}, ValueError,
     "topk_idx has 23 rows"),
    ("topk_w dtype", {"topk_w": _inputs()["topk_w"].double()}, TypeError,
     "topk_w must have dtype"),
    ("topk_w shape", {"topk_w": _inputs()["topk_w"][:, :1].contiguous()}, ValueError,
     "topk_w shape"),
    ("w1 dtype", {"w1": _inputs()["w1"].float()}, TypeError, "w1 must have dtype"),
    ("w1 shape", {"w1": torch.randn(4, 31, 32).bfloat16()}, ValueError, "w1 must be"),
    ("w2 shape", {"w2": torch.randn(4, 32, 15).bfloat16()}, ValueError, "w2 must be"),
    ("w2 non-contiguous", {"w2": _inputs()["w2"].transpose(1, 2).contiguous().transpose(1, 2)},
     ValueError, "w2 must be contiguous"),
    ("shared expert half given", {"shared_w2": None}, ValueError, "given together"),
    ("expert id >= E", {"topk_idx": torch.full((24, 2), 4, dtype=torch.int32)}, ValueError,
     r"expert ids in \[4, 4\] but must be in \[-1, 4\)"),
    ("expert id < -1", {"topk_idx": torch.full((24, 2), -3, dtype=torch.int32)}, ValueError,
     "topk_idx holds expert ids"),
    ("no tokens (T = 0)", {"x": torch.empty(0, 32).bfloat16(),
                           "topk_idx": torch.empty(0, 2, dtype=torch.int32),
                           "topk_w": torch.empty(0, 2)}, ValueError,
     "num_local_tokens must be a positive int"),
    ("no routes (K = 0)", {"topk_idx": torch.empty(24, 0, dtype=torch.int32),
                           "topk_w": torch.empty(24, 0)}, ValueError, "at least one route"),
]


@pytest.mark.parametrize("case, overrides, error, match", BAD_INPUTS,
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_its_exception(case, overrides, error, match):
    with pytest.raises(error, match=match):
        mok.fused_moe(**_inputs(**overrides))


def _by_hand(inputs):
    """y = shared(x) + sum_k w_k expert_{id_k}(x): every route on its own, duplicates too."""
    x = inputs["x"].float()
    y = reference.swiglu_expert(x, inputs["shared_w1"], inputs["shared_w2"], torch.bfloat16)
    y = y.float()
    for t in range(x.shape[0]):
        for k in range(inputs["topk_idx"].shape[1]):
            e = int(inputs["topk_idx"][t, k])
            if e >= 0:
                out = reference.swiglu_expert(x[t:t + 1], inputs["w1"][e], inputs["w2"][e],
                                              torch.bfloat16)
                y[t] += inputs["topk_w"][t, k] * out[0].float()
    return y.bfloat16()


def test_duplicate_ids_and_k_above_e_count_each_route():
    """K = 6 > E = 4: ids repeat within a token; each route adds its own weighted output."""
    inputs = _inputs()
    g = torch.Generator().manual_seed(9)
    inputs["topk_idx"] = torch.randint(-1, 4, (24, 6), generator=g, dtype=torch.int32)
    inputs["topk_idx"][:, 1] = inputs["topk_idx"][:, 0]  # a duplicate in every token
    inputs["topk_w"] = torch.rand(24, 6, generator=g)
    y = mok.fused_moe(**inputs)
    assert rel_l2(y, _by_hand(inputs)) < 1e-2


def test_nan_in_x_stays_in_its_token():
    """No error is raised (as Megatron's own experts): the token's output is NaN, the other
    tokens' are finite (Megatron's --check-for-nan-in-loss-and-grad reports it)."""
    inputs = _inputs()
    inputs["x"] = inputs["x"].clone()
    inputs["x"][5, 3] = float("nan")
    y = mok.fused_moe(**inputs)
    assert torch.isnan(y[5]).all()
    assert torch.isfinite(torch.cat([y[:5], y[6:]])).all()


def test_a_routing_without_tokens_latches_nothing():
    status = _status()
    sched = schedule.build_row_table(torch.zeros(2, 0, 4, dtype=torch.int32), 1, 8, 128,
                                     status=status, list_dropped=True)
    assert status.abs().sum() == 0 and int(sched.num_rows) == 0 and int(sched.dropped[0]) == 0


def test_kernel_sizes_are_checked_before_any_launch():
    from megatron_mok.validation import check_kernel_dims
    check_kernel_dims(hidden_size=2880, intermediate_size=64)
    for bad in (100, 0, 2884):
        with pytest.raises(ValueError, match=f"hidden_size to be a positive multiple of 8, "
                                             f"got {bad}"):
            check_kernel_dims(hidden_size=bad)
