# DAPO's setting (arXiv 2503.14476, Sec. 4.1, examples/common_dapo_args.sh: prompt batch 512 x 16 responses, lr 1e-6,
# 24k-token packed micro-batches) on Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA, 64 experts + 2 shared), at the
# model's 8192-token context (below: responses up to 6144, not 20480). Split: the actor on ACTOR_NODES nodes of 8 80 GB
# GPUs (default 2), SGLang servers (TP 2: 16 GB of weights per GPU, the rest KV cache) on the other nodes of the job
# (default 2: a 4-node job), weights broadcast to them over NCCL after every step.
#
# Layout, per 8-GPU node: TP1 x PP1 for the dense part (hidden 2048, 16 MLA heads: TP would only shrink narrow GEMMs,
# and MLA at TP > 1 needs --sequence-parallel), EP8 for the experts: each GPU holds 8 of each layer's 64 experts, the
# token all-to-all stays on the node's NVLink; the expert grid ETP1 x EP8 x expert-DP (= ACTOR_NODES) x PP1 spans the
# same ranks as TP1 x DP 8 x ACTOR_NODES (a 1408-wide expert is too narrow to split over ETP). Full recompute of every
# layer: without it the plan is 230.85 GiB (26 dropless MoE layers of a 24k-token micro-batch keep 5.8 GiB each).
#
# Memory (--dry-run --world-size 16): 46.71 GiB of 80 (41.6% headroom): expert weights 3.35 + grads 6.70 + optimizer
# 10.05 (sharded over the 2 expert-DP replicas) GiB, dense part 9.84 GiB (1.57B parameters, 0.67B of them the 163840
# x 2048 embedding and head), recompute working set, kept layer inputs, dispatcher buffers and the fused head 14.77
# GiB, assuming the busiest EP rank receives 2x the mean routed tokens (dropless; --moe-expert-capacity-factor 1.0:
# 42.71 GiB). Memory does not set the node count: one actor node (expert-DP 1, 20.11 GiB of expert Adam state) plans
# 57.86 GiB (27.7% headroom), so ACTOR_NODES=1 ROLLOUT_NODES=1 is a 2-node job; 4 actor nodes plan 41.14 GiB. Below
# one node nothing fits: 4 GPUs at EP4 plan 90.21 GiB (over by 10.21), one node at EP2 88.03 GiB. The defaults split
# the job evenly: generation (512 x 16 responses a step, more with dynamic sampling) and training both take time.
MODE=split
MODEL=moonlight-16B-A3B
source "examples/models/$MODEL.sh"
source examples/common_dapo_args.sh
ACTOR_NODES=${ACTOR_NODES:-2}
ROLLOUT_NODES=${ROLLOUT_NODES:-2}
GPUS_PER_NODE=8
RUN_DIR=${RUN_DIR:-runs/moonlight-16b-a3b-dapo}
# PyTorch allocator: expandable segments, less fragmentation with micro-batches (and routed token counts) of varying
# size. One hardware queue per GPU, as Megatron-LM's MoE recipes set.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
PARALLEL_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
# Moonlight's context is 8192 positions (max_position_embeddings; plain RoPE, no scaling): DAPO's 2048 + 20480 would
# run past it (the trainer refuses that without --allow-exceed-context; the servers serve 8192 positions). Responses
# up to 6144 tokens instead, the soft overlong buffer scaled with them (DAPO's 4096 of 20480 is 1/5: 1229, rounded
# down to 1024), AIME evaluated at the same 6144. Later flags win: these override examples/common_dapo_args.sh's.
ROLLOUT_ARGS=(--rollout-engine sglang --sglang-max-concurrency 2048 "${DAPO_ROLLOUT_ARGS[@]}"
              --max-response-length 6144)
DAPO_ARGS+=(--overlong-buffer-length 1024)
DATA_ARGS+=(--eval-max-response-length 6144)
BATCH_ARGS=("${DAPO_BATCH_ARGS[@]}")
dapo_run_args
# MOE_ROUTING_REPLAY=1: train on the experts the servers routed each token to (--moe-routing-replay, R3); every
# launcher then starts the servers with --enable-return-routed-experts (examples/lib/launch.sh server_flags). Per token
# (26 MoE layers x top-6): 832 B of base64 from the servers, 156 B held by rank 0 as uint8, 624 B of each server's KV
# capacity in host memory (rollout/sglang/engine.py ClientConfig.routing, rollout/sglang/server.py).
case ${MOE_ROUTING_REPLAY:-0} in
    0) ;;
    1) DAPO_ARGS+=(--moe-routing-replay) ;;
    *) die "MOE_ROUTING_REPLAY must be 0 or 1, got '$MOE_ROUTING_REPLAY'" ;;
esac
