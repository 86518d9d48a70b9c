# The DAPO recipe (arXiv 2503.14476) as flag arrays shared by the GPU launchers.
DAPO_ARGS=(
    --clip-ratio-low 0.2 --clip-ratio-high 0.28     # Clip-Higher
    --loss-agg-mode token-mean                      # token-level policy gradient loss
    --dynamic-sampling                              # drop all-correct / all-wrong groups, refill
    --overlong-buffer-length 4096 --overlong-penalty-factor 1.0   # soft overlong punishment (Eq. 13), tokens
    --reward-fn math_dapo                           # rule-based verifier, +1 / -1
)
# MAX_STALENESS=K (unset: synchronous): the fully async rollout, every trained token at most K weight versions old
# (docs/ASYNC.md; not with --colocate). It has no generation rounds to bound.
if [[ -n "${MAX_STALENESS:-}" ]]; then
    DAPO_ARGS+=(--max-staleness "$MAX_STALENESS")
else
    DAPO_ARGS+=(--max-num-gen-batches 10)           # refill at most 10 rounds a step
fi
# TOOL_TEMPLATE=qwen (unset: single-turn): every sample a conversation with the sandboxed Python interpreter
# (docs/TOOL_USE.md; ReTool's setting: Qwen2.5-Instruct's <tool_call> format, up to 8 calls). The sandbox runs on
# global rank 0's host, --tool-workers programs at once; not with MAX_STALENESS (refused at start-up).
if [[ -n "${TOOL_TEMPLATE:-}" ]]; then
    DAPO_ARGS+=(--tool-template "$TOOL_TEMPLATE" --max-turns 9 --tool-output-max-chars 1024 --tool-workers 16
                --tool-cpu-s 5 --tool-timeout-s 10 --tool-memory-mib 1024)
fi
# --lr-warmup-steps counts ROLLOUT steps: rollout step k (1..20) trains all its updates at 1e-6 * k / 20, then
# constant (DAPO Sec. 4.1: 20 rollout steps of 16 optimizer updates each at 512 of 8192 responses).
OPTIM_ARGS=(--lr 1e-6 --lr-warmup-steps 20 --lr-decay-style constant --weight-decay 0.1 --clip-grad 1.0
            --adam-beta1 0.9 --adam-beta2 0.999)
DATA_ARGS=(
    --prompt-data "${PROMPT_DATA:-data/dapo-math-17k-sample512.parquet}"   # the full 17k parquet in production
    --eval-prompt-data data/aime-2024-dapo-format.parquet --eval-interval 10 --n-samples-per-eval-prompt 32
    --eval-temperature 1.0 --eval-top-p 0.7 --eval-max-response-length 20480   # AIME avg@32 (tokens)
)
# DAPO's scale (Sec. 4.1) for the multi-node recipes: 512 prompts x 16 responses a step (1.3x over-sampled for
# dynamic sampling), responses up to 20480 tokens, trained as one global batch in 24k-token packed micro-batches;
# checkpoints every 10 steps, resumed from on restart; each written by all DP replicas at once
# (--ckpt-fully-parallel-save: ~14 s instead of ~29 s at 32B, so the save of a SIGTERM fits
# --exit-save-timeout-s 25 under Slurm's 30 s KillWait; docs/FAULT_TOLERANCE.md).
DAPO_ROLLOUT_ARGS=(--rollout-batch-size 512 --n-samples-per-prompt 16 --over-sample-factor 1.3
                   --rollout-temperature 1.0 --max-response-length 20480 --max-prompt-length 2048)
DAPO_BATCH_ARGS=(--global-batch-size 512 --max-tokens-per-micro-batch 24576 --pack-sequences --fused-linear-logprob
                 --num-steps 400)
dapo_run_args() {  # RUN_ARGS for RUN_DIR: logs, checkpoints every 10 steps, resume from the latest
    RUN_ARGS=(--log-dir "$RUN_DIR" --save "$RUN_DIR/ckpt" --save-interval 10 --load "$RUN_DIR/ckpt"
              --ckpt-fully-parallel-save --wandb-project "${WANDB_PROJECT:-megatron-dapo}")
}
