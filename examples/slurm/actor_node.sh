#!/usr/bin/env bash
# One actor node of a Slurm job (examples/slurm/job.sh's srun, one task a node): torchrun with this node's rank
# (SLURM_PROCID) over the step's nodes, the trainer's arguments as given. Its weight-sync address (the pipeline
# stages' source ranks on this node open their groups here) is this node's address on the cluster network.
set -euo pipefail
source examples/lib/launch.sh
torchrun_cmd
MEGATRON_DAPO_WEIGHT_SYNC_ADDR=${MEGATRON_DAPO_WEIGHT_SYNC_ADDR:-$(node_address "$(hostname)")}
export MEGATRON_DAPO_WEIGHT_SYNC_ADDR
exec env ${TRAIN_ENV:-} "${TORCHRUN_CMD[@]}" --nnodes "$SLURM_STEP_NUM_NODES" --node_rank "$SLURM_PROCID" \
    --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m megatron_dapo.train "$@"
