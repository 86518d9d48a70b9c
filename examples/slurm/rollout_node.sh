#!/usr/bin/env bash
# One rollout node of a Slurm job (examples/slurm/job.sh's srun, one task a node): this node's SGLang servers under
# megatron_dapo.launch.rollout_node, which restarts one that exits and stops them all on SIGTERM; the first rollout
# node (SLURM_PROCID 0) also runs the router in front of every node's servers. Bound to 0.0.0.0 with the job's key.
# The servers' flags go as --sglang-extra-args=VALUE: argparse takes a lone "--enable-return-routed-experts" after
# a space for an option of its own.
set -euo pipefail
read -r -a node_args <<<"$SGLANG_NODE_ARGS"
args=(--hf-checkpoint "$HF_CKPT" "${node_args[@]}" --sglang-base-port "$SGLANG_BASE_PORT" --sglang-host 0.0.0.0
      --sglang-api-key-file "$API_KEY_FILE" "--sglang-extra-args=$SGLANG_SERVER_ARGS"
      --sglang-server-wait-s "$SERVER_WAIT_S" --log-dir "$JOB_DIR/sglang-$(hostname)")
if [[ "$SLURM_PROCID" == 0 && -n "$ROUTER_URL" ]]; then
    read -r -a workers <<<"$SERVER_URLS_LIST"
    args+=(--router-worker-urls "${workers[@]}")
fi
exec "$PY" -m megatron_dapo.launch.rollout_node "${args[@]}"
