#!/usr/bin/env bash
# DAPO's setting on Moonlight-16B-A3B at its 8k context (examples/recipes/moonlight-16b-a3b.sh: EP 8 per node, ~47 GiB
# of 80 planned), launched by hand on every actor node as examples/run_qwen2.5_32b_multinode.sh. On Slurm:
#     sbatch -N 4 --gpus-per-node 8 examples/slurm/split.sbatch moonlight-16b-a3b /models/Moonlight-16B-A3B
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_moonlight_16b_a3b_multinode.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run: the plan)
# ACTOR_NODES (2) from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/moonlight-16b-a3b.sh
actor_node_by_hand
