#!/usr/bin/env bash
# Multi-GPU H200 machine (extension built), one process per GPU, NVLink multicast off:
#   1. the EP tests of tests/test_gpu_backend.py with rank r on GPU r (EP 2/4/8);
#   2. the EP layer benchmark (benchmarks.layer_ep: mok vs PyTorch + NCCL all-to-all) at
#      EP = 2, 4 and 8 (as many as the GPUs allow), results under $OUT/.
#   3. with 8 GPUs: Qwen3-30B-A3B (16 layers, EP 8) trained with `mok` and `alltoall`
#      (scripts/train_compare.sh CONFIGS=qwen3-ep8), tokens/s/GPU side by side.
# Env: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_TRAIN=1, BENCH_ARGS (extra benchmark flags, e.g.
# "--shapes deepseek-v3 --tokens 8192"), STEPS (training steps, default 50).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export MOK_TEST_GPU_PER_RANK=1
ngpu=$(nvidia-smi -L | wc -l)
echo "GPUs: $ngpu"
sel="ep_ranks_sharing_one_gpu and not 8-"
[ "$ngpu" -ge 8 ] && sel="ep_ranks_sharing_one_gpu"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  $PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py -k "$sel" 2>&1 | tee "$OUT/multi_gpu_tests.log" | tail -15
  rc=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for ep in 2 4 8; do
    [ "$ep" -le "$ngpu" ] || continue
    $PY -m torch.distributed.run --standalone --nproc_per_node "$ep" -m benchmarks.layer_ep \
        --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/layer_ep${ep}.log" | grep -vE "^\s*$" | tail -40
  done
fi
if [ "${SKIP_TRAIN:-0}" != 1 ] && [ "$ngpu" -ge 8 ]; then
  CONFIGS=qwen3-ep8 bash scripts/train_compare.sh
fi
exit "$rc"
