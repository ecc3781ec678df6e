#!/usr/bin/env bash
# The FP8 kernels on a GPU machine with the extension built: their GPU tests (the layer
# tests with their printed errors), the FP8 GEMM benchmark (FP8 vs the BF16 core, dense
# peaks; serial and overlapped promotion), a kernel-time breakdown of the FP8 layer and the
# layer benchmark's mok vs mok-fp8 / mok-fp8-reuse / torch-fp8. Everything lands in one archive,
# ${OUT:-gpu_out}/fp8_check.tgz (the device tool returns a few files only), with a summary
# on stdout. Each part has its own time limit (seconds):
#   TESTS_TIMEOUT=120 GEMM_TIMEOUT=60 BREAKDOWN_TIMEOUT=90 LAYER_TIMEOUT=150
#   LAYER_SHAPES=qwen3-30b-a3b GEMM_SHAPES=qwen3-30b-a3b,deepseek-v3 CLUSTER2=0
#   OVERLAP=1 (also the GEMMs with MOK_FP8_PROMOTION=overlap) BREAKDOWN=1
#   LAYER_PROMOTION=serial (MOK_FP8_PROMOTION of the layer benchmark)
#   GATHER_TESTS=1 (the weight-gradient gathering GPU tests, MOK_WGRAD_GATHER's)
#   LAYER_GATHER="0 1" (one layer benchmark per MOK_WGRAD_GATHER value)
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL_OUT=${OUT:-gpu_out}
export OUT=/tmp/fp8_check_out
rm -rf "$OUT" && mkdir -p "$OUT" "$FINAL_OUT"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "from benchmarks.provenance import source_state as s; c, d, f = s(); print('tree', c, 'dirty' if d else 'clean')" | tee -a "$OUT/gpu.txt"
timeout -s INT -k 20 "${TESTS_TIMEOUT:-120}" $PY -m pytest -q -rfE -m gpu \
  tests/test_fp8_kernels.py tests/test_fp8_weight_cache.py > "$OUT/pytest_fp8_kernels.log" 2>&1
tail -1 "$OUT/pytest_fp8_kernels.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_fp8_kernels.log" | head
timeout -s INT -k 20 "${TESTS_TIMEOUT:-120}" $PY -m pytest -q -s -rfE -m gpu \
  tests/test_fp8_layer_gpu.py > "$OUT/pytest_fp8_layer.log" 2>&1
tail -1 "$OUT/pytest_fp8_layer.log"; grep -E "^(FAILED|ERROR)|bf16 spec|^E  " "$OUT/pytest_fp8_layer.log" | head -20
if [ "${GATHER_TESTS:-1}" = 1 ]; then
  timeout -s INT -k 20 "${TESTS_TIMEOUT:-120}" $PY -m pytest -q -rfE -m gpu -k "gather" \
    tests/test_grouped_gemm.py tests/test_backward_megakernel.py > "$OUT/pytest_gather.log" 2>&1
  tail -1 "$OUT/pytest_gather.log"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_gather.log" | head -20
fi
for promotion in serial $([ "${OVERLAP:-1}" = 1 ] && echo overlap); do
  timeout "${GEMM_TIMEOUT:-60}" $PY -m benchmarks.fp8_gemm --shapes "${GEMM_SHAPES:-qwen3-30b-a3b,deepseek-v3}" \
    --iters 15 --promotion $promotion --out "$OUT" 2>&1 | tee "$OUT/fp8_gemm_$promotion.log" | tail -3
done
if [ "${CLUSTER2:-0}" = 1 ]; then
  timeout "${GEMM_TIMEOUT:-60}" $PY -m benchmarks.fp8_gemm --shapes "${GEMM_SHAPES:-qwen3-30b-a3b}" \
    --iters 15 --cluster 2 --out "$OUT" 2>&1 | tee "$OUT/fp8_gemm_cluster2.log" | tail -3
fi
if [ "${BREAKDOWN:-1}" = 1 ]; then
  timeout "${BREAKDOWN_TIMEOUT:-90}" $PY -m benchmarks.breakdown --shapes "${LAYER_SHAPES:-qwen3-30b-a3b}" \
    --backend mok-fp8 --top 14 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/breakdown_fp8.log" | tail -34
fi
for gather in ${LAYER_GATHER:-0}; do
  MOK_WGRAD_GATHER=$gather MOK_FP8_PROMOTION=${LAYER_PROMOTION:-serial} timeout "${LAYER_TIMEOUT:-150}" \
    $PY -m benchmarks.layer --shapes "${LAYER_SHAPES:-qwen3-30b-a3b}" --tokens 8192 \
    --backends "${LAYER_BACKENDS:-mok,mok-fp8,mok-fp8-reuse,torch-fp8}" \
    --iters 15 --warmup 5 --out "$OUT" 2>&1 | tr '\r' '\n' | grep -v '%|' > "$OUT/layer_gather$gather.log"
  echo "MOK_WGRAD_GATHER=$gather"; tail -8 "$OUT/layer_gather$gather.log"
done
tar czf "$FINAL_OUT/fp8_check.tgz" -C "$OUT" .
