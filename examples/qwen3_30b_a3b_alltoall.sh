#!/usr/bin/env bash
# Qwen3-30B-A3B (16 of 48 layers), EP8 on one 8-GPU node,
# with Megatron's all-to-all token dispatcher (the baseline).
# Twin: examples/qwen3_30b_a3b_mok.sh (same configs/qwen3_30b_a3b.args, other dispatcher).
#
#   examples/qwen3_30b_a3b_alltoall.sh [extra Megatron / --mok-* flags...]
#
# Runs from any directory (relative paths in extra flags stay relative to yours). NPROC
# (default 8) and the rest of examples/train.sh's environment pass through.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export NPROC=${NPROC:-8}
exec bash "$repo/examples/train.sh" "$repo/configs/qwen3_30b_a3b.args" alltoall "$@"
