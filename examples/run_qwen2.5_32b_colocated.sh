#!/usr/bin/env bash
# DAPO's own setting for Qwen2.5-32B in colocated (hybrid) mode (examples/recipes/qwen2.5-32b-colocated.sh: 16 nodes x
# 8 GPUs, every GPU an actor rank and a shard of an SGLang engine), launched by hand on every node. Each node starts
# its own two engines on its own GPUs (examples/launch_sglang_servers.sh with the recipe's --mem-fraction-static and
# --enable-memory-saver; LAUNCH_ENGINES=0 skips that), then its actor ranks. SGLANG_URLS lists all 32 engines in
# global rank order: node 0's two, node 1's two, ... Engines bound beyond loopback need SGLANG_API_KEY or
# SGLANG_API_KEY_FILE. On Slurm one line does all of it:
#     sbatch -N 16 --gpus-per-node 8 examples/slurm/colocated.sbatch qwen2.5-32b-colocated /models/Qwen2.5-32B
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://n0:30000 http://n0:30001 http://n1:30000 ..." \
#        examples/run_qwen2.5_32b_colocated.sh [HF_CKPT] [RUN_DIR]     (DRY_RUN=1 or --dry-run: the plan)
# NODES (16) from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/qwen2.5-32b-colocated.sh
if [[ "$DRY_RUN" != 1 && "${LAUNCH_ENGINES:-1}" == 1 ]]; then
    server_flags  # the recipe's, and what its trainer flags require of every engine
    SGLANG_RUN_DIR="$RUN_DIR/sglang" SGLANG_EXTRA_ARGS="$SGLANG_SERVER_ARGS" \
        examples/launch_sglang_servers.sh "$HF_CKPT" "$((GPUS_PER_NODE / SGLANG_TP))" "$SGLANG_TP" "$SGLANG_BASE_PORT" \
        "${SGLANG_HOST:-0.0.0.0}"
fi
actor_node_by_hand
