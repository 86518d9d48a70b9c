#!/usr/bin/env bash
# One actor node of a Slurm job (examples/slurm/job.sh's srun, one task a node): torchrun with this node's rank
# (SLURM_PROCID) over the step's nodes, the trainer's arguments as given.
set -euo pipefail
source examples/lib/launch.sh
torchrun_cmd
# where this node's pipeline-stage source ranks open their weight-sync groups: its address on the cluster network
# (left to the trainer, weight_sync/stage_sync.py, when the hostname resolves to loopback here)
MEGATRON_DAPO_WEIGHT_SYNC_ADDR=${MEGATRON_DAPO_WEIGHT_SYNC_ADDR:-$(node_address "$(hostname)")}
[[ -z "$MEGATRON_DAPO_WEIGHT_SYNC_ADDR" ]] && unset MEGATRON_DAPO_WEIGHT_SYNC_ADDR || export MEGATRON_DAPO_WEIGHT_SYNC_ADDR
exec env ${TRAIN_ENV:-} "${TORCHRUN_CMD[@]}" --nnodes "$SLURM_STEP_NUM_NODES" --node_rank "$SLURM_PROCID" \
    --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m megatron_dapo.train "$@"
