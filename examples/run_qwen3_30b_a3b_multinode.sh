#!/usr/bin/env bash
# DAPO's setting on Qwen3-30B-A3B (examples/recipes/qwen3-30b-a3b.sh: EP 8 per node, ~58 GiB of 80 planned), launched
# by hand on every actor node as examples/run_qwen2.5_32b_multinode.sh. On Slurm:
#     sbatch -N 8 --gpus-per-node 8 examples/slurm/split.sbatch qwen3-30b-a3b /models/Qwen3-30B-A3B
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_qwen3_30b_a3b_multinode.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run: the plan)
# ACTOR_NODES (4) from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/qwen3-30b-a3b.sh
actor_node_by_hand
