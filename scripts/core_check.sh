#!/usr/bin/env bash
# Grouped-GEMM core on a GPU machine (extension built): SASS op counts, the core's tests,
# the v1 GPU tests on the core (and the adversarial EP ones on the torch path), the core
# benchmark. Logs under ${OUT:-gpu_out}/. Env: SKIP_V1=1, SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
(cuobjdump -sass megatron_mok/_C*.so | grep -oE "HGMMA\.[0-9x]+\.[A-Z0-9]+|UTMALDG\.[0-9A-Z.]+|USETMAXREG[.A-Z0-9]*|STL\.|LDL\." \
  | sort | uniq -c) > "$OUT/sass_ops.txt" 2>&1
head -12 "$OUT/sass_ops.txt"
# Smoke first: a hanging or faulting kernel must not eat the whole run.
if ! timeout 60 $PY -m pytest -q -x tests/test_grouped_gemm.py -k "balanced and 256" \
    > "$OUT/smoke_core.log" 2>&1; then
  echo "core smoke FAILED (exit $?):"; grep -E "^E |Error|passed|failed" "$OUT/smoke_core.log" | head -20
  export MOK_GEMM_CORE=torch SKIP_BENCH=1
fi
if [ "${MOK_GEMM_CORE:-mok}" = mok ]; then
  timeout 240 $PY -m pytest -q -ra tests/test_grouped_gemm.py 2>&1 > "$OUT/test_core.log"
  grep -E "^E .*(rel|assert|Error)|passed|failed" "$OUT/test_core.log" | head -30
fi
if [ "${SKIP_V1:-0}" != 1 ]; then
  MOK_GEMM_CORE=torch timeout 120 $PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py -k adversarial \
    2>&1 > "$OUT/test_v1_adversarial_torchcore.log"; tail -1 "$OUT/test_v1_adversarial_torchcore.log"
  timeout 240 $PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py tests/test_functional.py \
    2>&1 > "$OUT/test_v1_core.log"; grep -E "^FAILED|passed|failed" "$OUT/test_v1_core.log" | head -20
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 200 $PY -m benchmarks.gemm --out "$OUT" --iters 20 2>&1 | tee "$OUT/bench_core.log" | tail -22
fi
