# The DAPO recipe (arXiv 2503.14476) as flag arrays shared by the GPU launchers.
DAPO_ARGS=(
    --clip-ratio-low 0.2 --clip-ratio-high 0.28     # Clip-Higher
    --loss-agg-mode token-mean                      # token-level policy gradient loss
    --dynamic-sampling --max-num-gen-batches 10     # drop all-correct / all-wrong groups, refill
    --overlong-buffer-length 4096 --overlong-penalty-factor 1.0   # soft overlong punishment (Eq. 13)
    --reward-fn math_dapo                           # rule-based verifier, +1 / -1
)
OPTIM_ARGS=(--lr 1e-6 --lr-warmup-steps 10 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999)
DATA_ARGS=(
    --prompt-data "${PROMPT_DATA:-data/dapo-math-17k-sample512.parquet}"   # the full 17k parquet in production
    --eval-prompt-data data/aime-2024-dapo-format.parquet --eval-interval 10 --n-samples-per-eval-prompt 32
)
