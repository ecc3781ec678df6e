#!/usr/bin/env bash
# Nsight Compute of the forward megakernel on one shape (extension built, GPU): SOL,
# memory, warp stalls, tensor-pipe activity per mode, to find why direct mode's gathered
# fc1 and comm mode's row mover are slow (docs/perf-notes.md, megakernel v4/v5).
#   SHAPE=deepseek-v3 MODES="direct:lines direct:rows comm:8" bash scripts/profile_megakernel.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
shape=${SHAPE:-deepseek-v3}
for mode in ${MODES:-direct:lines direct:rows comm:8}; do
  kind=${mode%%:*}; arg=${mode#*:}
  if [ "$kind" = direct ]; then extra="--mode direct --gather $arg"; else extra="--mode comm --comm-sms $arg"; fi
  tag="${shape}_${kind}_${arg}"
  if ! command -v ncu > /dev/null; then echo "no ncu on this machine"; exit 1; fi
  ncu --profile-from-start off --launch-count 1 -k "regex:moe_forward_kernel" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section LaunchStats \
      $PY -m benchmarks.profile_megakernel --shape "$shape" $extra > "$OUT/ncu_mk_$tag.txt" 2>&1
  ncu --profile-from-start off --launch-count 1 -k "regex:moe_forward_kernel" \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_(active|elapsed),lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,dram__bytes_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,gpu__time_duration.sum" \
      $PY -m benchmarks.profile_megakernel --shape "$shape" $extra > "$OUT/ncu_mk_metrics_$tag.txt" 2>&1
  echo "== $tag"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput" "$OUT/ncu_mk_$tag.txt" | head -8
  grep -E "stalled|pipe_tensor|bytes|requests|sectors|duration" "$OUT/ncu_mk_metrics_$tag.txt" | awk '$NF+0 > 0.05 || /pipe|bytes|requests|sectors|duration/' | head -30
done
