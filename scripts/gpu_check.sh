#!/usr/bin/env bash
# One command for a GPU machine with the extension already built (megatron_mok/_C*.so):
# installs megatron-core from .whl/ when it is missing, says which committed tree runs,
# runs the GPU tests, the tiny `mok` pretraining demo and the EP=1 layer benchmark, prints
# a summary table and leaves logs and the benchmark JSON under ${OUT:-gpu_out}/.
#
#   bash scripts/gpu_check.sh [pytest -k expression]
#
# Parts (1 = run): GPU_TESTS=1 DEMO=1 BENCH=1 AUTOTUNE=0 SONIC=0.
#   BENCH_ARGS go to `python -m benchmarks.layer` (e.g. "--shapes deepseek-v3 --tokens 4096");
#   BENCH_TIMEOUT (s) bounds it (it keeps what it measured when cut short).
#   AUTOTUNE=1 first caches the fastest plans per shape (benchmarks.autotune, cache in
#   $OUT/autotune_cache.json), which the layer benchmark's `mok` then uses.
#   SONIC=1 unpacks SonicMoE from .sonic/sonic_site.tar.xz (benchmarks/sonicmoe_baseline.py
#   says how to pack it) so the layer benchmark's `sonicmoe` baseline runs (its kernels
#   compile on first use per shape: minutes).
#   TE=1 unpacks Transformer Engine 2.20.2 from .te/te_h200_bundle.tar.xz (the TE wheel's
#   tree and its torch extension built for torch 2.11) so the GPU tests run with TE on the
#   path and the layer benchmark's `megatron-te` baseline (alltoall + TEGroupedMLP + fused
#   permute) runs.
#   TESTS_TIMEOUT (s) bounds the GPU tests.
# Before the call, on the development machine: commit, then `python -m benchmarks.provenance`
# (writes .mok_source.json; carry it) so results name the commit and git_dirty: false.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"
$PY -c "from benchmarks.provenance import source_state as s; c, d, f = s(); print('tree', c, 'dirty' if d else 'clean', *f[:5])" | tee -a "$OUT/gpu.txt"

if [ "${SONIC:-0}" = 1 ]; then
  mkdir -p /tmp/sonic && tar xJf .sonic/sonic_site.tar.xz -C /tmp/sonic
  export PYTHONPATH=/tmp/sonic:/tmp/sonic/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
  export QUACK_CACHE_DIR=/tmp/quack_cache QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16}
  $PY -c "import sonicmoe; print('sonicmoe importable')" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
fi

if [ "${TE:-0}" = 1 ]; then  # unpacked by gpu_env.sh
  $PY -c "import torch, transformer_engine.pytorch; print('transformer_engine importable')" 2>&1 \
    | tail -1 | tee -a "$OUT/gpu.txt"
fi

status=0
tests_line="skipped"; demo_line="skipped"; bench_line="skipped"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  # SIGINT at the limit: pytest stops as on ^C and still prints its summary, whose -rfE
  # lines name every test that failed or errored so far (a TERM-killed run names none).
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-480}" $PY -m pytest -q -rfE -m gpu tests \
    ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  tests_line="$(tail -1 "$OUT/pytest_gpu.log")$(grep -cE '^(FAILED|ERROR)' "$OUT/pytest_gpu.log" \
    | sed 's|^|; FAILED/ERROR lines: |')"
fi
if [ "${DEMO:-1}" = 1 ]; then
  PYTHON=$PY bash examples/demo.sh > "$OUT/demo.log" 2>&1 || status=1
  grep -F "[megatron_mok] step" "$OUT/demo.log" | tail -5
  demo_line="$(grep -cF '[megatron_mok] step' "$OUT/demo.log") step lines; $(grep '^demo:' "$OUT/demo.log" | tail -1)"
fi
if [ "${BENCH:-1}" = 1 ] && [ "${AUTOTUNE:-0}" = 1 ]; then
  export MOK_AUTOTUNE_CACHE="$OUT/autotune_cache.json"
  timeout "${AUTOTUNE_TIMEOUT:-300}" $PY -m benchmarks.autotune --out "$OUT" 2>&1 | tee "$OUT/autotune.log" | tail -8
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-420}" $PY -m benchmarks.layer --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tr '\r' '\n' | grep -v '^ *[0-9]*%|' > "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  tail -40 "$OUT/bench.log"
  [ "$rc" -eq 0 ] || status=1
  bench_line="exit $rc; $(ls "$OUT"/*layer*.json 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
fi

printf '\n%-24s %s\n' "check" "result"
printf '%-24s %s\n' "GPU tests" "$tests_line"
printf '%-24s %s\n' "demo (mok, 20 steps)" "$demo_line"
printf '%-24s %s\n' "layer benchmark" "$bench_line"
exit $status
