"""CPU tests of the EP=1 layer benchmark (benchmarks/): shapes and FLOP formulas, the
routing generators, the torch-unfused baseline against the reference, the records and
the report (README table, markers). The timing itself needs a GPU."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is a top-level folder, not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks import layer as L  # noqa: E402
from benchmarks import plot_megakernel as PM  # noqa: E402
from benchmarks import report as R  # noqa: E402
from benchmarks import shapes as S  # noqa: E402
from megatron_mok.reference import moe_reference  # noqa: E402


# ----------------------------------------------------------------------------------------
# Shapes and FLOPs
# ----------------------------------------------------------------------------------------

def test_shapes_match_benchmarks_md():
    want = {  # name: (H, I, E, K, shared I) from docs/benchmarks.md
        "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
        "deepseek-v3": (7168, 2048, 256, 8, 2048),
        "dsv4-pro": (7168, 3072, 384, 6, 3072),
        "qwen3.5-like": (4096, 1024, 512, 10, 0),
        "gpt-oss-120b": (2880, 2880, 128, 4, 0),
        "mixtral-8x7b": (4096, 14336, 8, 2, 0),
    }
    assert list(S.SHAPES) == list(want)
    for name, (h, i, e, k, si) in want.items():
        s = S.get_shape(name)
        assert (s.hidden, s.inter, s.num_experts, s.topk, s.shared_inter) == (h, i, e, k, si)
    e_loc = {n: S.ep8_proxy(S.SHAPES[n]).num_local_experts for n in want}
    assert e_loc == {"qwen3-30b-a3b": 16, "deepseek-v3": 32, "dsv4-pro": 48,
                     "qwen3.5-like": 64, "gpt-oss-120b": 16, "mixtral-8x7b": 8}
    with pytest.raises(KeyError):
        S.get_shape("nope")


def test_flop_formulas():
    assert S.forward_flops(10, 3, 5, 2, 7) == 6 * (10 * 2 * 5 + 10 * 7) * 3
    assert S.backward_flops(10, 3, 5, 2, 7) == 2 * S.forward_flops(10, 3, 5, 2, 7)
    local = S.ep8_proxy(S.SHAPES["deepseek-v3"])
    assert S.pass_flops(local, 8192, "bwd") == 2 * S.pass_flops(local, 8192, "fwd")
    # DEVELOPING.md's unfused H200 table: T = 8192, ms -> TFLOP/s.
    for name, ms, tflops in (("qwen3-30b-a3b", 3.15, 196), ("deepseek-v3", 16.46, 395),
                             ("dsv4-pro", 17.45, 434), ("mixtral-8x7b", 11.79, 490)):
        f = S.pass_flops(S.ep8_proxy(S.SHAPES[name]), 8192, "fwd")
        assert f / (ms * 1e-3) / 1e12 == pytest.approx(tflops, rel=0.01), name
    assert S.gemm_floor_ms(790e12 * 1e-3, 790.0) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------

def _distinct(idx):
    s = idx.sort(dim=1).values
    return bool((s[:, 1:] != s[:, :-1]).all())


@pytest.mark.parametrize("kind", S.ROUTINGS)
def test_routing_format_and_seed(kind):
    idx, w = S.make_routing(kind, 512, 128, 8, seed=3, device="cpu", ep_size=8)
    assert idx.dtype == torch.int32 and idx.shape == (512, 8) and idx.is_contiguous()
    assert w.dtype == torch.float32 and w.shape == (512, 8)
    assert _distinct(idx) and int(idx.min()) >= 0 and int(idx.max()) < 128
    torch.testing.assert_close(w.sum(1), torch.ones(512))
    idx2, w2 = S.make_routing(kind, 512, 128, 8, seed=3, device="cpu", ep_size=8)
    assert torch.equal(idx, idx2) and torch.equal(w, w2)
    idx3, _ = S.make_routing(kind, 512, 128, 8, seed=4, device="cpu", ep_size=8)
    assert not torch.equal(idx, idx3)


def test_balanced_is_roughly_uniform():
    idx, _ = S.balanced_routing(8192, 16, 8, seed=0, device="cpu")
    load = S.expert_load(idx, 16).double()
    assert load.sum() == 8192 * 8
    assert float(load.max() / load.mean()) < 1.05


def test_skewed_is_skewed():
    idx, _ = S.skewed_routing(8192, 128, 8, seed=0, device="cpu")
    assert _distinct(idx)
    load = S.expert_load(idx, 128).double()
    assert float(load.max() / load.mean()) > 8       # Zipf s=1.2: the top expert is hot
    assert int(load.argmax()) == 0
    assert float(load[:8].sum() / load.sum()) > 0.3  # head of the distribution
    bal = S.expert_load(S.balanced_routing(8192, 128, 8, seed=0, device="cpu")[0], 128)
    assert float(load.std()) > 5 * float(bal.double().std())


def test_blocked_routing_runs_of_neighbouring_tokens():
    idx, _ = S.blocked_routing(4096, 32, 8, seed=1, device="cpu")
    load = S.expert_load(idx, 32)
    assert int(load.min()) == int(load.max()) == 4096 * 8 // 32  # balanced
    tokens = (idx == 5).any(1).nonzero().flatten()
    assert int((tokens.diff() != 1).sum()) == 7  # 8 runs of neighbouring tokens


def test_plot_megakernel_best_speedups_skip_wrong_answers():
    rec = lambda path, ms, **kw: {"shape": "s", "path": path, "ms": ms, **kw}  # noqa: E731
    best = PM.best_speedups([rec("launches-mok", 2.0), rec("launches-torch", 4.0),
                             rec("megakernel-direct", 2.5), rec("megakernel-direct", 1.6),
                             rec("megakernel-comm", 1.0, bit_equal=False),
                             rec("megakernel-comm", 4.0, bit_equal=True)])
    assert best == {"s": {"launches-torch": 0.5, "megakernel-direct": 1.25,
                          "megakernel-comm": 0.5}}


def test_adversarial_hits_one_rank():
    e, ep = 256, 8
    for hot in (0, 5):
        idx, _ = S.adversarial_routing(4096, e, 8, seed=1, device="cpu", ep_size=ep,
                                       hot_rank=hot)
        ranks = idx.long() // (e // ep)
        assert bool((ranks == hot).all()) and _distinct(idx)
        assert int(S.expert_load(idx, e)[hot * 32:(hot + 1) * 32].min()) > 0
    # At EP = 1 every expert is on the one rank: adversarial is balanced.
    a, _ = S.adversarial_routing(64, 16, 4, seed=2, device="cpu", ep_size=1)
    b, _ = S.balanced_routing(64, 16, 4, seed=2, device="cpu")
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        S.adversarial_routing(64, 16, 4, device="cpu", ep_size=8)  # 2 experts per rank < K


# ----------------------------------------------------------------------------------------
# torch-unfused baseline
# ----------------------------------------------------------------------------------------

@pytest.fixture(params=["grouped_mm", "loop"])
def grouped_gemm_path(request, monkeypatch):
    L._CPU_GROUPED_MM_OK.clear()
    if request.param == "loop":
        monkeypatch.setenv("MOK_BENCH_GROUPED_MM_LOOP", "1")
    else:
        monkeypatch.delenv("MOK_BENCH_GROUPED_MM_LOOP", raising=False)
        if not L._cpu_grouped_mm_works(torch.bfloat16):
            pytest.skip("torch._grouped_mm has no CPU kernel in this torch")
    yield request.param
    L._CPU_GROUPED_MM_OK.clear()


def test_grouped_linear_matches_loop(grouped_gemm_path):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 32, generator=g).bfloat16()
    w = torch.randn(3, 24, 32, generator=g).bfloat16()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)  # an empty group
    out = L.grouped_linear(a, w, offs)
    want = torch.cat([a[:10].float() @ w[0].float().t(), a[10:].float() @ w[2].float().t()])
    assert L.rel_l2(out, want) < 1e-2
    assert L.grouped_mm_impl("cpu") == ("per-expert loop" if grouped_gemm_path == "loop"
                                        else "torch._grouped_mm")
    assert L.grouped_mm_impl("cuda") == "torch._grouped_mm"


@pytest.mark.parametrize("shape_name", ["tiny", "tiny-noshared"])
def test_torch_unfused_matches_reference(shape_name, grouped_gemm_path):
    local = S.ep8_proxy(S.get_shape(shape_name))
    weights = L.make_weights(local, "cpu", seed=0)
    case = L.make_case(local, 96, "skewed", "cpu", seed=0)
    ref = L.reference_outputs(case, weights, want_grads=True)
    backend = L.TorchUnfusedBackend(weights, "cpu")
    result = L.check_backend(backend, case, ref)
    assert result["fwd_rel_l2"] < L.CHECK_TOL
    assert result["bwd_rel_l2_max"] < L.CHECK_TOL, result["bwd_rel_l2"]
    assert set(result["bwd_rel_l2"]) >= {"dx", "d_topk_w", "dw1", "dw2"}
    assert all(t.grad is None for t in weights.leaves())  # the check leaves no gradients


def test_gpt_oss_variant_shape_runs_its_activation_and_biases(grouped_gemm_path):
    """tiny-glu (GPT-OSS's clamped GLU and expert biases): torch-unfused and the mok
    backend (the reference here) against the reference, db1 and db2 included; backends
    without GLU or biases are refused, not run as plain SwiGLU."""
    shape = S.get_shape("tiny-glu")
    local = S.ep8_proxy(shape)
    assert (local.activation, local.expert_bias) == ("gpt-oss", True)
    assert S.get_shape("gpt-oss-120b-glu").hidden == S.get_shape("gpt-oss-120b").hidden
    assert "gpt-oss-120b-glu" not in S.SHAPES  # not in the default set
    weights = L.make_weights(local, "cpu", seed=0)
    assert weights.b1.shape == (local.num_local_experts, 2 * local.inter)
    case = L.make_case(local, 96, "skewed", "cpu", seed=0)
    ref = L.reference_outputs(case, weights, want_grads=True, activation=local.activation)
    plain = L.reference_outputs(case, weights, want_grads=False)  # SwiGLU, biases ignored
    assert L.rel_l2(plain["y"], ref["y"]) > 0.1  # the variant computes something else
    args = argparse.Namespace(mok_backend="auto", seed=0)
    for result in _variant_backends_match_reference(local, weights, case, ref):
        assert set(result["bwd_rel_l2"]) >= {"db1", "db2"}
    with pytest.raises(ValueError, match="plain SwiGLU experts without biases"):
        L.make_backend("sonicmoe", local, weights, "cpu", args)


def test_non_gated_variant_shape_runs_squared_relu_with_its_flops(grouped_gemm_path):
    """tiny-relu2 (non-gated squared-ReLU experts): w1 [E_loc, I, H], FLOPs with one fc1
    GEMM, torch-unfused and the mok backend against the reference."""
    local = S.ep8_proxy(S.get_shape("tiny-relu2"))
    weights = L.make_weights(local, "cpu", seed=0)
    assert weights.w1.shape == (local.num_local_experts, local.inter, local.hidden)
    gated = S.ep8_proxy(S.get_shape("tiny-noshared"))
    assert S.pass_flops(local, 96, "fwd") == pytest.approx(2 / 3 * S.pass_flops(gated, 96, "fwd"))
    case = L.make_case(local, 96, "skewed", "cpu", seed=0)
    ref = L.reference_outputs(case, weights, want_grads=True, activation=local.activation)
    _variant_backends_match_reference(local, weights, case, ref)


def _variant_backends_match_reference(local, weights, case, ref) -> list:
    """torch-unfused and mok (the reference backend here) on a variant shape, forward and
    backward within the benchmark's check tolerance; their check results."""
    args = argparse.Namespace(mok_backend="auto", seed=0)
    results = []
    for backend in (L.make_backend("torch-unfused", local, weights, "cpu", args),
                    L.make_backend("mok", local, weights, "cpu", args)):
        result = L.check_backend(backend, case, ref)
        assert result["fwd_rel_l2"] < L.CHECK_TOL, backend.name
        assert result["bwd_rel_l2_max"] < L.CHECK_TOL, (backend.name, result["bwd_rel_l2"])
        results.append(result)
    return results


def test_torch_unfused_dropped_routes():
    local = S.ep8_proxy(S.get_shape("tiny"))
    w = L.make_weights(local, "cpu", seed=1)
    case = L.make_case(local, 64, "balanced", "cpu", seed=1)
    idx = case.topk_idx.clone()
    idx[::3, 1] = -1
    with torch.no_grad():
        y = L.torch_unfused_moe(case.x, idx, case.topk_w, *w.tensors(), has_dropped_routes=True)
        ref = moe_reference(case.x, idx, case.topk_w, *w.tensors())
    assert L.rel_l2(y, ref) < L.CHECK_TOL


def test_check_backend_flags_a_wrong_backend():
    local = S.ep8_proxy(S.get_shape("tiny-noshared"))
    weights = L.make_weights(local, "cpu")
    case = L.make_case(local, 32, "balanced", "cpu")
    ref = L.reference_outputs(case, weights, want_grads=False)

    class Wrong(L.TorchUnfusedBackend):
        def run(self, inp):
            return super().run(inp) * 1.1

    result = L.check_backend(Wrong(weights, "cpu"), case, ref)
    assert result["fwd_rel_l2"] > L.CHECK_TOL
    rec = L.make_record({}, S.get_shape("tiny-noshared"), local, 32, "balanced", "x", "fwd",
                        100.0, times=[1.0], check=result)
    assert rec["correct"] is False


def test_check_tokens_resolution():
    small = S.ep8_proxy(S.SHAPES["qwen3-30b-a3b"])
    big = S.ep8_proxy(S.SHAPES["deepseek-v3"])
    assert L.resolve_check_tokens("auto", small, 8192) == 8192
    assert L.resolve_check_tokens("auto", big, 8192) == L.AUTO_CHECK_TOKENS
    assert L.resolve_check_tokens("full", big, 8192) == 8192
    assert L.resolve_check_tokens("256", big, 128) == 128


# ----------------------------------------------------------------------------------------
# Records, CLI, end to end on the CPU
# ----------------------------------------------------------------------------------------

def test_records_and_speedups():
    shape = S.get_shape("deepseek-v3")
    local = S.ep8_proxy(shape)
    meta = {"gpu": "NVIDIA H200", "gpu_short": "h200", "torch": "2.11.0", "cuda": "13.0",
            "git_commit": "abc", "git_dirty": False, "date": "2026-01-01"}
    peak = 790.0
    recs = [L.make_record(meta, shape, local, 8192, "balanced", b, "fwd", peak, times=t)
            for b, t in (("mok", [8.0, 9.0, 10.0]), ("torch-unfused", [16.0]),
                         ("megatron-alltoall", [24.0]))]
    recs.append(L.make_record(meta, shape, local, 8192, "balanced", "mok", "bwd", peak,
                              error="RuntimeError: boom"))
    L.fill_speedups(recs)
    mok = recs[0]
    flops = 6 * 8192 * (8 * 2048 + 2048) * 7168
    assert mok["ms"] == 9.0 and mok["flops"] == flops and mok["iters"] == 3
    assert mok["tflops"] == pytest.approx(flops / 9e-3 / 1e12)
    assert mok["frac_peak"] == pytest.approx(mok["tflops"] / peak)
    assert mok["time_over_floor"] == pytest.approx(9.0 / (flops / (peak * 1e12) * 1e3))
    assert mok["speedup"] == {"torch-unfused": pytest.approx(16 / 9),
                              "megatron-alltoall": pytest.approx(24 / 9)}
    assert recs[1]["speedup"] == {"megatron-alltoall": pytest.approx(1.5)}
    assert recs[3]["ms"] is None and recs[3]["speedup"] == {} and recs[3]["error"]
    for key in ("shape", "T", "routing", "backend", "pass", "correct", "ms", "tflops",
                "frac_peak", "time_over_floor", "speedup", "git_commit", "torch", "cuda", "gpu"):
        assert key in mok
    assert json.loads(json.dumps(recs))  # serialisable


def test_gpu_short_name():
    assert L.gpu_short_name("NVIDIA H200") == "h200"
    assert L.gpu_short_name("NVIDIA H100 80GB HBM3") == "h100"
    assert L.gpu_short_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert L.gpu_short_name("cpu") == "cpu"


def test_cli_defaults_and_quick():
    a = L.parse_args([])
    assert a.shapes == list(S.SHAPES) and a.tokens == [4096, 8192]
    assert a.routing == ["balanced"] and a.backends == [b for b in L.BACKENDS
                                                        if b not in L.FP8_BACKENDS]
    assert a.passes == ["fwd", "bwd"] and (a.warmup, a.iters) == (20, 50)
    assert a.mok_backend == "auto" and a.check_tokens == "auto"
    q = L.parse_args(["--quick", "--shapes", "qwen3-30b-a3b", "--pass", "fwd"])
    assert q.tokens == [4096] and q.iters < 50 and q.passes == ["fwd"]
    with pytest.raises(SystemExit):
        L.parse_args(["--backends", "nope"])


def test_end_to_end_cpu_in_process(tmp_path):
    """mok (reference backend on the CPU) and torch-unfused through the whole run loop."""
    args = L.parse_args(["--device", "cpu", "--shapes", "tiny", "--tokens", "48",
                         "--routing", "balanced,skewed", "--backends", "mok,torch-unfused",
                         "--warmup", "0", "--iters", "2", "--out", str(tmp_path)])
    path, records = L.run(args)
    doc = json.loads(path.read_text())
    assert doc["complete"] and path.name.endswith("-cpu-layer-ep1.json")
    assert len(doc["records"]) == 2 * 2 * 2
    assert all(r["correct"] and r["ms"] and not r["error"] for r in doc["records"])
    mok = [r for r in doc["records"] if r["backend"] == "mok"]
    assert all("torch-unfused" in r["speedup"] for r in mok)
    assert mok[0]["info"]["mok_backend"] == "reference"


def test_megatron_alltoall_cpu_subprocess(tmp_path):
    """Megatron-Core's alltoall MoE layer (one gloo rank, CPU shims) against the reference,
    in a fresh process: the CPU shims patch torch globally."""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.layer", "--device", "cpu", "--shapes", "tiny",
           "--tokens", "32", "--backends", "megatron-alltoall", "--warmup", "0",
           "--iters", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    records = json.loads(path.read_text())["records"]
    assert len(records) == 2
    for r in records:
        assert r["error"] is None and r["correct"], r
        assert r["info"]["experts_module"] in ("SequentialMLP", "TEGroupedMLP")
        assert r["info"]["dispatcher"] == "MoEAlltoAllTokenDispatcher"


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------

def _synthetic_results(tmp_path: Path) -> Path:
    meta = {"gpu": "NVIDIA H200", "gpu_short": "h200", "torch": "2.11.0+cu130", "cuda": "13.0",
            "git_commit": "0123456789abcdef0123456789abcdef01234567", "git_dirty": False,
            "date": "2026-01-02", "peak_tflops": 788.0}
    recs = []
    for name, t in (("qwen3-30b-a3b", 8192), ("deepseek-v3", 8192)):
        shape = S.get_shape(name)
        local = S.ep8_proxy(shape)
        for which, (m, tu, mg) in (("fwd", (1.0, 3.0, 4.0)), ("bwd", (2.0, 4.0, 8.0))):
            for backend, ms in (("mok", m), ("torch-unfused", tu), ("megatron-alltoall", mg)):
                check = {"fwd_rel_l2": 4e-3, "bwd_rel_l2_max": 5e-3, "finite": True}
                recs.append(L.make_record(meta, shape, local, t, "balanced", backend, which,
                                          788.0, times=[ms], check=check,
                                          info={"mok_backend": "kernel"} if backend == "mok"
                                          else {}))
    L.fill_speedups(recs)
    path = tmp_path / "results" / "2026-01-02-h200-layer-ep1.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"meta": meta, "records": recs}))
    return path


README_TEXT = """# project

## Status

| piece | state |
|---|---|
| a | b |

Performance numbers appear here once the kernel backend lands (measured per
`docs/benchmarks.md`, saved under `benchmarks/results/`).

## Next section

text
"""


def test_report_table_and_readme(tmp_path):
    path = _synthetic_results(tmp_path)
    assert R.latest_results(path.parent) == path
    meta, records = R.load_results(path)
    table = R.markdown_table(meta, records, source="benchmarks/results/x.json")
    rows = [l for l in table.splitlines() if l.startswith("| ") and "---" not in l]
    assert len(rows) == 1 + 4  # header + (2 shapes x fwd/bwd)
    assert rows[1].startswith("| qwen3-30b-a3b | 8192 | balanced | fwd | 1.000 |")
    assert "3.00×" in rows[1] and "4.00×" in rows[1] and rows[1].endswith("| ok |")
    assert rows[2].startswith("| qwen3-30b-a3b | 8192 | balanced | bwd | 2.000 |")
    assert "NVIDIA H200" in table and "`0123456789`" in table and "788" in table

    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    R.update_readme(readme, table)
    text = readme.read_text()
    assert text.count(R.START) == 1 and text.count(R.END) == 1
    status = text.index("## Status")
    para = text.index("Performance numbers appear here")
    assert status < para < text.index(R.START) < text.index(R.END) < text.index("## Next")
    assert "| deepseek-v3 | 8192 | balanced | bwd | 2.000 |" in text
    R.update_readme(readme, table)
    assert readme.read_text() == text  # idempotent
    R.update_readme(readme, "new table")
    new = readme.read_text()
    assert "new table" in new and "deepseek-v3" not in new and "## Next section" in new

    console = R.console_table(records)
    assert len(console.splitlines()) == 2 + 12 and "ok 4.0e-03" in console


def test_report_cli_without_plot(tmp_path):
    path = _synthetic_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    assert R.main([str(path), "--readme", str(readme), "--plots", str(tmp_path / "plots"),
                   "--no-plot"]) == 0
    assert R.START in readme.read_text()


@pytest.mark.parametrize("meta_patch", [{"git_dirty": True}, {"git_dirty": None},
                                        {"git_commit": "c68882c+v5"}])
def test_report_refuses_uncommitted_results_for_the_readme(tmp_path, meta_patch):
    """The README's figures must come from a committed tree: dirty, unknown or hand-made
    commit labels are refused (exit 2, README untouched); --no-readme still reports."""
    path = _synthetic_results(tmp_path)
    doc = json.loads(path.read_text())
    doc["meta"].update(meta_patch)
    path.write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    args = [str(path), "--readme", str(readme), "--plots", str(tmp_path / "plots"), "--no-plot"]
    assert R.main(args) == 2
    assert readme.read_text() == README_TEXT
    assert R.main(args + ["--no-readme"]) == 0


def test_provenance_stamp_detects_changed_files(tmp_path, monkeypatch):
    """benchmarks.provenance: a stamp of blob ids says clean for identical files and dirty,
    naming the file, once one byte changes (what the GPU machine checks)."""
    from benchmarks import provenance as P
    (tmp_path / "a.py").write_text("x = 1\n")
    stamp = {"commit": "f" * 40, "blobs": {"a.py": P.blob_id(tmp_path / "a.py")}}
    assert stamp["blobs"]["a.py"] == "7d4290a117a4ddcc11daae7ea675841033830c8f"  # git hash-object
    (tmp_path / ".mok_source.json").write_text(json.dumps(stamp))
    monkeypatch.setattr(P, "REPO", tmp_path)
    monkeypatch.setattr(P, "STAMP", tmp_path / ".mok_source.json")
    assert P.source_state() == ("f" * 40, False, [])
    (tmp_path / "a.py").write_text("x = 2\n")
    assert P.source_state() == ("f" * 40, True, ["a.py"])
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "new.py").write_text("y = 1\n")  # travelled, not stamped
    assert P.source_state() == ("f" * 40, True, ["benchmarks/new.py"])


