"""benchmarks.train_report: parses the launcher's step lines and compares the runs."""

from pathlib import Path

import pytest

from benchmarks import train_report


def _log(path: Path, losses, ms=100.0, tps=1000.0):
    lines = ["some Megatron output", "[megatron_mok] banner"]
    lines += [f"[megatron_mok] step {i + 1}/{len(losses)} | lm loss {loss:.6f} | {ms:.1f} ms | "
              f"{tps + i:.0f} tokens/s" for i, loss in enumerate(losses)]
    path.write_text("\n".join(lines) + "\n")


def test_summary_of_mok_alltoall_and_repeat(tmp_path):
    mok = [6.9, 6.5, 6.1, 5.8, 5.5, 5.2, 5.0]
    _log(tmp_path / "train_tiny_mok.log", mok, tps=2000)
    _log(tmp_path / "train_tiny_mok2.log", mok, tps=2000)
    _log(tmp_path / "train_tiny_alltoall.log", [x + 0.01 for x in mok], tps=1000)
    _log(tmp_path / "train_big_mok.log", [3.0, 2.0])
    _log(tmp_path / "train_big_mok2.log", [3.0, 2.5])
    assert train_report.main([str(p) for p in sorted(tmp_path.glob("*.log"))]
                             + ["--out", str(tmp_path)]) == 0
    summary = train_report.summarise({
        "tiny": {k: train_report.parse(tmp_path / f"train_tiny_{k}.log")
                 for k in ("mok", "mok2", "alltoall")},
        "big": {k: train_report.parse(tmp_path / f"train_big_{k}.log") for k in ("mok", "mok2")},
    })
    tiny = summary["tiny"]
    assert tiny["steps"] == 7 and tiny["mok_runs_identical"]
    assert abs(tiny["max_abs_loss_diff_vs_alltoall"] - 0.01) < 1e-9
    assert tiny["tokens_per_s"] == {"mok": 2005.5, "alltoall": 1005.5}  # median after step 5
    assert abs(tiny["speedup"] - 2005.5 / 1005.5) < 1e-9
    assert summary["big"]["mok_runs_identical"] is False
    assert list(tmp_path.glob("*-train-ep1.json"))


def test_ep_runs_report_tokens_per_gpu(tmp_path):
    losses = [7.0, 6.0, 5.0, 4.5, 4.0, 3.8, 3.6]
    _log(tmp_path / "train_qwen3-ep8_mok.log", losses, tps=80000)
    _log(tmp_path / "train_qwen3-ep8_alltoall.log", losses, tps=40000)
    assert train_report.main([str(p) for p in sorted(tmp_path.glob("*.log"))]
                             + ["--out", str(tmp_path)]) == 0
    summary = train_report.summarise({"qwen3-ep8": {
        k: train_report.parse(tmp_path / f"train_qwen3-ep8_{k}.log") for k in ("mok", "alltoall")}})
    entry = summary["qwen3-ep8"]
    assert entry["gpus"] == 8
    assert entry["tokens_per_s_per_gpu"] == {"mok": 80005.5 / 8, "alltoall": 40005.5 / 8}
    assert list(tmp_path.glob("*-train-ep8.json"))


def test_fused_main_grad_run_is_compared_with_mok(tmp_path):
    mok = [6.9, 6.5, 6.1, 5.8, 5.5, 5.2, 5.0]
    _log(tmp_path / "train_tiny_mok.log", mok, tps=2000)
    _log(tmp_path / "train_tiny_mokfused.log", [x + 0.002 for x in mok], tps=2100)
    logs = sorted(str(p) for p in tmp_path.glob("*.log"))
    assert train_report.main(logs + ["--out", str(tmp_path)]) == 0
    runs = {"tiny": {k: train_report.parse(tmp_path / f"train_tiny_{k}.log")
                     for k in ("mok", "mokfused")}}
    tiny = train_report.summarise(runs)["tiny"]
    assert abs(tiny["max_abs_loss_diff_fused_vs_mok"] - 0.002) < 1e-9
    assert tiny["tokens_per_s_fused"] == 2105.5


