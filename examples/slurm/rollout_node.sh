#!/usr/bin/env bash
# One rollout node of a Slurm job (examples/slurm/job.sh's srun, one task a node): this node's SGLang servers under
# megatron_dapo.launch.rollout_node, which restarts one that exits and stops them all on SIGTERM; the first rollout
# node (SLURM_PROCID 0) also runs the router in front of every node's servers. Bound to 0.0.0.0 with the job's key.
# The arguments: examples/lib/launch.sh rollout_node_args.
set -euo pipefail
source examples/lib/launch.sh
rollout_node_args
args=("${ENGINE_ARGS[@]}")
if [[ "$SLURM_PROCID" == 0 && -n "$ROUTER_URL" ]]; then
    read -r -a workers <<<"$SERVER_URLS_LIST"
    args+=(--router-worker-urls "${workers[@]}")
fi
exec "$PY" -m megatron_dapo.launch.rollout_node "${args[@]}"
