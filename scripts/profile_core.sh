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
  # Our ops launch a counter-zeroing fill first: profile the GEMM kernel by name.
  kernel=grouped_gemm_kernel
  [ "$op" = torch_fc1 ] && kernel='device_kernel'  # CUTLASS's, not its set-up kernel
  if command -v ncu > /dev/null; then
    # Only the last call of the op runs inside cudaProfilerStart/Stop (set-up launches the
    # core too); the first ncu pass takes the sections, the second the stall reasons and
    # the tensor-pipe activity as raw metrics.
    ncu --profile-from-start off --launch-count 1 -k "regex:$kernel" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section SchedulerStats --section LaunchStats \
        $PY -m benchmarks.profile_core --shape "$shape" --op "$op" --iters 2 \
        > "$OUT/ncu_${shape}_${op}.txt" 2>&1
    ncu --profile-from-start off --launch-count 1 -k "regex:$kernel" \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_(active|elapsed),regex:sm__inst_executed_pipe_tensor.*sum,lts__t_bytes.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,sm__cycles_elapsed.avg.per_second" \
        $PY -m benchmarks.profile_core --shape "$shape" --op "$op" --iters 2 \
        > "$OUT/ncu_metrics_${shape}_${op}.txt" 2>&1
    echo "== $op"; grep -E "  [a-z_]+(<|::| )|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Issued Ipc|Registers|Function Name" \
        "$OUT/ncu_${shape}_${op}.txt" | head -14
    grep -E "stalled|pipe_tensor|bytes|cycles_elapsed" "$OUT/ncu_metrics_${shape}_${op}.txt" \
        | awk '$NF+0 > 0.05 || /pipe|bytes|cycles/' | head -30
  else
    echo "== $op (no ncu: torch.profiler)"
    $PY -m benchmarks.profile_core --shape "$shape" --op "$op" --torch-profiler 2>&1 \
        | tee "$OUT/prof_${shape}_${op}.txt" | head -12
  fi
done