def test_result_file_names_the_gpu_and_the_tree(tmp_path, monkeypatch):
    import json
    _log(tmp_path / "train_tiny_mok.log", [6.9, 6.5, 6.1], tps=2000)
    monkeypatch.setenv("MOK_GPU_NAME", "NVIDIA H100 80GB HBM3")
    monkeypatch.delenv("MOK_SOURCE_COMMIT", raising=False)
    assert train_report.main([str(tmp_path / "train_tiny_mok.log"), "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-h100-train-ep1.json")
    data = json.loads(path.read_text())
    assert data["source_commit"] and len(data["source_commit"]) == 40
    assert data["git_dirty"] in (True, False)


def test_fp8_runs_are_compared_with_the_bf16_run(tmp_path):
    mok = [6.9, 6.5, 6.1, 5.8, 5.5, 5.2, 5.0]
    fp8 = [x * 1.004 for x in mok]
    _log(tmp_path / "train_tiny_mok.log", mok, tps=2000)
    _log(tmp_path / "train_tiny_mokfp8.log", fp8, tps=2600)
    _log(tmp_path / "train_tiny_mokfp82.log", fp8, tps=2600)
    logs = sorted(str(p) for p in tmp_path.glob("*.log"))
    assert train_report.main(logs + ["--out", str(tmp_path)]) == 0
    runs = {"tiny": {k: train_report.parse(tmp_path / f"train_tiny_{k}.log")
                     for k in ("mok", "mokfp8", "mokfp82")}}
    entry = train_report.summarise(runs)["tiny"]["fp8"]
    assert entry["steps"] == 7 and entry["runs_identical"] is True
    assert abs(entry["final_loss_rel_diff"] - 0.004) < 1e-5
    assert abs(entry["last10_mean_rel_diff"] - 0.004) < 1e-5
    assert entry["tokens_per_s"] == {"bf16": 2005.5, "fp8": 2605.5}


def test_gpu_step_lines_give_tflops_mfu_and_peak_memory(tmp_path):
    def log(path, tflops, peaks):
        lines = [f"[megatron_mok] step {i + 1}/7 | lm loss {5.0 - 0.1 * i:.6f} | 100.0 ms | "
                 f"1000 tokens/s | {tflops + i:.1f} TFLOP/s/GPU | peak {peak:.2f} GiB"
                 for i, peak in enumerate(peaks)]
        path.write_text("\n".join(lines) + "\n")

    log(tmp_path / "train_q_mok.log", 300.0, [10.0, 12.5, 12.0, 12.0, 12.0, 12.0, 12.0])
    log(tmp_path / "train_q_alltoall.log", 200.0, [20.0] * 7)
    runs = {"q": {k: train_report.parse(tmp_path / f"train_q_{k}.log") for k in ("mok", "alltoall")}}
    entry = train_report.summarise(runs, peak_tflops=800.0)["q"]
    assert entry["tflops_per_gpu"] == {"mok": 305.5, "alltoall": 205.5}  # median after step 5
    assert entry["mfu"] == {"mok": 305.5 / 800.0, "alltoall": 205.5 / 800.0}
    assert entry["peak_mem_gib"] == {"mok": 12.5, "alltoall": 20.0}
    assert "mfu" not in train_report.summarise(runs)["q"]  # no peak given: no MFU


def test_megatron_fp8_runs_are_compared_as_a_pair(tmp_path):
    losses = [6.9, 6.5, 6.1, 5.8, 5.5, 5.2, 5.0]
    _log(tmp_path / "train_q-te_mokmfp8.log", losses, tps=3000)
    _log(tmp_path / "train_q-te_alltoallfp8.log", [x + 0.01 for x in losses], tps=2000)
    assert train_report.main([str(p) for p in sorted(tmp_path.glob("*.log"))]
                             + ["--out", str(tmp_path)]) == 0
    runs = {"q-te": {k: train_report.parse(tmp_path / f"train_q-te_{k}.log")
                     for k in ("mokmfp8", "alltoallfp8")}}
    pair = train_report.summarise(runs)["q-te"]["megatron_fp8"]
    assert pair["steps"] == 7 and pair["tokens_per_s"] == {"mok": 3005.5, "alltoall": 2005.5}
    assert abs(pair["speedup"] - 3005.5 / 2005.5) < 1e-9
    assert abs(pair["final_loss"]["alltoall"] - 5.01) < 1e-9


def test_loss_curves_plot_as_svg(tmp_path):
    import xml.etree.ElementTree as ET
    from benchmarks import plot_train
    _log(tmp_path / "train_q_mok.log", [6.9, 6.5, 6.1, 5.8, 5.5, 5.2, 5.0])
    _log(tmp_path / "train_q_mokfp8.log", [6.9, 6.6, 6.1, 5.9, 5.5, 5.3, 5.1])
    assert train_report.main([str(p) for p in sorted(tmp_path.glob("*.log"))]
                             + ["--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("*-train-ep1.json")
    svg = tmp_path / "curves.svg"
    assert plot_train.main([str(result), "--out", str(svg), "--smooth", "3"]) == 0
    root = ET.fromstring(svg.read_text())  # well-formed
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert [e.find("{http://www.w3.org/2000/svg}title").text for e in lines] == ["mok", "mokfp8"]
    assert all(len(e.get("points").split()) == 7 for e in lines)
    assert plot_train.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot_train.nice_ticks(0.0, 1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
