#!/usr/bin/env bash
# Start SGLang servers on a rollout node for runs that attach with --sglang-server-urls.
# usage: examples/launch_sglang_servers.sh HF_CKPT [NUM_SERVERS] [TP] [BASE_PORT] [HOST]
# Prints the URLs to pass as SGLANG_URLS. Servers log to runs/sglang-<port>.log; stop them with
# `kill $(cat runs/sglang-*.pid)` (their process groups end with them).
set -euo pipefail
cd "$(dirname "$0")/.."
HF_CKPT=${1:?HF checkpoint directory}
NUM=${2:-2}
TP=${3:-4}
BASE_PORT=${4:-30000}
HOST=${5:-0.0.0.0}
mkdir -p runs
for ((i = 0; i < NUM; i++)); do
    port=$((BASE_PORT + i))
    setsid python -m sglang.launch_server --model-path "$HF_CKPT" --host "$HOST" --port "$port" \
        --tp-size "$TP" --base-gpu-id $((i * TP)) --skip-tokenizer-init >"runs/sglang-$port.log" 2>&1 &
    echo $! >"runs/sglang-$port.pid"
    echo "http://$(hostname):$port"
done
