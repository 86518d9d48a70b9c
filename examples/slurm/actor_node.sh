#!/usr/bin/env bash
# One actor node of a Slurm job (examples/slurm/job.sh's srun, one task a node): torchrun with this node's rank
# (SLURM_PROCID) over the step's nodes, the trainer's arguments as given.
set -euo pipefail
source examples/lib/launch.sh
export_weight_sync_addr
torchrun_node "$SLURM_STEP_NUM_NODES" "$SLURM_PROCID"
exec "${NODE_CMD[@]}" "$@"
