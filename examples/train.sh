#!/usr/bin/env bash
# Train a GPT(-MoE) with megatron-core's training loop and a chosen MoE token dispatcher.
#
#   examples/train.sh CONFIG_FILE DISPATCHER [extra Megatron flags...]
#
# CONFIG_FILE: a plain text file of Megatron-LM pretrain_gpt flags (`#` comments, several
# flags per line). DISPATCHER: mok | alltoall | allgather | flex. Extra flags come last, so
# they override the file (e.g. --expert-model-parallel-size 2 --train-iters 5).
# Environment: NPROC (processes, default 1), PYTHON (default .venv/bin/python of this
# repository), TORCHRUN_ARGS (replaces the default --standalone rendezvous).
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

read -ra torchrun_args <<< "${TORCHRUN_ARGS:---standalone}"
exec "$PYTHON" -m torch.distributed.run "${torchrun_args[@]}" --nproc-per-node "${NPROC:-1}" \
    -m megatron_mok.pretrain_gpt "${flags[@]}" --moe-token-dispatcher-type "$dispatcher" "$@"
