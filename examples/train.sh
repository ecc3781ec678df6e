#!/usr/bin/env bash
# Train a GPT(-MoE) with megatron-core's training loop and a chosen MoE token dispatcher.
#
#   examples/train.sh CONFIG_FILE DISPATCHER [extra Megatron flags...]
#
# CONFIG_FILE: a plain text file of Megatron-LM pretrain_gpt flags (`#` comments, several
# flags per line). DISPATCHER: mok | alltoall | allgather | flex. Extra flags come last, so
# they override the file (e.g. --expert-model-parallel-size 2 --train-iters 5).
# Environment: NPROC (processes, default 1), PYTHON (default .venv/bin/python of this
# repository), TORCHRUN_ARGS (replaces the default --standalone rendezvous), IMPL=te (run
# with Transformer Engine: the config's local-spec flags give way to configs/te.args),
# DRY_RUN=1 (print the command instead of running it).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 CONFIG_FILE DISPATCHER [extra Megatron flags...]" >&2
    exit 2
fi
config=$1
dispatcher=$2
shift 2
if [[ ! -f $config ]]; then
    echo "$0: no such config file: $config" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$repo/.venv/bin/python}
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

flags=()
while IFS= read -r line || [[ -n $line ]]; do
    line=${line%%#*}
    read -ra words <<< "$line"
    flags+=("${words[@]}")
done < "$config"

case ${IMPL:-local} in
    local) ;;
    te)  # drop what only the local spec needs (switches later flags cannot undo), add TE
        kept=()
        for ((i = 0; i < ${#flags[@]}; i++)); do
            case ${flags[i]} in
                --no-masked-softmax-fusion|--no-gradient-accumulation-fusion|--no-rope-fusion|--no-persist-layer-norm) ;;
                --transformer-impl|--recompute-granularity|--recompute-modules) i=$((i + 1)) ;;
                *) kept+=("${flags[i]}") ;;
            esac
        done
        flags=("${kept[@]}")
        while IFS= read -r line || [[ -n $line ]]; do
            line=${line%%#*}
            read -ra words <<< "$line"
            flags+=("${words[@]}")
        done < "$repo/configs/te.args" ;;
    *) echo "$0: IMPL must be local or te, got $IMPL" >&2; exit 2 ;;
esac

read -ra torchrun_args <<< "${TORCHRUN_ARGS:---standalone}"
command=("$PYTHON" -m torch.distributed.run "${torchrun_args[@]}" --nproc-per-node "${NPROC:-1}"
         -m megatron_mok.pretrain_gpt "${flags[@]}" --moe-token-dispatcher-type "$dispatcher" "$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%s\n' "${command[*]}"
    exit 0
fi
exec "${command[@]}"
