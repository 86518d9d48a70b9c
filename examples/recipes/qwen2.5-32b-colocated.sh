# DAPO's own setting for Qwen2.5-32B (the flags of examples/recipes/qwen2.5-32b.sh) in colocated (hybrid) mode, as
# DAPO ran it: 16 nodes x 8 GPUs, every GPU both an actor rank (TP 8 x PP 2, DP 8) and a shard of an SGLang engine
# (--rollout-num-gpus-per-engine 4: two engines per node, 32 in all). Every step the two take turns
# (megatron_dapo/trainer/colocate.py): SGLang releases its weights and KV cache for training, the actor offloads
# grads and optimizer state for generation. docs/PARALLELISM.md "Colocate or split" says when to use it.
#
# Memory (--dry-run --world-size 128): training as the split recipe's plan (DP 8 instead of 4: smaller optimizer
# shards) plus what the released engine keeps; generation: the actor's bf16 weights and context, SGLang's weights +
# KV cache (--mem-fraction-static, the planner's value; tests/unit/planner/test_planner.py checks that it is the computed one) and
# its runtime. Both phases under 90% of 80 GB; a --save checkpoint is written in the training phase (the plan's
# save rows: 18.3 GiB per GPU). The engines start with --enable-memory-saver so that release/resume
# frees GPU memory (without expandable segments in their allocator options: torch_memory_saver refuses them).
MODE=colocated
MODEL=qwen2.5-32B
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${NODES:-16}
GPUS_PER_NODE=8
RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b-dapo-colocated}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PARALLEL_ARGS+=(--sequence-parallel --recompute-granularity full --recompute-method block --recompute-num-layers 16)
MEM_FRACTION_STATIC=0.77
SGLANG_SERVER_ARGS="--mem-fraction-static $MEM_FRACTION_STATIC --enable-memory-saver"
ROLLOUT_ARGS=(--rollout-engine sglang --colocate --sglang-max-concurrency 2048 --rollout-num-gpus-per-engine "$SGLANG_TP"
              --mem-fraction-static "$MEM_FRACTION_STATIC" "${DAPO_ROLLOUT_ARGS[@]}")
BATCH_ARGS=("${DAPO_BATCH_ARGS[@]}")
dapo_run_args
