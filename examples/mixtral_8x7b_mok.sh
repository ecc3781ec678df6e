#!/usr/bin/env bash
# Mixtral-8x7B (8 of 32 layers), EP8 on one 8-GPU node,
# with the megatron_mok fused MoE layer (--moe-token-dispatcher-type mok).
# Twin: examples/mixtral_8x7b_alltoall.sh (same configs/mixtral_8x7b.args, other dispatcher).
#
#   examples/mixtral_8x7b_mok.sh [extra Megatron / --mok-* flags...]
#
# Runs from any directory (relative paths in extra flags stay relative to yours). NPROC
# (default 8) and the rest of examples/train.sh's environment pass through.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export NPROC=${NPROC:-8}
exec bash "$repo/examples/train.sh" "$repo/configs/mixtral_8x7b.args" mok "$@"
