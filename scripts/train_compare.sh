#!/usr/bin/env bash
# Megatron GPT-MoE training on one GPU, `mok` vs `alltoall` (EP=1), 50 steps each:
# the tiny config and a 2-layer slice of Qwen3-30B-A3B, plus a second `mok` run of each
# to check run-to-run identical losses, and a `mok` run with the expert weight gradients
# added straight into Megatron DDP's main_grad (mokfused: --mok-main-grad-fusion on).
# --deterministic-mode on every run. Logs under
# ${OUT:-gpu_out}/train_*.log, summary JSON from `python -m benchmarks.train_report`.
# Env: CONFIGS (default "tiny qwen3"; "gpt-oss" = configs/gpt_oss_120b.args sliced to one
# GPU; "dsv3" = the DeepSeek-V3 proxy, 32 experts, on one GPU; "qwen3-ep8" = the 16-layer Qwen3-30B-A3B config at EP 8 on an 8-GPU machine, issue
# 7's end-to-end run), STEPS (50), RUN_TIMEOUT (seconds per run; 240, qwen3-ep8 900), RUNS
# (default "mok alltoall mok2 mokfused"; "mokfp8" / "mokfp82": `mok` with --mok-fp8 blockwise
# on the FP8 kernels, MOK_FP8_KERNELS=1, run twice for identical losses; "mokmfp8" /
# "alltoallfp8": Megatron's own --fp8-format e4m3 --fp8-recipe blockwise for the whole model,
# with mok's FP8 kernels / with alltoall + TEGroupedMLP: needs IMPL=te TE=1), EXTRA (flags
# appended to every run, e.g. "--global-batch-size 4": the last occurrence wins), IMPL=te
# (Transformer Engine everywhere else in the model, configs/te.args; TE=1 unpacks it, logs
# train_<config>-te_<run>.log), PEAK_TFLOPS (the GPU's dense BF16 peak, for MFU).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
export PYTHON=$PY
steps=${STEPS:-50}
tag=$([ "${IMPL:-local}" = te ] && echo -te)
common=(--train-iters "$steps" --log-interval 1 --deterministic-mode --bf16)
for cfg in ${CONFIGS:-tiny qwen3}; do
  nproc=1 limit=${RUN_TIMEOUT:-240}
  case $cfg in
    tiny)  file=configs/tiny_gpt_moe.args; extra=() ;;
    qwen3) file=configs/qwen3_30b_a3b.args
           extra=(--num-layers 2 --expert-model-parallel-size 1 --global-batch-size 8
                  --lr-warmup-iters 5 --num-workers 0) ;;
    # GPT-OSS-120B as published (clamped GLU, biases, sinks, windows, YaRN) sliced to one
    # GPU: 2 layers, 16 experts, EP 1. Its alltoall twin cannot run a backward at EP = TP = 1
    # on Megatron 0.19 (SequentialMLP's in-place bias add on a custom Function's view;
    # tests/test_megatron_rounding.py), so RUNS="mok mok2" there.
    gpt-oss) file=configs/gpt_oss_120b.args
           extra=(--num-layers 2 --expert-model-parallel-size 1 --num-experts 16
                  --global-batch-size 8 --lr-warmup-iters 5 --num-workers 0) ;;
    # The DeepSeek-V3 proxy (a dense layer then an MoE layer with its shared expert, group-
    # limited sigmoid routing) cut to one GPU: 32 of its 256 experts, a 32k vocabulary.
    dsv3)  file=configs/deepseek_v3_proxy.args
           extra=(--expert-model-parallel-size 1 --num-experts 32 --vocab-size 32768
                  --global-batch-size 4 --lr-warmup-iters 5 --num-workers 0) ;;
    qwen3-ep8) file=configs/qwen3_30b_a3b.args  # as configured: 16 layers, EP 8
           extra=(--lr-warmup-iters 5 --num-workers 0); nproc=8 limit=${RUN_TIMEOUT:-900} ;;
    *) echo "unknown config $cfg"; continue ;;
  esac
  for run in ${RUNS:-mok alltoall mok2 mokfused}; do
    disp=${run%2} fused=() fp8=0
    [ "$run" = mokfused ] && disp=mok fused=(--mok-main-grad-fusion on)
    [ "$disp" = mokfp8 ] && disp=mok fused=(--mok-fp8 blockwise) fp8=1
    [ "$disp" = mokmfp8 ] && disp=mok fused=(--fp8-format e4m3 --fp8-recipe blockwise) fp8=1
    [ "$disp" = alltoallfp8 ] && disp=alltoall fused=(--fp8-format e4m3 --fp8-recipe blockwise)
    MOK_FP8_KERNELS=$fp8 NPROC=$nproc timeout "$limit" bash examples/train.sh "$file" "$disp" "${common[@]}" "${extra[@]}" \
      "${fused[@]}" ${EXTRA:-} > "$OUT/train_${cfg}${tag}_${run}.log" 2>&1
    echo "$cfg$tag $run exit $?: $(grep -cF '[megatron_mok] step' "$OUT/train_${cfg}${tag}_${run}.log") steps"
  done
done
$PY -m benchmarks.train_report "$OUT"/train_*.log --out "$OUT" ${PEAK_TFLOPS:+--peak-tflops $PEAK_TFLOPS}
for result in "$OUT"/*-train-ep*.json; do
  [ -f "$result" ] && $PY -m benchmarks.plot_train "$result" --out "${result%.json}.svg" --smooth 10
done
