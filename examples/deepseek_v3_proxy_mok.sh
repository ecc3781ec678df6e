#!/usr/bin/env bash
# DeepSeek-V3 proxy (GQA attention, 1 dense + 1 MoE layer), EP8 on one 8-GPU node,
# with the megatron_mok fused MoE layer (--moe-token-dispatcher-type mok).
# Twin: examples/deepseek_v3_proxy_alltoall.sh (same configs/deepseek_v3_proxy.args, other dispatcher).
#
#   examples/deepseek_v3_proxy_mok.sh [extra Megatron / --mok-* flags...]
#
# Runs from any directory (relative paths in extra flags stay relative to yours). NPROC
# (default 8) and the rest of examples/train.sh's environment pass through.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export NPROC=${NPROC:-8}
exec bash "$repo/examples/train.sh" "$repo/configs/deepseek_v3_proxy.args" mok "$@"
