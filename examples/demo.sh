#!/usr/bin/env bash
# `make demo`: train the tiny GPT-MoE (configs/tiny_gpt_moe.args) for 20 steps with the
# MoK dispatcher, on the GPU when torch sees one (bf16) and on the CPU otherwise (fp32,
# gloo). Prints loss and tokens/s per step; fails unless the last loss is below the first.
#
#   examples/demo.sh [extra Megatron flags...]
#
# Environment: DISPATCHER (default mok), PYTHON, NPROC (see examples/train.sh).
# Megatron's full log goes to runs/demo.log.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHON=${PYTHON:-$repo/.venv/bin/python}
dispatcher=${DISPATCHER:-mok}

extra=()
if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    device=GPU
    extra+=(--bf16)
else
    device=CPU
    export TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}  # compiling costs more than it saves
fi

mkdir -p "$repo/runs"
log=$repo/runs/demo.log
echo "demo: tiny GPT-MoE, dispatcher '$dispatcher', 20 steps on the $device (full log: $log)"

start=$SECONDS
set +e
"$repo/examples/train.sh" "$repo/configs/tiny_gpt_moe.args" "$dispatcher" \
    --train-iters 20 "${extra[@]}" "$@" 2>&1 | tee "$log" | grep --line-buffered -F '[megatron_mok] step'
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
    echo "demo: training failed (exit $status); last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit "$status"
fi

losses=$(sed -n 's/^\[megatron_mok\] step .*| lm loss \([^ ]*\) |.*/\1/p' "$log")
first=$(head -n 1 <<< "$losses")
last=$(tail -n 1 <<< "$losses")
if [[ -z $first ]]; then
    echo "demo: no per-step lines found in $log" >&2
    exit 1
fi
echo "demo: $(wc -l <<< "$losses") steps in $((SECONDS - start)) s, lm loss $first -> $last"
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
    echo "demo: OK (loss decreased)"
else
    echo "demo: FAIL (last loss $last is not below first loss $first)" >&2
    exit 1
fi
