#!/usr/bin/env bash
# DAPO's own setting for Qwen2.5-32B (arXiv 2503.14476, Sec. 4.1; the flags of run_qwen2.5_32b_multinode.sh) in
# colocated (hybrid) mode, as DAPO ran it: 16 nodes x 8 GPUs, every GPU both an actor rank (TP 8 x PP 2, DP 8)
# and a shard of an SGLang engine (--rollout-num-gpus-per-engine 4: two engines per node, 32 in all). Every
# step the two take turns (megatron_dapo/trainer/colocate.py): SGLang releases its weights and KV cache for training,
# the actor offloads grads and optimizer state for generation. docs/PARALLELISM.md "Colocate or split" says when to use it.
#
# Each node starts its own two engines on its own GPUs (examples/launch_sglang_servers.sh, with
# --enable-memory-saver so that release/resume frees GPU memory, and the planned --mem-fraction-static), then
# the actor. SGLANG_URLS lists all 32 engines in global rank order: node 0's two, node 1's two, ...
# Engines bound beyond loopback need SGLANG_API_KEY (see launch_sglang_servers.sh).
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://n0:30000 http://n0:30001 http://n1:30000 ..." \
#        examples/run_qwen2.5_32b_colocated.sh [HF_CKPT] [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# For the actor; launch_sglang_servers.sh leaves expandable segments out of the engines' (memory saver refuses it)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
HF_CKPT=${1:-${HF_CKPT:-/models/Qwen2.5-32B}}
RUN_DIR=${2:-runs/qwen2.5-32b-dapo-colocated}
NODES=${NODES:-16}
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}" "${SGLANG_URLS:?set SGLANG_URLS}"
source examples/models/qwen2.5-32B.sh
source examples/common_dapo_args.sh

# Memory (python -m megatron_dapo.train <these flags> --dry-run --world-size 128): training as the split
# launcher's plan (DP 8 instead of 4: smaller optimizer shards) plus what the released engine keeps; generation:
# the actor's bf16 weights and context, SGLang's weights + KV cache (--mem-fraction-static, the planner's value;
# tests/test_planner.py checks that it is the computed one) and its runtime. Both phases under 90% of 80 GB.
PARALLEL_ARGS+=(--sequence-parallel --recompute-granularity full --recompute-method block --recompute-num-layers 16)
MEM_FRACTION_STATIC=0.77
ENGINES_PER_NODE=$((8 / SGLANG_TP))
if [[ "${LAUNCH_ENGINES:-1}" == 1 ]]; then
    SGLANG_RUN_DIR="$RUN_DIR/sglang" SGLANG_EXTRA_ARGS="--mem-fraction-static $MEM_FRACTION_STATIC --enable-memory-saver" \
        examples/launch_sglang_servers.sh "$HF_CKPT" "$ENGINES_PER_NODE" "$SGLANG_TP" 30000 "${SGLANG_HOST:-0.0.0.0}"
fi
read -r -a URLS <<<"$SGLANG_URLS"
ROLLOUT_ARGS=(
    --rollout-engine sglang --colocate --sglang-server-urls "${URLS[@]}" --sglang-max-concurrency 2048
    --rollout-num-gpus-per-engine "$SGLANG_TP" --mem-fraction-static "$MEM_FRACTION_STATIC"
    --rollout-batch-size 512 --n-samples-per-prompt 16 --over-sample-factor 1.3
    --rollout-temperature 1.0 --max-response-length 20480 --max-prompt-length 2048
)
BATCH_ARGS=(--global-batch-size 512 --max-tokens-per-micro-batch 24576 --pack-sequences --fused-linear-logprob --num-steps 400)
RUN_ARGS=(--log-dir "$RUN_DIR" --save "$RUN_DIR/ckpt" --save-interval 10 --load "$RUN_DIR/ckpt")

torchrun --nnodes "$NODES" --node_rank "$NODE_RANK" --nproc_per_node 8 \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" -m megatron_dapo.train \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}" --wandb-project "${WANDB_PROJECT:-megatron-dapo}"
