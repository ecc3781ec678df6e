#!/usr/bin/env bash
# GPT-OSS-120B as published (clamped GLU, biases, sinks, sliding windows, YaRN; 4 of 36
# layers), EP8 on one 8-GPU node,
# with the megatron_mok fused MoE layer (--moe-token-dispatcher-type mok).
# Twin: examples/gpt_oss_120b_alltoall.sh (same configs/gpt_oss_120b.args, other dispatcher).
#
#   examples/gpt_oss_120b_mok.sh [extra Megatron / --mok-* flags...]
#
# Runs from any directory (relative paths in extra flags stay relative to yours). NPROC
# (default 8) and the rest of examples/train.sh's environment pass through.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export NPROC=${NPROC:-8}
exec bash "$repo/examples/train.sh" "$repo/configs/gpt_oss_120b.args" mok "$@"