def test_report_marks_failures():
    shape = S.get_shape("tiny")
    local = S.ep8_proxy(shape)
    bad = L.make_record({}, shape, local, 64, "balanced", "mok", "fwd", 1.0, times=[1.0],
                        check={"fwd_rel_l2": 0.5, "finite": True})
    ok = L.make_record({}, shape, local, 64, "balanced", "torch-unfused", "fwd", 1.0,
                       times=[2.0], check={"fwd_rel_l2": 1e-3, "finite": True})
    L.fill_speedups([bad, ok])
    table = R.markdown_table({}, [bad, ok])
    assert "FAIL mok" in table and "2.00×" in table


def test_report_merges_runs(tmp_path):
    first = _synthetic_results(tmp_path)
    doc = json.loads(first.read_text())
    doc["meta"]["peak_tflops"] = 780.0
    doc["records"] = [r for r in doc["records"] if r["shape"] == "deepseek-v3"]
    for r in doc["records"]:
        r["ms"] = r["ms"] * 2
    second = tmp_path / "results" / "2026-01-02-h200-layer-ep1-2.json"
    second.write_text(json.dumps(doc))
    meta, records = R.merge_results([first, second])
    assert len(records) == 12 and meta["peak_tflops_range"] == [780.0, 788.0]
    mok = {(r["shape"], r["pass"]): r["ms"] for r in records if r["backend"] == "mok"}
    assert mok[("qwen3-30b-a3b", "fwd")] == 1.0 and mok[("deepseek-v3", "fwd")] == 2.0
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    assert R.main([str(first), str(second), "--readme", str(readme), "--no-plot"]) == 0
    assert "780–788 TFLOP/s" in readme.read_text()


