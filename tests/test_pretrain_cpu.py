"""megatron_mok.pretrain_gpt end to end on the CPU: megatron-core's own training loop, gloo.

Runs examples/train.sh with configs/tiny_gpt_moe.args for a few steps as a subprocess
(CUDA hidden, so this is the CPU path on any machine) and checks the per-step lines:
finite losses that go down. EP=2 runs two processes under torchrun and must follow the
EP=1 loss curve closely (same data, same model, only the experts are split). About a
minute on 2 cores while `megatron_mok.megatron.spec` (the mok layer spec) is absent.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_gpt_moe.args"
TRAIN_SH = REPO / "examples" / "train.sh"
ITERS = 10
STEP_RE = re.compile(
    r"^\[megatron_mok\] step (\d+)/(\d+) \| lm loss (\S+) \| ([\d.]+) ms \| ([\d.]+) tokens/s$",
    re.MULTILINE)

_RUNS: dict = {}


def _train(dispatcher: str, ep: int, extra: tuple = (), config=CONFIG,
           want_log: str = "") -> list[float]:
    """Losses of an ITERS-step run (cached per (dispatcher, ep, extra flags, config) for
    the session); want_log: a line the run's output must hold."""
    key = (dispatcher, ep, extra, str(config))
    if key in _RUNS:
        return _RUNS[key]
    env = dict(os.environ)
    env.update(
        TORCH_COMPILE_DISABLE="1",
        CUDA_VISIBLE_DEVICES="",  # the CPU path, even on a GPU machine
        PYTHON=sys.executable,
        NPROC=str(ep),
    )
    cmd = ["bash", str(TRAIN_SH), str(config), dispatcher,
           "--train-iters", str(ITERS), "--expert-model-parallel-size", str(ep), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    steps = STEP_RE.findall(out)
    assert [int(s[0]) for s in steps] == list(range(1, ITERS + 1)), out[-6000:]
    assert all(int(s[1]) == ITERS for s in steps)
    assert all(float(s[4]) > 0 for s in steps), "tokens/s must be positive"
    assert want_log in out, f"no {want_log!r} in the run's output:\n{out[-6000:]}"
    losses = [float(s[2]) for s in steps]
    _RUNS[key] = losses
    return losses


def _assert_trains(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0] - 0.5, f"loss did not go down: {losses}"
    decreasing = sum(b < a for a, b in zip(losses, losses[1:]))
    assert decreasing >= 0.7 * (len(losses) - 1), f"loss is not mostly decreasing: {losses}"


def test_default_flags_only_fill_gaps():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from megatron_mok.pretrain_gpt import _default_flags

    added = _default_flags(["--num-layers", "2"], on_cpu=True)
    for flag in ("--distributed-backend", "--eval-interval", "--no-persist-layer-norm",
                 "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"):
        assert added.count(flag) == 1, (flag, added)
    user = ["--eval-interval", "5", "--distributed-backend=gloo", "--no-persist-layer-norm"]
    kept = _default_flags(user, on_cpu=True)
    assert kept.count("--eval-interval") == 1 and "5" in kept
    assert not any(a == "--distributed-backend" for a in kept)
    assert kept.count("--no-persist-layer-norm") == 1


def test_alltoall_ep1_trains():
    _assert_trains(_train("alltoall", 1))


def test_alltoall_ep2_trains_like_ep1():
    ep2 = _train("alltoall", 2)
    _assert_trains(ep2)
    ep1 = _train("alltoall", 1)
    worst = max(abs(a - b) for a, b in zip(ep1, ep2))
    assert worst < 0.1, f"EP=2 diverges from EP=1 by {worst}:\n{ep1}\n{ep2}"


@pytest.mark.parametrize("ep", [1, 2])
def test_mok_trains(ep):
    losses = _train("mok", ep)
    _assert_trains(losses)
    # Same data and model; only the expert weights' layout/init may differ from Megatron's.
    ref = _train("alltoall", ep)
    worst = max(abs(a - b) for a, b in zip(ref, losses))
    assert worst < 0.25, f"mok diverges from alltoall (EP={ep}) by {worst}:\n{ref}\n{losses}"


@pytest.mark.parametrize("ep", [1, 2])
def test_mok_fp8_follows_the_unquantised_run(ep):
    """--mok-fp8 blockwise (the experts' GEMMs through the blockwise FP8 spec; fp32 here, the
    CPU's precision) trains the tiny model along the unquantised curve: within 1 % at every
    step, and not identical to it (the quantisation is applied); at EP 1 and 2."""
    fp8 = _train("mok", ep, ("--mok-fp8", "blockwise"),
                 want_log="runs the reference backend on cpu (experts in blockwise FP8)")
    _assert_trains(fp8)
    plain = _train("mok", ep)
    worst = max(abs(a - b) / b for a, b in zip(plain, fp8))
    assert 1e-6 < worst < 0.01, f"FP8 vs unquantised, worst relative gap {worst}:\n{plain}\n{fp8}"


def test_mok_adds_expert_grads_into_megatron_main_grad():
    """--mok-main-grad-fusion on under Megatron's own DDP (two micro-batches per step): the
    layer adds the expert weight gradients into main_grad itself and DDP's hook skips them;
    the run must follow the unfused one (fp32 here: the same sums)."""
    fused = _train("mok", 1, ("--mok-main-grad-fusion", "on"))
    _assert_trains(fused)
    plain = _train("mok", 1)
    worst = max(abs(a - b) for a, b in zip(plain, fused))
    assert worst < 1e-4, f"fused main_grad diverges by {worst}:\n{plain}\n{fused}"


# configs/gpt_oss_120b.args at CPU size: its GPT-OSS features (clamped quick-GeLU GLU with
# the linear offset, biases on every linear, attention sinks, sliding-window layers, YaRN)
# all kept; only the widths shrink, and the GPU-only / bf16 flags go.
GPT_OSS_SHRINK = (
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", "64", "--window-size", "16,0", "--num-experts", "8",
    "--moe-ffn-hidden-size", "32", "--vocab-size", "512", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--num-workers", "0", "--lr-warmup-iters", "0",
    "--lr", "1e-3", "--log-interval", "1", "--manual-gc-interval", "0")


def test_gpt_oss_120b_config_trains_as_alltoall(tmp_path):
    """EP = 2 (Megatron's own SequentialMLP with biases cannot run a backward at EP = 1,
    TP = 1: tests/test_megatron_rounding.py says why): mok (the reference backend runs the
    clamped GLU and the biases) follows the alltoall twin to fp32 rounding, step by step."""
    text = (REPO / "configs" / "gpt_oss_120b.args").read_text()
    flags = " ".join(line.split("#")[0] for line in text.splitlines())
    for flag in ("--quick-geglu", "--activation-func-clamp-value 7.0", "--glu-linear-offset 1.0",
                 "--softmax-type learnable", "--window-attn-skip-freq 2",
                 "--position-embedding-type yarn"):
        assert flag in flags, flag
    assert "--disable-bias-linear" not in flags and "--swiglu" not in flags
    config = tmp_path / "gpt_oss_120b_cpu.args"
    config.write_text(text.replace("--moe-grouped-gemm", "").replace("--bf16", "")
                      .replace("--use-distributed-optimizer", ""))
    mok = _train("mok", 2, GPT_OSS_SHRINK, config,
                 want_log="MoE layer 1 runs the reference backend")
    ref = _train("alltoall", 2, GPT_OSS_SHRINK, config)
    assert all(math.isfinite(x) for x in mok) and mok[-1] < mok[0], mok
    worst = max(abs(a - b) for a, b in zip(ref, mok))
    assert worst < 1e-4, f"mok diverges from alltoall by {worst}:\n{ref}\n{mok}"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.args")
                                          if p.name != "te.args"
                                          and "--transformer-impl local" in p.read_text()))
