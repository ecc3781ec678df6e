#!/usr/bin/env bash
# The GPU measurements pending since 2026-12-03 (docs/perf-notes.md: megakernel fwd v10 and
# "EP = 1 in-place combine"), in one call of at most ~8 minutes on an H200 with the
# extension built: the megakernel tests (multi-warp movers, probes, in-place combine, x_rows
# ring), the cycle probes per phase, the mover-warps and in-place sweeps of
# benchmarks.megakernel, and the layer benchmark of `mok` with the slots and the in-place
# combine. Results under ${OUT:-gpu_out}/.
#   SHAPES=qwen3-30b-a3b,deepseek-v3 PART=tests|bench bash scripts/pending_gpu_checks.sh
# The device allows 10 minutes a call: run PART=tests, then PART=bench (default: both).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
shapes=${SHAPES:-qwen3-30b-a3b,deepseek-v3}
part=${PART:-all}
if [ "$part" != bench ]; then
  # The x_rows ring last and in its own process: a deadlock traps (watchdog) and leaves the
  # CUDA context unusable for whatever runs after it in the same process.
  timeout 240 $PY -m pytest -q -ra tests/test_megakernel.py -k "not ring" \
    > "$OUT/test_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_megakernel.log" | head -20
  timeout 90 $PY -m pytest -q -ra tests/test_megakernel.py -k "ring" > "$OUT/test_ring.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error|watchdog)|passed|failed" "$OUT/test_ring.log" | head -10
  # The combine kernels (merged at 8b6a407) on the default path: extension + v1 suite.
  timeout 200 $PY -m pytest -q -ra -m gpu tests/test_extension.py tests/test_gpu_backend.py \
    > "$OUT/test_v1.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_v1.log" | head -5
  # EP = 2/4/8 as processes on one GPU, forward on the comm-mode megakernel with 4 mover warps.
  MOK_FORWARD=megakernel MOK_MOVER_WARPS=4 timeout 150 $PY -m pytest -q -ra -m gpu \
    tests/test_gpu_backend.py -k ep_ranks > "$OUT/test_ep_movers.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_ep_movers.log" | head -5
fi
[ "$part" = tests ] && exit 0
timeout 90 $PY -m benchmarks.probe_megakernel --shapes "$shapes" --out "$OUT" 2>&1 \
  | tee "$OUT/probe_megakernel.log" | tail -10
timeout 150 $PY -m benchmarks.megakernel --shapes "$shapes" --gather lines,lines+inplace \
  --minibatch 2048 --comm-sms 8,16 --mover-warps 1,2,4 --iters 10 --out "$OUT" 2>&1 \
  | tee "$OUT/bench_megakernel.log" | grep -E "launches-mok|direct|comm|best"
for mode in slots rows; do
  MOK_EP1_COMBINE=$mode timeout 100 $PY -m benchmarks.layer --shapes "$shapes" --tokens 8192 \
    --backends mok --iters 20 --out "$OUT/layer-$mode" > "$OUT/layer-$mode.log" 2>&1
  echo "== MOK_EP1_COMBINE=$mode"
  grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer-$mode.log" | head -8
done
