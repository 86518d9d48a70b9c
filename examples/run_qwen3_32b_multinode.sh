#!/usr/bin/env bash
# DAPO's 32B setting with Qwen3-32B's model file (examples/recipes/qwen3-32b.sh), launched by hand on every actor
# node as examples/run_qwen2.5_32b_multinode.sh. On Slurm:
#     sbatch -N 16 --gpus-per-node 8 examples/slurm/split.sbatch qwen3-32b /models/Qwen3-32B
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_qwen3_32b_multinode.sh [HF_CKPT] [RUN_DIR]        (DRY_RUN=1 or --dry-run: the plan)
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/qwen3-32b.sh
actor_node_by_hand
