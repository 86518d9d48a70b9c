#!/usr/bin/env bash
# DAPO's own setting for Qwen2.5-32B (examples/recipes/qwen2.5-32b.sh) launched by hand, one actor node at a time:
# the SGLang servers already run on the rollout nodes (examples/launch_sglang_servers.sh on each), and this script
# runs on every actor node with NODE_RANK set. On Slurm one line does all of it instead:
#     sbatch -N 16 --gpus-per-node 8 examples/slurm/split.sbatch qwen2.5-32b /models/Qwen2.5-32B
# Servers bound beyond loopback need an API key: the same SGLANG_API_KEY (or SGLANG_API_KEY_FILE) here and for
# launch_sglang_servers.sh.
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_qwen2.5_32b_multinode.sh [HF_CKPT] [RUN_DIR]
#        DRY_RUN=1 examples/run_qwen2.5_32b_multinode.sh   (or --dry-run: the node roles and the memory plan)
# ACTOR_NODES (8) and MODEL (qwen2.5-32B; qwen3-32B: run_qwen3_32b_multinode.sh) come from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/qwen2.5-32b.sh
actor_node_by_hand
