# DAPO's own setting (arXiv 2503.14476, Sec. 4.1, examples/common_dapo_args.sh: prompt batch 512 x 16 responses,
# max response 20480 with a 4096 overlong buffer, lr 1e-6) on Qwen3-30B-A3B (mixture of experts), split: the actor on
# ACTOR_NODES nodes of 8 80 GB GPUs (default 4: 32 GPUs, the size of NeMo-RL's Qwen3-30B-A3B row), SGLang servers
# (TP 4) on the other nodes of the job, weights broadcast to them over NCCL after every step.
#
# Layout, per 8-GPU node: TP 1 x PP 1 for the dense part (attention of hidden 2048 is 0.9B parameters: TP would only
# shrink GEMMs that are already narrow), EP 8 for the experts: each GPU holds 16 of each layer's 128 experts, the
# token all-to-all stays on the node's NVLink, and the expert grid ETP 1 x EP 8 x expert-DP (= 4 x ACTOR_NODES / 4)
# x PP 1 spans the same ranks as TP 1 x DP 32 (an expert's 768-wide linears are too small to split over ETP). Full
# recompute of every layer: one 24k-token micro-batch of a dropless MoE layer keeps ~6 GiB for backward, 48 layers
# of it would not fit; kept inputs are 4.5 GiB.
#
# Memory (--dry-run --world-size 32): ~58 GiB of 80 (27% headroom): expert weights 6.75 + grads 13.5 + optimizer
# 10.1 (sharded over the 4 expert-DP replicas, not the 32 DP ranks) GiB, dense part 9.2 GiB, recompute working set
# and dispatcher buffers 10.7 GiB assuming the busiest EP rank receives 2x the mean routed tokens (dropless;
# --moe-expert-capacity-factor caps it). The expert Adam state is what sets the node count: ACTOR_NODES=2 plans
# 68.8 GiB (14.0% headroom), 8 nodes 52.8 GiB; one node (expert-DP 1, 40.5 GiB of expert Adam state per GPU) plans
# 90.1 GiB and does not fit.
MODE=split
MODEL=qwen3-30B-A3B
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${ACTOR_NODES:-4}
ROLLOUT_NODES=${ROLLOUT_NODES:-4}
GPUS_PER_NODE=8
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b-dapo}
# PyTorch allocator: expandable segments, less fragmentation with micro-batches (and routed token counts) of varying
# size. One hardware queue per GPU, as Megatron-LM's MoE recipes set.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PARALLEL_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
ROLLOUT_ARGS=(--rollout-engine sglang --sglang-max-concurrency 2048 "${DAPO_ROLLOUT_ARGS[@]}")
BATCH_ARGS=("${DAPO_BATCH_ARGS[@]}")
dapo_run_args
# MOE_ROUTING_REPLAY=1: train on the experts the servers routed each token to (--moe-routing-replay, R3); every
# launcher then starts the servers with --enable-return-routed-experts (examples/lib/launch.sh server_flags). Its cost
# per step: 2,048 B a token of base64 from the servers, ~92 GB parsed by rank 0, 17.2 GB of routes held there as
# uint8 (rollout/sglang/engine.py ClientConfig.routing); each server keeps 1,536 B a token of its KV cache's
# capacity in host memory (rollout/sglang/server.py ServerConfig.return_routed_experts).
case ${MOE_ROUTING_REPLAY:-0} in
    0) ;;
    1) DAPO_ARGS+=(--moe-routing-replay) ;;
    *) die "MOE_ROUTING_REPLAY must be 0 or 1, got '$MOE_ROUTING_REPLAY'" ;;
esac
