#!/usr/bin/env bash
# One node of a colocated Slurm job (examples/slurm/job.sh's srun, one task a node): this node's engines under
# megatron_dapo.launch.rollout_node (in the background), the wait until every node's engines answer, then torchrun
# with this node's rank; when torchrun ends, the engines are stopped and its exit code is this script's. On SIGTERM
# (scancel, the job ending) both get it: torchrun passes it to its workers, the supervisor stops the engines.
set -euo pipefail
source examples/lib/launch.sh
rollout_node_args
"$PY" -m megatron_dapo.launch.rollout_node "${ENGINE_ARGS[@]}" &
ENGINES=$!
stop_engines() { kill -TERM "$ENGINES" 2>/dev/null || true; wait "$ENGINES" 2>/dev/null || true; }
trap stop_engines EXIT
read -r -a urls <<<"$SERVER_URLS_LIST"
"$PY" -m megatron_dapo.launch.wait_servers "${urls[@]}" --timeout-s "$SERVER_WAIT_S" --watch-pid "$ENGINES" \
    --log-hint "the engines' logs: $JOB_DIR/sglang-<node>/"
export_weight_sync_addr
torchrun_node "$SLURM_STEP_NUM_NODES" "$SLURM_PROCID"
set +e
"${NODE_CMD[@]}" "$@"
exit $?