def _layer_ep_ranks(rank, world_size, out_dir):
    import torch.distributed as dist
    from benchmarks import layer_ep
    args = layer_ep.parse_args(["--device", "cpu", "--shapes", "tiny", "--tokens", "32",
                                "--routing", "balanced,skewed", "--warmup", "0", "--iters", "2",
                                "--out", out_dir])
    records = layer_ep.run(args, dist.group.WORLD, torch.device("cpu"))
    assert len(records) == 2 * 5 * 2  # routings x backends x passes
    try:
        import deep_ep  # noqa: F401
        have_deep_ep = True
    except Exception:
        have_deep_ep = False
    flex = [r for r in records if r["backend"].startswith("megatron-flex")]
    if not have_deep_ep:  # recorded as skipped, with the reason, not silently dropped
        assert len(flex) == 8 and all(r["error"].startswith("skipped: deep_ep") for r in flex)
    for r in records:
        if r in flex and not have_deep_ep:
            continue
        assert r["correct"], r
        assert r["ep"] == world_size and r["E_loc"] == r["E"] // world_size
        assert r["ms"] > 0 and r["nvlink_bytes_per_gpu"] > 0


def test_layer_ep_harness_on_two_gloo_ranks(tmp_path):
    """benchmarks.layer_ep at EP=2 on CPU: mok (reference backend), the all-to-all
    baseline and Megatron's alltoall MoELayer at EP=2 agree with the EP reference, and
    rank 0 writes the results file."""
    import json
    from dist_utils import run_distributed
    run_distributed(_layer_ep_ranks, 2, str(tmp_path))
    files = list(tmp_path.glob("*-layer-ep2.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["meta"]["ep"] == 2 and len(data["records"]) == 20
    mok = [r for r in data["records"] if r["backend"] == "mok"]
    assert len(mok) == 4
    # benchmarks.report puts the EP table under its own markers, after the EP=1 table's.
    from benchmarks import report
    data["meta"].update(git_commit="ab" * 20, git_dirty=False)  # as from a committed tree
    files[0].write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Status\n\nPerformance numbers appear here.\n\n"
                      f"{report.START}\nold EP=1 table\n{report.END}\n\n## Next\n")
    assert report.main([str(files[0]), "--readme", str(readme), "--no-plot"]) == 0
    text = readme.read_text()
    assert "old EP=1 table" in text
    assert text.index(report.END) < text.index(report.EP_START) < text.index("## Next")
    ep_table = text[text.index(report.EP_START):text.index(report.EP_END)]
    assert "EP=2 layer" in ep_table and "× torch-a2a" in ep_table
    assert "× megatron-alltoall" in ep_table and "NVLink GB/s" in ep_table
    try:
        import deep_ep  # noqa: F401
    except Exception:  # skipped backends get no column
        assert "megatron-flex" not in ep_table
    assert all({"torch-a2a", "megatron-alltoall"} <= set(r["speedup"]) for r in mok)


@pytest.mark.parametrize("shape_name", ["tiny", "tiny-noshared"])
def test_torch_fp8_baseline_is_the_layer_in_row_wise_fp8(shape_name):
    """torch-fp8 (dequantised products on the CPU): the BF16 layer within the FP8 bound, and
    visibly quantised (not the BF16 layer under another name)."""
    local = S.ep8_proxy(S.get_shape(shape_name))
    weights = L.make_weights(local, "cpu", seed=0)
    case = L.make_case(local, 96, "skewed", "cpu", seed=0)
    ref = L.reference_outputs(case, weights, want_grads=True)
    backend = L.make_backend("torch-fp8", local, weights, "cpu", L.parse_args([]))
    assert backend.name == "torch-fp8"
    result = L.check_backend(backend, case, ref)
    assert 1e-3 < result["fwd_rel_l2"] < L.FP8_CHECK_TOL
    assert result["bwd_rel_l2_max"] < L.FP8_CHECK_TOL, result["bwd_rel_l2"]
    assert set(result["bwd_rel_l2"]) >= {"dx", "d_topk_w", "dw1", "dw2"}


def test_row_wise_quantiser_scales_each_row_to_the_e4m3_range():
    from benchmarks.torch_fp8 import E4M3_MAX, quantize_rowwise
    t = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3
    t[2] = 0  # an all-zero row stays zero
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5,)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3, 4]], torch.full((4,), E4M3_MAX))
    assert torch.all(q[2].float() == 0)
    assert L.rel_l2(q.float() * scale[:, None], t) < 0.05


