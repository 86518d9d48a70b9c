# The CPU rehearsal (docs/REHEARSAL.md; tests/slurm/test_slurm_rehearsal.py): the 32B split recipe's code path at a size two
# CPU cores run, submitted with examples/slurm/split.sbatch to a real Slurm cluster (tools/slurm_cluster.py). Two
# actor nodes of 2 gloo ranks (TP 2 x PP 2: each node one pipeline stage, the 32B layout's shape) on a tiny Qwen2
# (HF_CKPT, made by tools/make_tiny_base.py), a rollout node with two real CPU SGLang servers (.venv-sglang) behind
# the router, distributed weight sync over gloo from both stages' nodes, the DAPO flags of
# examples/common_dapo_args.sh with sizes that fit.
#
# The tiny model answers no sum right (every group all wrong, nothing for dynamic sampling to keep): the rehearsal
# rewards the response length's parity instead (tests/rewards.py), which also holds a step's scoring while a killed
# server comes back ($REHEARSAL_HOLD_DIR). PROMPT_DATA: the tiny base's train.jsonl (default: next to HF_CKPT).
# NUM_STEPS (3), ACTOR_TP (2), ACTOR_PP (2), ACTOR_NODES (2), RANKS_PER_NODE (2), MAX_STALENESS (unset: synchronous;
# examples/common_dapo_args.sh) from the environment.
MODE=split
MODEL=qwen2.5-0.5B  # the family's model file; HF_CKPT (required) is the tiny model
: "${HF_CKPT:?set HF_CKPT to the tiny model (tools/make_tiny_base.py --out DIR: DIR/model)}"
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${ACTOR_NODES:-2}
ROLLOUT_NODES=1
GPUS_PER_NODE=${RANKS_PER_NODE:-2}  # gloo ranks per actor node
SGLANG_TP=1
SERVERS_PER_NODE=2
SGLANG_DEVICE=cpu
SGLANG_PY=${SGLANG_PY:-.venv-sglang/bin/python}
RUN_DIR=${RUN_DIR:-runs/cpu-rehearsal}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
PARALLEL_ARGS=(--tensor-model-parallel-size "${ACTOR_TP:-2}" --pipeline-model-parallel-size "${ACTOR_PP:-2}"
               --use-distributed-optimizer)
SERVER_WAIT_S=${SERVER_WAIT_S:-300}
ROLLOUT_ARGS=(--rollout-engine sglang --sglang-max-concurrency 64 --rollout-batch-size 4 --n-samples-per-prompt 4 --over-sample-factor 1.3
              --rollout-temperature 1.0 --max-response-length 40 --max-prompt-length 16)
DAPO_ARGS+=(--overlong-buffer-length 8 --reward-fn tests.rewards:length_parity_held --on-gen-exhausted partial)
DATA_ARGS=(--prompt-data "${PROMPT_DATA:-$(dirname "$HF_CKPT")/train.jsonl}")
OPTIM_ARGS+=(--lr 1e-4 --lr-warmup-steps 1)
BATCH_ARGS=(--global-batch-size 16 --max-tokens-per-micro-batch 256 --num-steps "${NUM_STEPS:-3}")
RUN_ARGS=(--log-dir "$RUN_DIR" --no-wandb --no-progress --seed 7)
