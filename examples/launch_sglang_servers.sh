#!/usr/bin/env bash
# Start SGLang servers on a rollout node for runs that attach with --sglang-server-urls.
# usage: examples/launch_sglang_servers.sh HF_CKPT [NUM_SERVERS] [TP] [BASE_PORT] [HOST]
# HOST defaults to 127.0.0.1. SGLang's weight endpoints unpickle what they receive, so a wider bind (e.g. 0.0.0.0
# for a trainer on another node) needs SGLANG_API_KEY in the environment; the trainer sends the same key (its
# SGLANG_API_KEY or --sglang-api-key-file). The key never goes on a command line, which every user of the node
# can read with ps: the servers read it from ${SGLANG_RUN_DIR:-runs}/sglang-api-key.yaml (mode 0600, SGLang's
# --config), rewritten on every launch; delete it once the servers are up. SGLANG_ALLOW_NO_API_KEY=1 overrides
# the refusal on a trusted network. Prints the URLs to pass as SGLANG_URLS. Servers log to
# ${SGLANG_RUN_DIR:-runs}/sglang-<port>.log; stop them with `kill $(cat runs/sglang-*.pid)` (their process
# groups end with them). SGLANG_EXTRA_ARGS: more sglang.launch_server flags (the colocated launcher's
# --mem-fraction-static and --enable-memory-saver). With --enable-memory-saver the servers start without
# expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (torch_memory_saver refuses it; the
# trainer's launchers set it), the other allocator options kept.
set -euo pipefail
cd "$(dirname "$0")/.."
HF_CKPT=${1:?HF checkpoint directory}
NUM=${2:-2}
TP=${3:-4}
BASE_PORT=${4:-30000}
HOST=${5:-127.0.0.1}
RUN_DIR=${SGLANG_RUN_DIR:-runs}
KEY_ARGS=()
case "$HOST" in
    127.* | localhost | ::1) ;;
    *)
        if [[ -n "${SGLANG_API_KEY:-}" ]]; then
            :
        elif [[ "${SGLANG_ALLOW_NO_API_KEY:-0}" == 1 ]]; then
            echo "warning: SGLang servers on $HOST without an API key (SGLANG_ALLOW_NO_API_KEY=1)" >&2
        else
            echo "refusing to bind SGLang servers to $HOST without an API key: set SGLANG_API_KEY (and pass" \
                "the same key to the trainer), bind 127.0.0.1, or set SGLANG_ALLOW_NO_API_KEY=1" >&2
            exit 2
        fi
        ;;
esac
printable_key() { local LC_ALL=C; [[ $1 =~ ^[!-~]+$ && $1 != -* ]]; }  # a bearer token SGLang's parser takes
read -r -a EXTRA_ARGS <<<"${SGLANG_EXTRA_ARGS:-}"
without_expandable_segments() {  # torch allocator options "k:v,k:v" without expandable_segments:True
    local IFS=, opt opts out=()
    read -r -a opts <<<"$1"
    for opt in "${opts[@]}"; do [[ ${opt// /} == expandable_segments:True ]] || out+=("$opt"); done
    echo "${out[*]}"
}
if [[ " ${EXTRA_ARGS[*]} " == *" --enable-memory-saver "* ]]; then
    for var in PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF; do
        [[ -n "${!var:-}" ]] || continue
        conf=$(without_expandable_segments "${!var}")
        if [[ -n "$conf" ]]; then export "$var=$conf"; else unset "$var"; fi
    done
fi
mkdir -p "$RUN_DIR"
if [[ -n "${SGLANG_API_KEY:-}" ]]; then
    if ! printable_key "$SGLANG_API_KEY"; then
        echo "SGLANG_API_KEY must be printable ASCII without spaces and not start with '-'" >&2
        exit 2
    fi
    KEY_FILE="$RUN_DIR/sglang-api-key.yaml"
    key=${SGLANG_API_KEY//\\/\\\\}
    key=${key//\"/\\\"}
    rm -f "$KEY_FILE"
    # printf is a builtin (no process, no command line); umask 077: the file is created 0600
    (umask 077 && printf '{"api-key": "%s"}\n' "$key" >"$KEY_FILE")
    KEY_ARGS=(--config "$KEY_FILE")
fi
for ((i = 0; i < NUM; i++)); do
    port=$((BASE_PORT + i))
    setsid python -m sglang.launch_server --model-path "$HF_CKPT" --host "$HOST" --port "$port" \
        --tp-size "$TP" --base-gpu-id $((i * TP)) --skip-tokenizer-init --sleep-on-idle "${KEY_ARGS[@]}" "${EXTRA_ARGS[@]}" \
        >"$RUN_DIR/sglang-$port.log" 2>&1 &
    echo $! >"$RUN_DIR/sglang-$port.pid"
    echo "http://$(hostname):$port"
done
