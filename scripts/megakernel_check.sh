#!/usr/bin/env bash
# Forward megakernel on a GPU machine (extension built): its tests, the core's tests, the
# v1 GPU suite (which now runs its forward on the megakernel) and the megakernel benchmark.
# Logs under ${OUT:-gpu_out}/. Env: SKIP_CORE=1, SKIP_V1=1, SKIP_BENCH=1, BENCH_ARGS (benchmarks.megakernel),
# SKIP_PROBE=1, PROBE_ARGS (benchmarks.probe_megakernel: cycles per phase, direct vs comm mode).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
# Smoke first: a hanging or faulting kernel must not eat the whole run.
if ! timeout 90 $PY -m pytest -q -x tests/test_megakernel.py -k "selected or bit_equal" \
    > "$OUT/smoke_megakernel.log" 2>&1; then
  echo "megakernel smoke FAILED:"; grep -E "^E |Error|passed|failed" "$OUT/smoke_megakernel.log" | head -30
  tail -30 "$OUT/smoke_megakernel.log"
  exit 1
fi
tail -1 "$OUT/smoke_megakernel.log"
timeout 240 $PY -m pytest -q -ra tests/test_megakernel.py -k "not ring" \
  > "$OUT/test_megakernel.log" 2>&1
grep -E "^E .*(rel|assert|Error)|^FAILED|passed|failed" "$OUT/test_megakernel.log" | head -20
# The x_rows ring in its own process: a deadlock traps and poisons the CUDA context.
timeout 90 $PY -m pytest -q -ra tests/test_megakernel.py -k "ring" > "$OUT/test_ring.log" 2>&1
grep -E "^E .*(assert|Error|watchdog)|^FAILED|passed|failed" "$OUT/test_ring.log" | head -10
if [ "${SKIP_CORE:-0}" != 1 ]; then
  timeout 200 $PY -m pytest -q -ra tests/test_grouped_gemm.py > "$OUT/test_core.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_core.log" | head -10
fi
if [ "${SKIP_V1:-0}" != 1 ]; then
  MOK_FORWARD=megakernel timeout 300 $PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py tests/test_functional.py \
    > "$OUT/test_v1_megakernel.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_v1_megakernel.log" | head -20
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 240 $PY -m benchmarks.megakernel --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_megakernel.log" | grep -vE "^\s*$" | tail -60
fi
if [ "${SKIP_PROBE:-0}" != 1 ]; then
  timeout 120 $PY -m benchmarks.probe_megakernel --out "$OUT" ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/probe_megakernel.log" | tail -12
fi
