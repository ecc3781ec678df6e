#!/usr/bin/env bash
# One command for a GPU machine with the extension already built (megatron_mok/_C*.so):
# installs megatron-core from .whl/ when it is missing, runs the GPU tests and the
# tiny `mok` pretraining demo, and leaves logs under ${OUT:-gpu_out}/.
# Usage: bash scripts/gpu_check.sh [pytest -k expression]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if ! $PY -c "import megatron.core" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"

status=0
$PY -m pytest -q -ra -m gpu tests ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
PYTHON=$PY bash examples/demo.sh > "$OUT/demo.log" 2>&1 || status=1
grep -E "^step|tokens/s|error|Error" "$OUT/demo.log" | tail -25

printf '\n%-28s %s\n' "check" "result"
printf '%-28s %s\n' "GPU tests" "$(tail -1 "$OUT/pytest_gpu.log")"
printf '%-28s %s\n' "demo (mok, 20 steps)" "$(grep -c '^step' "$OUT/demo.log" 2>/dev/null) step lines"
exit $status
