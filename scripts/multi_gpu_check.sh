#!/usr/bin/env bash
# EP 2/4/8 correctness with one process per GPU (multi-GPU H200 machine, extension built):
# the EP tests of tests/test_gpu_backend.py with rank r on GPU r, NVLink multicast off.
# Logs under ${OUT:-gpu_out}/. The EP layer benchmark and end-to-end runs are not here yet.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export MOK_TEST_GPU_PER_RANK=1
ngpu=$(nvidia-smi -L | wc -l)
echo "GPUs: $ngpu"
sel="ep_ranks_sharing_one_gpu and not 8-"
[ "$ngpu" -ge 8 ] && sel="ep_ranks_sharing_one_gpu"
$PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py -k "$sel" 2>&1 | tee "$OUT/multi_gpu_tests.log" | tail -15
exit "${PIPESTATUS[0]}"