def test_impl_te_swaps_the_local_spec_flags_for_transformer_engine(config):
    """IMPL=te examples/train.sh: the config's local-spec switches (which later flags
    cannot undo) give way to configs/te.args; everything else, and the extra flags, stay."""
    def command(impl):
        env = {**os.environ, "DRY_RUN": "1", "IMPL": impl}
        out = subprocess.run(["bash", str(TRAIN_SH), str(REPO / "configs" / config), "mok",
                              "--train-iters", "3"], env=env, capture_output=True, text=True,
                             check=True).stdout
        return out.split()

    local, te = command("local"), command("te")
    assert local[local.index("--transformer-impl") + 1] == "local"
    assert te[te.index("--transformer-impl") + 1] == "transformer_engine"
    assert te.count("--transformer-impl") == 1 and "--moe-permute-fusion" in te
    dropped = {"--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
               "--recompute-granularity", "--recompute-modules"}
    assert dropped <= set(local) and not dropped & set(te)
    # Kept under TE as well (te.args): the output layer's fusion would need Apex.
    no_fusion = "--no-gradient-accumulation-fusion"
    assert local.count(no_fusion) == 1 and te.count(no_fusion) == 1
    local_only = dropped | {no_fusion, "--transformer-impl", "local", "selective", "core_attn"}
    assert [w for w in local if w not in local_only] == \
        [w for w in te if w not in {"--transformer-impl", "transformer_engine",
                                    "--moe-permute-fusion", no_fusion}]
    assert te[-4:] == ["--moe-token-dispatcher-type", "mok", "--train-iters", "3"]
