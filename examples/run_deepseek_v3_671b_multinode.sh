#!/usr/bin/env bash
# DAPO's setting on DeepSeek-V3 671B in bf16 (examples/recipes/deepseek-v3-671b.sh: TP8 x PP12 x EP16 over 24 actor
# nodes, ~70 GiB of 80 planned), launched by hand on every actor node as examples/run_qwen2.5_32b_multinode.sh, the
# SGLang servers (multi-node: the model does not fit one 8-GPU node) started apart. On Slurm, attached to them:
#     SGLANG_URLS="http://r0:30000 ..." sbatch -N 24 --gpus-per-node 8 examples/slurm/split.sbatch deepseek-v3-671b \
#         /models/DeepSeek-V3-bf16
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 ..." \
#        examples/run_deepseek_v3_671b_multinode.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run: the plan)
# ACTOR_NODES (24) from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
launcher_args "$@"
source examples/recipes/deepseek-v3-671b.sh
actor_node_by_hand
