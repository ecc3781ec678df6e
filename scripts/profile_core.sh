#!/usr/bin/env bash
# Nsight Compute metrics of the grouped-GEMM core on one shape (extension built, GPU):
# SOL, L2/DRAM throughput, tensor-pipe utilisation and warp stalls of one launch per op,
# to explain where the core stands against the dense peak (docs/perf-notes.md).
# Falls back to torch.profiler kernel times when ncu is not installed.
#   SHAPE=deepseek-v3 OPS="fc1 fc2 wgrad_fc1 torch_fc1" bash scripts/profile_core.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
shape=${SHAPE:-deepseek-v3}
for op in ${OPS:-fc1 fc2 dgrad_swiglu wgrad_fc1 torch_fc1}; do
  if command -v ncu > /dev/null; then
    ncu --launch-skip 1 --launch-count 1 -k regex:'grouped_gemm_kernel|cutlass|gemm' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section ComputeWorkloadAnalysis \
        $PY -m benchmarks.profile_core --shape "$shape" --op "$op" --iters 2 \
        > "$OUT/ncu_${shape}_${op}.txt" 2>&1
    echo "== $op"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Stall|Issued Ipc" \
        "$OUT/ncu_${shape}_${op}.txt" | head -14
  else
    echo "== $op (no ncu: torch.profiler)"
    $PY -m benchmarks.profile_core --shape "$shape" --op "$op" --torch-profiler 2>&1 \
        | tee "$OUT/prof_${shape}_${op}.txt" | head -12
  fi
done
