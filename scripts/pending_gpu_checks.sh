#!/usr/bin/env bash
# The GPU checks pending since 2026-12-03 night, in calls of under 10 minutes on an H200
# with the extension built. Results under ${OUT:-gpu_out}/.
#   PART=tests: what never ran on a GPU: the GPU row table, the backward megakernel's
#     tests (EP = 1, then the EP rank tests with MOK_BACKWARD=megakernel), the wgrad's
#     strided / reversed reduce-add and main_grad fusion on the kernel backend.
#   PART=suites: the whole forward megakernel suite (spread mode's across-minibatch case
#     failed on a test bug fixed in b1816a7) and the v1 GPU suite on the spread default
#     (the last 3 tests were cut by a time limit at ae2330e).
#   PART=bench: the layer backward with MOK_BACKWARD=megakernel vs the chain (issue 6), the
#     layer forward and backward on the defaults vs torch-unfused.
#   PART=bench2: the layer forward with the GPU row table, the per-category breakdown,
#     wgrad into main_grad three ways (benchmarks.main_grad), the layer with the shared
#     expert folded into the expert pass (MOK_SHARED_EXPERT=folded).
#   PART=next (queued 2026-12-04): the backward megakernel v2 (L2 prefetch in the movers)
#     tests and layer backward vs the chain; the breakdown on the current defaults
#     (GPU row table, combine v2).
#   PART=v5: core v5 (h through the ring for the SwiGLU backward): tests, GEMMs on both
#     paths, layer backward. PART=v5c: v5 with st.shared epilogues: the suites, GEMMs,
#     the layer on all shapes vs torch-unfused.
#   PART=wgrad: the backward megakernel with the weight gradients inside (phase 2): tests,
#     layer backward three ways. PART=v6ncu: ncu of core v6's 128 x 128 mainloop.
#   SHAPES=qwen3-30b-a3b,deepseek-v3 PART=tests|suites|bench|bench2|next|v5|v5c|sync|wgrad \
#     bash scripts/pending_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
shapes=${SHAPES:-qwen3-30b-a3b,deepseek-v3,qwen3.5-like}
part=${PART:-tests}
# The layer backward on the launch chain, then on the backward megakernel.
layer_backward_both_ways() {
  for bwd in launches megakernel; do
    MOK_BACKWARD=$bwd timeout 120 $PY -m benchmarks.layer --shapes "$shapes" --tokens 8192 \
      --backends mok --pass bwd --iters 20 --out "$OUT/layer-bwd-$bwd" \
      > "$OUT/layer-bwd-$bwd.log" 2>&1
    echo "== MOK_BACKWARD=$bwd"
    grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer-bwd-$bwd.log" | head -8
  done
}
if [ "$part" = wgrad ]; then
  # The backward megakernel's phase 2 (weight gradients in the same launch): its tests,
  # then the layer backward on the chain, the megakernel with the wgrads inside (default)
  # and the megakernel with the wgrad launches after it.
  timeout 150 $PY -m pytest -q -ra tests/test_backward_megakernel.py \
    > "$OUT/test_backward_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_backward_megakernel.log" | head -12
  for run in launches:fused megakernel:fused megakernel:launches; do
    bwd=${run%%:*} wg=${run##*:}
    MOK_BACKWARD=$bwd MOK_BACKWARD_WGRAD=$wg timeout 150 $PY -m benchmarks.layer \
      --shapes "$shapes" --tokens 8192 --backends mok --pass bwd --iters 20 \
      --out "$OUT/layer-bwd-$bwd-$wg" > "$OUT/layer-bwd-$bwd-$wg.log" 2>&1
    echo "== MOK_BACKWARD=$bwd MOK_BACKWARD_WGRAD=$wg"
    grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer-bwd-$bwd-$wg.log" | head -8
  done
  exit 0
fi
if [ "$part" = wgrad2 ]; then
  # Where phase 2 loses: the backward's kernel time by category (profiler), the backward
  # megakernel with the wgrads inside against it with the wgrad launches after it.
  for wg in fused launches; do
    MOK_BACKWARD=megakernel MOK_BACKWARD_WGRAD=$wg timeout 150 $PY -m benchmarks.breakdown \
      --shapes "$shapes" --iters 5 --out "$OUT/breakdown-$wg" > "$OUT/breakdown-$wg.log" 2>&1
    echo "== MOK_BACKWARD_WGRAD=$wg"
    grep -E -A12 "bwd" "$OUT/breakdown-$wg.log" | grep -E "bwd|megakernel|core|idle|wall" | head -16
  done
  exit 0
fi
if [ "$part" = wgrad3 ]; then
  # Phase 2's loss under the power limit: DRAM and L2 bytes of the backward's expert
  # kernels, the megakernel with the wgrads inside against it followed by the wgrad
  # launches (ncu, one backward each).
  for wg in fused launches; do
    MOK_BACKWARD=megakernel MOK_BACKWARD_WGRAD=$wg timeout 200 ncu --profile-from-start off \
      -k "regex:moe_backward_kernel|grouped_gemm_kernel" --metrics \
      dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed \
      $PY -m benchmarks.profile_backward --shape "${SHAPE:-qwen3-30b-a3b}" \
      > "$OUT/ncu_bwd_wgrad_$wg.txt" 2>&1
    echo "== MOK_BACKWARD_WGRAD=$wg"
    grep -E "moe_backward_kernel|grouped_gemm_kernel|dram__|lts__t_bytes|duration|pipe_tensor" \
      "$OUT/ncu_bwd_wgrad_$wg.txt" | sed -E 's/^ *//' | cut -c1-110 | head -24
  done
  exit 0
fi
if [ "$part" = v6ncu ]; then
  # Why core v6's 128 x 128 mainloop is slower: ncu metrics of the plain fc1 dgrad (long K,
  # short epilogue) on the ping-pong and the cooperative kernels.
  for pp in 1 0; do
    MOK_GEMM_PINGPONG=$pp timeout 120 ncu --profile-from-start off --launch-count 1 \
      -k "regex:grouped_gemm_(pingpong_)?kernel" --metrics \
      "regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_(active|elapsed),lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_(barrier|long_scoreboard|wait|sleeping|math_pipe_throttle|dispatch_stall|membar)_per_issue_active.ratio" \
      $PY -m benchmarks.profile_core --shape "${SHAPE:-deepseek-v3}" --op dgrad_fc1 --iters 2 \
      > "$OUT/ncu_pp${pp}_dgrad_fc1.txt" 2>&1
    echo "== MOK_GEMM_PINGPONG=$pp"
    grep -E "pipe_tensor|bytes|sectors|duration|stalled" "$OUT/ncu_pp${pp}_dgrad_fc1.txt" | head -20
  done
  exit 0
fi
if [ "$part" = v6 ]; then
  # Core v6 / v6.1 (opt-in MOK_GEMM_PINGPONG=1): ping-pong consumers (v6.1: mainloops in
  # turn; built after the last GPU run, not yet run). Its tests, then the GEMMs
  # alone on both kernels.
  timeout 90 $PY -m pytest -q -ra -m gpu tests/test_grouped_gemm.py -k "pingpong or dgrad_swiglu_h" \
    > "$OUT/test_pingpong.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_pingpong.log" | head -8
  for pp in 1 0; do
    MOK_GEMM_PINGPONG=$pp timeout 100 $PY -m benchmarks.gemm --shapes "$shapes" --iters 10 \
      --warmup 3 --ops --out "$OUT/gemm-pp$pp" > "$OUT/gemm-pp$pp.log" 2>&1
    echo "== MOK_GEMM_PINGPONG=$pp"
    grep -E "^  (fc2|dgrad)" "$OUT/gemm-pp$pp.log"
  done
  exit 0
fi
if [ "$part" = folded ]; then
  # Core v5 made the fused dgrad + SwiGLU bwd faster: the shared expert folded into the
  # expert pass (bit-equal) against the separate torch shared expert, one call, alternating.
  i=0
  for mode in separate folded separate folded; do
    i=$((i + 1))
    MOK_SHARED_EXPERT=$mode timeout 120 $PY -m benchmarks.layer --shapes deepseek-v3,dsv4-pro \
      --tokens 8192 --backends mok --iters 20 --out "$OUT/layer-$i-$mode" \
      > "$OUT/layer-$i-$mode.log" 2>&1
    echo "== $i MOK_SHARED_EXPERT=$mode"
    grep -E "^\s*(deepseek|dsv4)" "$OUT/layer-$i-$mode.log"
  done
  exit 0
fi
if [ "$part" = sync ]; then
  # Host syncs in the layer's passes, and back-to-back pass times with no sync between.
  timeout 200 $PY -m benchmarks.host_sync --shapes "$shapes" 2>&1 | grep -v Warn | tee "$OUT/host_sync.log"
  exit 0
fi
if [ "$part" = v5c ]; then
  # Core v5 with the epilogues' st.shared at 32-bit addresses (every epilogue, the
  # megakernels' too): the suites that run an epilogue, then the GEMMs alone and the layer
  # (all six shapes) against torch-unfused.
  timeout 60 $PY -m pytest -q -ra -m gpu tests/test_grouped_gemm.py > "$OUT/test_grouped_gemm.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_grouped_gemm.log" | head -6
  timeout 60 $PY -m pytest -q -ra tests/test_backward_megakernel.py \
    > "$OUT/test_backward_megakernel.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_backward_megakernel.log" | head -6
  timeout 200 $PY -m pytest -q -ra -x tests/test_megakernel.py > "$OUT/test_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_megakernel.log" | head -6
  timeout 100 $PY -m benchmarks.gemm --shapes "$shapes" --iters 10 --warmup 3 --ops \
    --out "$OUT/gemm" > "$OUT/gemm.log" 2>&1
  grep -E "^(qwen|deepseek|dsv4|gpt|mixtral)|^  (fc|dgrad|wgrad)" "$OUT/gemm.log"
  timeout 170 $PY -m benchmarks.layer --tokens 8192 --backends mok,torch-unfused --iters 20 \
    --out "$OUT/layer" > "$OUT/layer.log" 2>&1
  grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer.log"
  exit 0
fi
if [ "$part" = v5 ]; then
  # Core v5 (2026-12-04): h through the ring in the dgrad + SwiGLU-bwd epilogue. The core's
  # GPU tests (ring vs global bits, fp32 references, clusters), the backward megakernel's
  # (it reads h through its ring too), then the GEMMs alone on both paths and the layer
  # backward.
  timeout 200 $PY -m pytest -q -ra -m gpu tests/test_grouped_gemm.py > "$OUT/test_grouped_gemm.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_grouped_gemm.log" | head -12
  timeout 90 $PY -m pytest -q -ra tests/test_backward_megakernel.py \
    > "$OUT/test_backward_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error|watchdog)|passed|failed" \
    "$OUT/test_backward_megakernel.log" | head -12
  for mode in global ring; do
    MOK_DGRAD_H=$mode timeout 150 $PY -m benchmarks.gemm --shapes "$shapes" --iters 10 \
      --warmup 3 --ops --out "$OUT/gemm-$mode" > "$OUT/gemm-$mode.log" 2>&1
    echo "== MOK_DGRAD_H=$mode"
    grep -E "^(qwen|deepseek|dsv4|gpt|mixtral).*dgrad|dgrad_fc2_swiglu" "$OUT/gemm-$mode.log"
  done
  layer_backward_both_ways
  exit 0
fi
if [ "$part" = next ]; then
  # combine v2's bits against an fp32-fma emulation (added after the last GPU run).
  timeout 60 $PY -m pytest -q -ra -m gpu tests/test_extension.py > "$OUT/test_extension.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_extension.log" | head -8
  timeout 120 $PY -m pytest -q -ra tests/test_backward_megakernel.py \
    > "$OUT/test_backward_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error|watchdog)|passed|failed" \
    "$OUT/test_backward_megakernel.log" | head -20
  layer_backward_both_ways
  timeout 100 $PY -m benchmarks.breakdown --shapes "$shapes" --iters 3 --out "$OUT" 2>&1 \
    | grep -E "fwd|bwd|wrote" | grep -v Warn
  exit 0
fi
if [ "$part" = tests ]; then
  # The GPU row table (MOK_SCHEDULE=kernel) against the tensor ops.
  timeout 60 $PY -m pytest -q -ra tests/test_schedule_kernel.py > "$OUT/test_schedule.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_schedule.log" | head -8
  # The backward megakernel, in its own process (a trap would poison the context).
  timeout 180 $PY -m pytest -q -ra tests/test_backward_megakernel.py \
    > "$OUT/test_backward_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error|watchdog)|passed|failed" \
    "$OUT/test_backward_megakernel.log" | head -20
  # Gradient-accumulation fusion: the wgrad adding into per-expert buffers (apart,
  # backwards), then the kernel backend's adds for four buffer layouts.
  timeout 90 $PY -m pytest -q -ra tests/test_grouped_gemm.py -k "accumulates" \
    > "$OUT/test_wgrad_accumulate.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_wgrad_accumulate.log" | head -8
  timeout 120 $PY -m pytest -q -ra tests/test_gpu_backend.py -k "main_grad or folded" \
    > "$OUT/test_main_grad.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_main_grad.log" | head -8
  # EP = 2/4/8 as processes on one GPU with the backward megakernel (pulls from the peers'
  # arenas, writes their slots): gradients vs the reference.
  MOK_BACKWARD=megakernel timeout 150 $PY -m pytest -q -ra -m gpu tests/test_gpu_backend.py \
    -k ep_ranks > "$OUT/test_ep_backward.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_ep_backward.log" | head -5
  exit 0
fi
if [ "$part" = suites ]; then
  timeout 200 $PY -m pytest -q -ra tests/test_megakernel.py > "$OUT/test_megakernel.log" 2>&1
  grep -E "^FAILED|^E .*(assert|Error)|passed|failed" "$OUT/test_megakernel.log" | head -12
  timeout 300 $PY -m pytest -q -ra -m gpu tests/test_extension.py tests/test_gpu_backend.py \
    > "$OUT/test_v1.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/test_v1.log" | head -5
  exit 0
fi
if [ "$part" = bench ]; then
  layer_backward_both_ways
  timeout 150 $PY -m benchmarks.layer --tokens 8192 --backends mok,torch-unfused --iters 20 \
    --out "$OUT/layer" > "$OUT/layer.log" 2>&1
  grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer.log"
  exit 0
fi
# PART=bench2
# The layer forward with the GPU row table (host overhead of the small shapes).
MOK_SCHEDULE=kernel timeout 60 $PY -m benchmarks.layer --shapes qwen3-30b-a3b,qwen3.5-like \
  --tokens 8192 --backends mok --pass fwd --iters 20 --out "$OUT/layer-sched" \
  > "$OUT/layer-sched.log" 2>&1
grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer-sched.log"
timeout 100 $PY -m benchmarks.breakdown --shapes "$shapes" --iters 3 --out "$OUT" 2>&1 \
  | grep -E "fwd|bwd|wrote" | grep -v Warn
# Expert weight gradients into main_grad: unfused (bf16 + per-expert adds), fp32 +
# foreach, fused in the wgrad's epilogue (Megatron's buffer layouts).
timeout 90 $PY -m benchmarks.main_grad --out "$OUT" 2>&1 | grep -vi warn | tail -14
# The shared expert folded into the expert pass (deepseek-v3, dsv4-pro: Is = I), against
# the separate shared expert of PART=bench's layer run.
MOK_SHARED_EXPERT=folded timeout 120 $PY -m benchmarks.layer --shapes deepseek-v3,dsv4-pro \
  --tokens 8192 --backends mok --iters 20 --out "$OUT/layer-folded" > "$OUT/layer-folded.log" 2>&1
grep -E "^\s*(qwen|deepseek|dsv4|gpt|mixtral)" "$OUT/layer-folded.log"
