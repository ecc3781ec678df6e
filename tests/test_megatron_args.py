"""The `--mok-*` command-line surface: upstream Megatron-LM's names accepted, knobs the
Hopper backend does not use warn instead of passing silently, and every flag the README
and docs name exists."""

import argparse
import re
import warnings
from pathlib import Path

import pytest

from megatron_mok.config import MoKConfig
from megatron_mok.megatron.args import add_mok_args, mok_config_from_args

REPO = Path(__file__).resolve().parents[1]


def _parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-token-dispatcher-type", default="alltoall")  # Megatron's own
    return add_mok_args(parser)


def test_moe_megakernel_backend_selects_the_mok_dispatcher():
    args = _parser().parse_args(["--moe-megakernel-backend", "mok"])
    assert args.moe_token_dispatcher_type == "mok"
    assert _parser().parse_args([]).moe_token_dispatcher_type == "alltoall"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--moe-megakernel-backend", "deepep"])


@pytest.mark.parametrize("flag, value", [("--mok-bwd-num-comm-sms", "8"),
                                         ("--mok-bwd-comm-sms", "8"),
                                         ("--mok-macrobatch-size", "8192")])
def test_knobs_unused_on_hopper_warn(flag, value):
    with pytest.warns(UserWarning, match="has no effect"):
        mok_config_from_args(_parser().parse_args([flag, value]))


def test_defaults_and_used_knobs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = mok_config_from_args(_parser().parse_args(
            ["--mok-fwd-num-comm-sms", "8", "--mok-minibatch-size", "2048"]))
    assert (config.fwd_num_comm_sms, config.minibatch_size) == (8, 2048)
    assert config == MoKConfig(fwd_num_comm_sms=8, minibatch_size=2048)


def test_every_documented_flag_exists():
    parser = _parser()
    options = {s for a in parser._actions for s in a.option_strings}
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = set()
    for doc in docs:
        text = doc.read_text()
        if doc.name == "perf-notes.md":  # the measurement diary names flags of its time
            continue
        named |= set(re.findall(r"--(?:mok-[a-z0-9-]+|moe-megakernel-backend)", text))
    assert named, "the docs name no --mok-* flag"
    missing = sorted(f for f in named if f not in options)
    assert not missing, f"documented but not accepted: {missing}"
