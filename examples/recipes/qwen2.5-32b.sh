# DAPO's own setting for Qwen2.5-32B (arXiv 2503.14476, Sec. 4.1), split: the actor on ACTOR_NODES nodes (TP 8 x
# PP 2, DP = 8 x ACTOR_NODES / 16), SGLang servers (TP 4, two a node) on the other nodes of the job behind a router,
# weights broadcast to them over NCCL after every step. Prompt batch 512 x 16 responses, max response 20480 with a
# 4096 overlong buffer, lr 1e-6 warmed up over 20 rollout steps, weight decay 0.1, grad clip 1.0, no KL, no
# entropy bonus; AIME avg@32 at temperature 1.0, top-p 0.7 (examples/common_dapo_args.sh).
#
# Memory (DRY_RUN=1 of any launcher of it; --dry-run --world-size 64): sequence parallelism and full recompute of
# 16 of each stage's 32 layers keep stage 0 (two 24k-token micro-batches in flight) at ~54 GiB of 80.
# Launched by examples/slurm/split.sbatch (`sbatch -N 16 ... qwen2.5-32b`: 8 actor + 8 rollout nodes, 128 GPUs as
# DAPO ran it) or by hand on each actor node with examples/run_qwen2.5_32b_multinode.sh. MODEL=qwen3-32B: the same
# setting for Qwen3-32B (examples/recipes/qwen3-32b.sh).
MODE=split
MODEL=${MODEL:-qwen2.5-32B}
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${ACTOR_NODES:-8}
ROLLOUT_NODES=${ROLLOUT_NODES:-8}
GPUS_PER_NODE=8
RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b-dapo}
# PyTorch allocator: expandable segments, less fragmentation with micro-batches of varying length. One hardware
# queue per GPU: Megatron's sequence-parallel overlap relies on kernels starting in issue order.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PARALLEL_ARGS+=(--sequence-parallel --recompute-granularity full --recompute-method block --recompute-num-layers 16)
ROLLOUT_ARGS=(--rollout-engine sglang --sglang-max-concurrency 2048 "${DAPO_ROLLOUT_ARGS[@]}")
BATCH_ARGS=("${DAPO_BATCH_ARGS[@]}")
dapo_run_args
