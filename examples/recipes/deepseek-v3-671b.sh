# DAPO's setting (arXiv 2503.14476, Sec. 4.1, examples/common_dapo_args.sh: prompt batch 512 x 16 responses, max
# response 20480 with a 4096 overlong buffer, lr 1e-6) on DeepSeek-V3 (671B, MLA, 256 experts + 1 shared), split: the
# actor on ACTOR_NODES nodes of 8 80 GB GPUs (default 24: 192 GPUs, the fewest the planner fits with the launchers'
# 10% headroom; NeMo-RL's DeepSeek-V3 runs used 512 H100), SGLang servers started apart and attached (SGLANG_URLS,
# below), weights broadcast to them over NCCL after every step. Needs the bf16 checkpoint
# (examples/models/deepseek-v3-671B.sh).
#
# Layout: TP8 with sequence parallelism inside each node for the dense part (128 MLA heads, 16 per GPU; MLA at TP > 1
# needs --sequence-parallel), PP12 with uneven ends (61 layers: 7 on stage 0, which also holds the embedding and 3
# dense layers, 5 on each of stages 1-10, 4 on the last, which also holds the head), DP2; the experts over EP16 x
# ETP1 (16 of each layer's 256 experts per GPU, the all-to-all over the 2 nodes of a stage's EP group) x expert-DP 1
# x PP12. Full recompute of every layer: without it the plan is 221.27 GiB.
#
# Memory (--dry-run --world-size 192): peak 70.34 GiB of 80 (12.1% headroom) on stage 1 (11 micro-batches in
# flight): expert weights 6.56 + grads 13.12 + optimizer 39.38 GiB (5 MoE layers x 16 experts x 3 x 7168 x 2048 = 3.5B
# parameters per GPU, Adam state not sharded: expert-DP 1), dense part 2.46 GiB, kept layer inputs 2.26, recompute
# working set 2.51 and dispatcher buffers 1.97 GiB (the busiest EP rank assumed to receive 2x the mean routed tokens;
# --moe-expert-capacity-factor 1.0: 68.80 GiB). The expert state sets the node count: 654B expert parameters at 18 B
# each (bf16 weight, fp32 grad, fp32 Adam moments + main copy), divided at best over every GPU (EP x ETP x PP = world,
# expert-DP 1): 57.1 GiB a GPU on average at 192 GPUs, before any activation.
# 20 nodes (160 GPUs) plan 81.99 GiB at best (TP8 x PP20 x DP1, EP8: over by 1.99; with --context-parallel-size 2,
# TP8 x PP10 x CP2, EP16, 79.22 GiB: accepted at 80 but 1.0% headroom); 16 nodes do not fit at all (the expert state
# alone is 654B x 18 B / 128 = 85.6 GiB per GPU; 106.31 GiB planned at TP8 x PP16, EP8). With 32 nodes a shallower
# pipeline fits: TP8 x PP4 (--decoder-first-pipeline-num-layers 17 --decoder-last-pipeline-num-layers 14) x DP8,
# EP64: 57.62 GiB (28.0% headroom).
#
# Rank 0 keeps one whole version of the weights in host memory to re-sync a lost server: 1249.88 GiB (the plan's
# host line), so node 0 needs ~1.5 TiB of RAM or more.
MODE=split
MODEL=deepseek-v3-671B
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${ACTOR_NODES:-24}
GPUS_PER_NODE=8
RUN_DIR=${RUN_DIR:-runs/deepseek-v3-671b-dapo}
# The rollout fleet: 671B in bf16 is 1.34 TB, more than the 640 GB of one 8 x 80 GB node, and the launchers start
# servers of one node each (SGLANG_TP must divide GPUS_PER_NODE). Start multi-node servers apart (bf16: SGLang's
# --tp 32 --nnodes 4, 42 GB of weights per GPU; TP16 over 2 nodes would need 84 GB) and attach to them:
#     SGLANG_URLS="http://r0:30000 ..." sbatch -N 24 --gpus-per-node 8 examples/slurm/split.sbatch deepseek-v3-671b
if [[ -z "${SGLANG_URLS:-}" && "$DRY_RUN" != 1 ]]; then
    die "deepseek-v3-671b: 671B in bf16 (1.34 TB) does not fit an SGLang server of one 8-GPU node (640 GB), the only" \
        "kind these launchers start: start multi-node SGLang servers apart (e.g. --tp 32 --nnodes 4) and pass their" \
        "URLs in SGLANG_URLS"
fi
# PyTorch allocator: expandable segments, less fragmentation with micro-batches (and routed token counts) of varying
# size. One hardware queue per GPU, as Megatron-LM's MoE recipes set.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PARALLEL_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
ROLLOUT_ARGS=(--rollout-engine sglang --sglang-max-concurrency 2048 "${DAPO_ROLLOUT_ARGS[@]}")
BATCH_ARGS=("${DAPO_BATCH_ARGS[@]}")
dapo_run_args
# MOE_ROUTING_REPLAY=1: train on the experts the servers routed each token to (--moe-routing-replay, R3); the attached
# servers must then run with --enable-return-routed-experts (the job names the flag). Per token (58 MoE layers x
# top-8): 2,476 B of base64 from the servers, 464 B held by rank 0 as uint8, 1,856 B of each server's KV capacity in
# host memory.
case ${MOE_ROUTING_REPLAY:-0} in
    0) ;;
    1) DAPO_ARGS+=(--moe-routing-replay) ;;
    *) die "MOE_ROUTING_REPLAY must be 0 or 1, got '$MOE_ROUTING_REPLAY'" ;;
esac
