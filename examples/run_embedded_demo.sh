#!/usr/bin/env bash
# The embedded default (`make demo`): DAPO on CPU with real megatron-core and the embedded rollout engine.
#
# 1. tools/make_tiny_base.py builds a tiny Qwen2 (2 layers, hidden 128, char tokenizer) and warms it up on
#    two-digit addition with worked column sums but a final "Answer:" that is right only 30% of the time.
# 2. DAPO (Clip-Higher, dynamic sampling, token-mean loss, overlong shaping, the math verifier) trains it;
#    held-out avg@4 is measured every 10 steps. Curves: $RUN_DIR/report.png, numbers: $RUN_DIR/metrics.jsonl.
#
# usage: examples/run_embedded_demo.sh [RUN_DIR] [BASE_DIR] [NUM_STEPS]
#   NPROC=2 examples/run_embedded_demo.sh   # the same run on 2 gloo processes (data parallel)
set -euo pipefail

ROLLOUT_ARGS=(
    --rollout-engine embedded --rollout-batch-size 16 --n-samples-per-prompt 8 --over-sample-factor 1.5
    --rollout-temperature 1.0 --max-response-length 40 --max-num-gen-batches 16 --on-gen-exhausted partial
    --max-prompt-length 16  # prompts are 6 characters; prompt + response must fit the tiny model's 128 positions
)
DAPO_ARGS=(
    --clip-ratio-low 0.2 --clip-ratio-high 0.28 --loss-agg-mode token-mean --dynamic-sampling
    --overlong-buffer-length 8 --overlong-penalty-factor 1.0 --reward-fn math_dapo
)
# 16 prompts x 8 responses = 128 per step in 2 mini-batches of 64: the second update is off-policy (clipped).
# --lr-warmup-steps counts rollout steps: steps 1, 2, 3 train at 1/3, 2/3, 3/3 of --lr.
OPTIM_ARGS=(--lr 5e-4 --lr-warmup-steps 3 --weight-decay 0.0 --clip-grad 1.0 --global-batch-size 64 --seed 1234)
# Sourced, the script only defines the arrays above: tools/golden_curve.py reads its flags from them (one source
# for the demo and its golden curve).
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    return 0
fi

cd "$(dirname "$0")/.."

RUN_DIR=${1:-runs/demo}
BASE_DIR=${2:-runs/tiny-base}
NUM_STEPS=${3:-60}
NPROC=${NPROC:-1}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

if [ ! -f "$BASE_DIR/model/config.json" ]; then
    echo "== building the tiny base policy in $BASE_DIR"
    "$PY" tools/make_tiny_base.py --out "$BASE_DIR"
fi
rm -rf "$RUN_DIR"

MODEL_ARGS=(--hf-checkpoint "$BASE_DIR/model")
DATA_ARGS=(
    --prompt-data "$BASE_DIR/train.jsonl"
    --eval-prompt-data "$BASE_DIR/eval.jsonl" --eval-interval 10 --n-samples-per-eval-prompt 4
    --eval-max-prompts 200
)
RUN_ARGS=(--num-steps "$NUM_STEPS" --log-dir "$RUN_DIR" --save "$RUN_DIR/ckpt" --save-interval 30
          --export-hf "$RUN_DIR/hf")

if [ "$NPROC" -gt 1 ]; then
    LAUNCH=("$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port 29517)
else
    LAUNCH=("$PY")
fi
echo "== DAPO on $NPROC process(es): $RUN_DIR"
"${LAUNCH[@]}" -m megatron_dapo.train "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
    "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}" "${RUN_ARGS[@]}"

echo "== the exported HF policy on the held-out sums (tools/eval.py, any engine)"
"$PY" tools/eval.py --model "$RUN_DIR/hf" --data "$BASE_DIR/eval.jsonl" --k 4 --eval-max-response-length 40 \
    --output "$RUN_DIR/eval_hf.json" >/dev/null

"$PY" - "$RUN_DIR/metrics.jsonl" "$BASE_DIR/base_report.json" "$RUN_DIR/eval_hf.json" <<'PY'
import json, sys
from megatron_dapo.trainer.metrics_log import read_metrics
records = [r for r in read_metrics(sys.argv[1]) if "eval/avg@4" in r]
base = json.load(open(sys.argv[2]))
first, last = records[0], records[-1]
exported = json.load(open(sys.argv[3]))
print(f"held-out avg@4: {first['eval/avg@4']:.3f} (step {first['step']}) -> {last['eval/avg@4']:.3f} "
      f"(step {last['step']}); exported HF policy avg@4 {exported['avg@4']:.3f}; "
      f"base model greedy accuracy {base['eval_accuracy_greedy']:.3f}")
PY