def test_breakdown_categories_name_our_kernels_and_torch_gemms():
    from benchmarks import breakdown
    assert breakdown.category("void megatron_mok::moe_forward_kernel<...>") == "megakernel"
    assert breakdown.category("void megatron_mok::megakernel::moe_backward_kernel<>") == \
        "megakernel"
    assert breakdown.category("void megatron_mok::gemm::grouped_gemm_kernel<Cfg>") == \
        "expert gemm (core)"
    assert breakdown.category("pull_rows_kernel") == "row moves"
    assert breakdown.category("void combine_kernel<RoutedRows>") == "combine"
    assert breakdown.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") \
        == "torch gemm"
    assert breakdown.category("void at::native::index_put_kernel") == "schedule / index"
    assert breakdown.category("void at::native::vectorized_elementwise_kernel") == "other"
    assert breakdown.category("void megatron_mok::gemm::grouped_fp8_kernel<Cfg>") == \
        "fp8 gemm (core)"
    assert breakdown.category("megatron_mok::quantize_fp8_rows_kernel(...)") == "fp8 quantise"


@pytest.mark.parametrize("layout", ["te", "sequential"])
def test_main_grad_benchmark_lays_buffers_out_as_megatron(layout):
    """benchmarks.main_grad's buffers tile the grad buffer exactly once, backwards, and one
    fused wgrad launch can reach each weight's."""
    from benchmarks import main_grad as MG
    flat, acc1, acc2 = MG.main_grads(layout, 4, torch.Size((48, 32)), torch.Size((32, 24)),
                                     torch.device("cpu"))
    for acc in (acc1, acc2):
        assert acc.fused_target is not None and acc.fused_target[1]  # backwards
        for buf in acc.buffers:
            buf.add_(1)
    assert torch.equal(flat, torch.ones_like(flat))


