#!/usr/bin/env bash
# DAPO with a Python interpreter on CPU (docs/TOOL_USE.md): the tool task, with the tool and without it.
#
# 1. tools/make_tiny_base.py --task tool builds a tiny Qwen2 (2 layers, hidden 128, char tokenizer with backticks)
#    warmed up on products of 3-digit numbers ("482*937="): half its warm-up answers call the tool
#    (```python print(482*937) ```, the output block, "Answer: 451634"), the rest guess (ReTool's cold start);
#    1500 SFT steps, ~6 min on 2 cores. Its samples call the tool ~1/3 of the time, right ~0.28 with the tool, 0 without.
# 2. DAPO trains it twice from the same base and seed: with --tool-template code_fence (each sample a conversation:
#    a call runs in the sandbox, its output is appended and masked out of the loss) and without (a call gets no
#    output). Held-out avg@4 and the tool-call rate every 5 steps; tools/plot_tool_demo.py draws both runs.
#    On 2 cores: the tool arm ~40-100 s a step (a step runs ~1,000-2,000 sandboxed calls at ~33 ms of CPU each),
#    the other ~22 s; the result is in docs/TOOL_USE.md.
#
# usage: examples/run_tool_demo.sh [OUT_DIR] [BASE_DIR] [NUM_STEPS]
set -euo pipefail

ROLLOUT_ARGS=(
    --rollout-engine embedded --rollout-batch-size 16 --n-samples-per-prompt 8 --over-sample-factor 1.5
    --rollout-temperature 1.0 --max-response-length 72 --max-num-gen-batches 4 --on-gen-exhausted partial
    --max-prompt-length 16
)
TOOL_ARGS=(--tool-template code_fence --max-turns 2 --tool-output-max-chars 64 --tool-timeout-s 5 --tool-cpu-s 2)
DAPO_ARGS=(
    --clip-ratio-low 0.2 --clip-ratio-high 0.28 --loss-agg-mode token-mean --dynamic-sampling
    --overlong-buffer-length 8 --overlong-penalty-factor 1.0 --reward-fn math_dapo
)
OPTIM_ARGS=(--lr 5e-4 --lr-warmup-steps 3 --weight-decay 0.0 --clip-grad 1.0 --global-batch-size 64 --seed 1234)
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: only the arrays above
    return 0
fi

cd "$(dirname "$0")/.."

OUT_DIR=${1:-runs/tool-demo}
BASE_DIR=${2:-runs/tool-base}
NUM_STEPS=${3:-20}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

if [ ! -f "$BASE_DIR/model/config.json" ]; then
    echo "== building the tool task's base policy in $BASE_DIR"
    "$PY" tools/make_tiny_base.py --task tool --out "$BASE_DIR"
fi
rm -rf "$OUT_DIR"
COMMON=(--hf-checkpoint "$BASE_DIR/model" --prompt-data "$BASE_DIR/train.jsonl"
        --eval-prompt-data "$BASE_DIR/eval.jsonl" --eval-interval 5 --n-samples-per-eval-prompt 4
        --eval-max-prompts 100 --num-steps "$NUM_STEPS" --no-wandb)

for arm in tool no-tool; do
    extra=()
    [ "$arm" = tool ] && extra=("${TOOL_ARGS[@]}")
    echo "== DAPO $arm: $OUT_DIR/$arm"
    "$PY" -m megatron_dapo.train "${COMMON[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}" \
        "${extra[@]}" --log-dir "$OUT_DIR/$arm"
done

"$PY" tools/plot_tool_demo.py "$OUT_DIR/tool/metrics.jsonl" "$OUT_DIR/no-tool/metrics.jsonl" \
    -o "$OUT_DIR/tool_demo.png"
