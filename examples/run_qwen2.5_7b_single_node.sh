#!/usr/bin/env bash
# DAPO on one 8-GPU node: the Megatron actor on GPUs 0-3 (TP 4), two SGLang servers (TP 2) on GPUs 4-7,
# launched by rank 0 behind sglang-router; weights go to them after every step.
#
# usage: examples/run_qwen2.5_7b_single_node.sh [HF_CKPT] [RUN_DIR]
#        DRY_RUN=1 examples/run_qwen2.5_7b_single_node.sh   (or --dry-run: the node's roles and the memory plan)
# EXTRA_TRAIN_ARGS: more trainer flags, split on whitespace (run_qwen3_8b_distill.sh's teacher).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
set -- "${POSITIONAL[@]}"
# PyTorch allocator: expandable segments, less fragmentation with micro-batches of varying length. One
# hardware queue per GPU: Megatron's sequence-parallel overlap relies on kernels starting in issue order.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
HF_CKPT=${1:-${HF_CKPT:-/models/Qwen2.5-7B}}
RUN_DIR=${2:-${RUN_DIR:-runs/qwen2.5-7b-dapo}}
MODEL=${MODEL:-qwen2.5-7B}
source "examples/models/$MODEL.sh"  # MODEL=qwen3-...: another model file (run_qwen3_*.sh)
source examples/common_dapo_args.sh

# Memory (--dry-run --world-size 4): sequence parallelism and the fused linear log-prob head keep one packed
# 16k-token micro-batch at ~61 GiB of 80.
PARALLEL_ARGS+=(--sequence-parallel)
ROLLOUT_ARGS=(
    --rollout-engine sglang --sglang-num-servers 2 --sglang-tp-size "$SGLANG_TP" --sglang-gpus 4,5,6,7
    --rollout-batch-size 64 --n-samples-per-prompt 16 --over-sample-factor 1.5
    --rollout-temperature 1.0 --max-response-length 8192 --max-prompt-length 2048
)
BATCH_ARGS=(--global-batch-size 256 --max-tokens-per-micro-batch 16384 --pack-sequences --fused-linear-logprob --num-steps 500)
RUN_ARGS=(--log-dir "$RUN_DIR" --save "$RUN_DIR/ckpt" --save-interval 20 --load "$RUN_DIR/ckpt")

TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}"
            "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}" --overlong-buffer-length 2048)
read -r -a extra <<<"${EXTRA_TRAIN_ARGS:-}"
TRAIN_ARGS+=(${extra[@]+"${extra[@]}"})
if [[ "$DRY_RUN" == 1 ]]; then
    echo "single node: actor ranks 0-3 on GPUs 0-3 (torchrun), 2 SGLang servers at TP $SGLANG_TP on GPUs 4-7 launched" \
        "by rank 0 behind a router (ports 30000-30002)"
    WORLD_SIZE=4
    memory_plan
    exit $?
fi
CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc_per_node 4 -m megatron_dapo.train "${TRAIN_ARGS[@]}"
