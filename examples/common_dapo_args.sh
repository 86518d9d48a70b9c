# The DAPO recipe (arXiv 2503.14476) as flag arrays shared by the GPU launchers.
DAPO_ARGS=(
    --clip-ratio-low 0.2 --clip-ratio-high 0.28     # Clip-Higher
    --loss-agg-mode token-mean                      # token-level policy gradient loss
    --dynamic-sampling --max-num-gen-batches 10     # drop all-correct / all-wrong groups, refill (<= 10 rounds)
    --overlong-buffer-length 4096 --overlong-penalty-factor 1.0   # soft overlong punishment (Eq. 13), tokens
    --reward-fn math_dapo                           # rule-based verifier, +1 / -1
)
# --lr-warmup-steps counts ROLLOUT steps: rollout step k (1..20) trains all its updates at 1e-6 * k / 20, then
# constant (DAPO Sec. 4.1: 20 rollout steps of 16 optimizer updates each at 512 of 8192 responses).
OPTIM_ARGS=(--lr 1e-6 --lr-warmup-steps 20 --lr-decay-style constant --weight-decay 0.1 --clip-grad 1.0
            --adam-beta1 0.9 --adam-beta2 0.999)
DATA_ARGS=(
    --prompt-data "${PROMPT_DATA:-data/dapo-math-17k-sample512.parquet}"   # the full 17k parquet in production
    --eval-prompt-data data/aime-2024-dapo-format.parquet --eval-interval 10 --n-samples-per-eval-prompt 32
    --eval-temperature 1.0 --eval-top-p 0.7 --eval-max-response-length 20480   # AIME avg@32 (tokens)
)
