#!/usr/bin/env bash
# DAPO's own setting for Qwen2.5-32B (arXiv 2503.14476, Sec. 4.1): prompt batch 512, 16 responses per
# prompt, mini-batch 32 prompts (512 responses), max response 20480 with a 4096 overlong buffer,
# lr 1e-6 warmed up linearly over 20 rollout steps, weight decay 0.1, grad clip 1.0, no KL, no entropy bonus;
# AIME avg@32 at temperature 1.0, top-p 0.7, 20480 tokens (examples/common_dapo_args.sh).
#
# Layout: the actor on ACTOR_NODES nodes (TP 8 x PP 2, DP = 8 x ACTOR_NODES / 16), SGLang servers already
# running on the rollout nodes (started with examples/launch_sglang_servers.sh), weights broadcast to them
# over NCCL after every step. Run this script on every actor node with NODE_RANK set. Servers bound beyond
# loopback need an API key: export the same SGLANG_API_KEY here and for launch_sglang_servers.sh.
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_qwen2.5_32b_multinode.sh [HF_CKPT] [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
# PyTorch allocator: expandable segments, less fragmentation with micro-batches of varying length. One
# hardware queue per GPU: Megatron's sequence-parallel overlap relies on kernels starting in issue order.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
HF_CKPT=${1:-${HF_CKPT:-/models/Qwen2.5-32B}}
RUN_DIR=${2:-runs/qwen2.5-32b-dapo}
ACTOR_NODES=${ACTOR_NODES:-8}
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}" "${SGLANG_URLS:?set SGLANG_URLS}"
source "examples/models/${MODEL:-qwen2.5-32B}.sh"  # MODEL=qwen3-...: another model file (run_qwen3_*.sh)
source examples/common_dapo_args.sh

# Memory (python -m megatron_dapo.train <these flags> --dry-run --world-size 64): sequence parallelism and
# full recompute of 16 of each stage's 32 layers keep stage 0 (two 24k-token micro-batches in flight) at
# ~54 GiB of 80.
PARALLEL_ARGS+=(--sequence-parallel --recompute-granularity full --recompute-method block --recompute-num-layers 16)
source examples/common_multinode.sh
