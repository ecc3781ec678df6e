#!/usr/bin/env bash
# The FP8 kernels on a GPU machine with the extension built: their GPU tests, the FP8 GEMM
# benchmark (FP8 vs the BF16 core, dense peaks) and the layer benchmark's mok vs mok-fp8,
# results and logs under ${OUT:-gpu_out}/. Each part has its own time limit (seconds):
#   TESTS_TIMEOUT=110 GEMM_TIMEOUT=60 LAYER_TIMEOUT=90 LAYER_SHAPES=qwen3-30b-a3b
#   GEMM_SHAPES=qwen3-30b-a3b,deepseek-v3 CLUSTER2=0 (1: also the FP8 GEMMs on CTA pairs)
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_TESTS=1 DEMO=0 BENCH=0 TESTS_TIMEOUT="${TESTS_TIMEOUT:-110}" bash scripts/gpu_check.sh fp8 \
  > "${OUT:-gpu_out}/check_fp8.log" 2>&1
source scripts/gpu_env.sh
tail -14 "$OUT/check_fp8.log"
timeout "${GEMM_TIMEOUT:-60}" $PY -m benchmarks.fp8_gemm --shapes "${GEMM_SHAPES:-qwen3-30b-a3b,deepseek-v3}" \
  --iters 15 --out "$OUT" 2>&1 | tee "$OUT/fp8_gemm.log" | tail -4
if [ "${CLUSTER2:-0}" = 1 ]; then
  timeout "${GEMM_TIMEOUT:-60}" $PY -m benchmarks.fp8_gemm --shapes "${GEMM_SHAPES:-qwen3-30b-a3b}" \
    --iters 15 --cluster 2 --out "$OUT" 2>&1 | tee "$OUT/fp8_gemm_cluster2.log" | tail -3
fi
timeout "${LAYER_TIMEOUT:-90}" $PY -m benchmarks.layer --shapes "${LAYER_SHAPES:-qwen3-30b-a3b}" \
  --tokens 8192 --backends mok,mok-fp8,mok-fp8-reuse --iters 15 --warmup 5 --out "$OUT" 2>&1 \
  | tr '\r' '\n' | grep -v '%|' > "$OUT/layer.log"
tail -8 "$OUT/layer.log"
