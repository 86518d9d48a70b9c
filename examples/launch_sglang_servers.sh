#!/usr/bin/env bash
# Start the SGLang servers of one rollout node by hand, for runs that attach with --sglang-server-urls (the per-node
# launchers examples/run_*_multinode.sh; on Slurm, examples/slurm/ runs the same supervisor on every rollout node).
# usage: examples/launch_sglang_servers.sh HF_CKPT [NUM_SERVERS] [TP] [BASE_PORT] [HOST]
#
# It starts `python -m megatron_dapo.launch.rollout_node` in the background (its own session), which starts the
# servers, restarts one that exits (up to MAX_SERVER_RESTARTS=3 times an hour) and stops them all on SIGTERM:
#     kill $(cat ${SGLANG_RUN_DIR:-runs}/rollout-node.pid)
# Logs: ${SGLANG_RUN_DIR:-runs}/sglang_<i>.log and rollout-node.log. Prints the URLs to pass as SGLANG_URLS.
# HOST defaults to 127.0.0.1. SGLang's weight endpoints unpickle what they receive, so a wider bind (0.0.0.0 for a
# trainer on another node) needs an API key: SGLANG_API_KEY_FILE (a 0600 file) or SGLANG_API_KEY in the
# environment; the trainer sends the same key. The key never goes on a command line (every user of the node reads
# those with ps): the servers read it from a 0600 --config file. SGLANG_ALLOW_NO_API_KEY=1 overrides the refusal on
# a trusted network. SGLANG_EXTRA_ARGS: more sglang.launch_server flags (the colocated recipe's
# --mem-fraction-static and --enable-memory-saver; with the latter the servers start without expandable_segments in
# PYTORCH_CUDA_ALLOC_CONF, which torch_memory_saver refuses; a trainer with --moe-routing-replay needs
# --enable-return-routed-experts, which the actor launcher's --dry-run names and the trainer checks when it attaches).
# SGLANG_ROUTER_WORKERS="URL ...": also start sglang-router on BASE_PORT + NUM_SERVERS in front of those servers
# (every rollout node's).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/lib/launch.sh
HF_CKPT=${1:?HF checkpoint directory}
NUM=${2:-2}
TP=${3:-4}
BASE_PORT=${4:-30000}
HOST=${5:-127.0.0.1}
RUN_DIR=${SGLANG_RUN_DIR:-runs}
mkdir -p "$RUN_DIR"
ARGS=(--hf-checkpoint "$HF_CKPT" --sglang-num-servers "$NUM" --sglang-tp-size "$TP" --sglang-base-port "$BASE_PORT"
      --sglang-host "$HOST" "--sglang-extra-args=${SGLANG_EXTRA_ARGS:-}" --sglang-python "${SGLANG_PY:-$PY}"
      --sglang-device "${SGLANG_DEVICE:-cuda}" --max-restarts "${MAX_SERVER_RESTARTS:-3}" --log-dir "$RUN_DIR")
[[ -z "${SGLANG_API_KEY_FILE:-}" ]] || ARGS+=(--sglang-api-key-file "$SGLANG_API_KEY_FILE")
[[ "${SGLANG_ALLOW_NO_API_KEY:-0}" != 1 ]] || ARGS+=(--sglang-allow-no-api-key)
if [[ -n "${SGLANG_ROUTER_WORKERS:-}" ]]; then
    read -r -a WORKERS <<<"$SGLANG_ROUTER_WORKERS"
    ARGS+=(--router-worker-urls "${WORKERS[@]}")
fi
"$PY" -m megatron_dapo.launch.rollout_node "${ARGS[@]}" --check-only  # a refused key or bind fails here, not in a log
setsid "$PY" -m megatron_dapo.launch.rollout_node "${ARGS[@]}" >"$RUN_DIR/rollout-node.log" 2>&1 &
echo $! >"$RUN_DIR/rollout-node.pid"
for ((i = 0; i < NUM; i++)); do echo "http://$(hostname):$((BASE_PORT + i))"; done
