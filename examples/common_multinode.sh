# The part every multinode actor launcher shares (sourced last, after MODEL_ARGS and PARALLEL_ARGS are set): rollouts
# from SGLang servers already running at $SGLANG_URLS with NCCL weight broadcast, DAPO's batch of 512 prompts x 16
# responses in 24k-token packed micro-batches, checkpoints every 10 steps, and the torchrun of this node.
read -r -a URLS <<<"$SGLANG_URLS"
ROLLOUT_ARGS=(
    --rollout-engine sglang --sglang-server-urls "${URLS[@]}" --sglang-max-concurrency 2048
    --weight-sync-mode distributed --weight-sync-master-addr "$MASTER_ADDR"
    --rollout-batch-size 512 --n-samples-per-prompt 16 --over-sample-factor 1.3
    --rollout-temperature 1.0 --max-response-length 20480 --max-prompt-length 2048
)
BATCH_ARGS=(--global-batch-size 512 --max-tokens-per-micro-batch 24576 --pack-sequences --fused-linear-logprob --num-steps 400)
RUN_ARGS=(--log-dir "$RUN_DIR" --save "$RUN_DIR/ckpt" --save-interval 10 --load "$RUN_DIR/ckpt")

torchrun --nnodes "$ACTOR_NODES" --node_rank "$NODE_RANK" --nproc_per_node 8 \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" -m megatron_dapo.train \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}" --wandb-project "${WANDB_PROJECT:-megatron-dapo}"