def test_sustained_sampler_summarises_the_settled_half():
    from benchmarks import sustained
    sampler = sustained.Sampler.__new__(sustained.Sampler)  # no nvidia-smi on CPU
    sampler.segments, sampler.current = {}, None
    sampler.mark("dense")
    sampler.segments["dense"] += [(1980.0, 300.0), (1900.0, 500.0), (1440.0, 690.0),
                                  (1430.0, 695.0), (1450.0, 700.0), (1440.0, 690.0)]
    sampler.mark(None)
    s = sampler.summary("dense")
    assert s == {"sm_mhz": 1440.0, "power_w": 695.0, "samples": 3}  # the last three
    assert sampler.summary("missing") == {"sm_mhz": None, "power_w": None, "samples": 0}


def test_megatron_te_baseline_needs_te_and_alltoall_stays_local(tmp_path):
    """megatron-te (alltoall + TEGroupedMLP + fused permute) never falls back to the local
    spec: without Transformer Engine it is recorded as unavailable, saying so, while
    megatron-alltoall runs Megatron's local SequentialMLP and passes its check."""
    if L.te_available():
        pytest.skip("Transformer Engine is installed here")
    args = L.parse_args(["--device", "cpu", "--quick", "--shapes", "tiny", "--tokens", "64",
                         "--backends", "megatron-te,megatron-te-fp8,megatron-alltoall",
                         "--pass", "fwd", "--out", str(tmp_path)])
    _, records = L.run(args)
    by_backend = {r["backend"]: r for r in records}
    assert "needs Transformer Engine" in by_backend["megatron-te"]["error"]
    assert "needs Transformer Engine" in by_backend["megatron-te-fp8"]["error"]
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        L.MegatronBackend(None, None, "cpu", fp8=True)  # FP8 without TE: refused at once
    local = by_backend["megatron-alltoall"]
    assert local["correct"] and local["info"]["experts_module"] == "SequentialMLP"
