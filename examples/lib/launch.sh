# What every launcher shares: the by-hand per-node launchers (examples/run_*.sh) and the Slurm jobs
# (examples/slurm/*.sbatch) source it after `cd` to the repository root. docs/LAUNCH.md explains the whole path.
#
# A run's flags live in one recipe, examples/recipes/<name>.sh, which every launcher of that setting sources; from
# HF_CKPT and RUN_DIR (when set) it sets:
#   MODE            split (actor nodes + rollout nodes) | colocated (every node both)
#   MODEL           the model file examples/models/<MODEL>.sh it sourced (MODEL_ARGS, PARALLEL_ARGS, SGLANG_TP);
#                   --dry-run plans with examples/models/<MODEL>/config.json when HF_CKPT has no config.json here
#   ACTOR_NODES     nodes running torchrun (split: the first ones; colocated: all); ROLLOUT_NODES (split): the
#                   rollout nodes a by-hand --dry-run shows (under Slurm: every node of the job past the actor's)
#   GPUS_PER_NODE   actor ranks per node (torchrun --nproc_per_node); SERVERS_PER_NODE (optional): SGLang servers
#                   per rollout node, default GPUS_PER_NODE / SGLANG_TP
#   MODEL_ARGS PARALLEL_ARGS ROLLOUT_ARGS DAPO_ARGS OPTIM_ARGS DATA_ARGS BATCH_ARGS RUN_ARGS
#                   the trainer's flags, all but the addresses added here (server URLs, router, weight-sync
#                   master, API key file)
#   ROUTER          1 (default): an sglang-router on the first rollout node in front of every server; 0: none
#   SGLANG_SERVER_ARGS  more sglang.launch_server flags (colocated: --mem-fraction-static --enable-memory-saver);
#                   server_flags adds what the trainer's flags require of every server (--moe-routing-replay:
#                   --enable-return-routed-experts)
#   SGLANG_DEVICE (cuda), SGLANG_PY (the interpreter with sglang; default $PY), TRAIN_ENV (VAR=value words for
#                   the trainer's environment)
#
# Environment every launcher reads: DRY_RUN=1 (or --dry-run among the arguments): print the node roles and the
# memory plan, start nothing; PY (the trainer's interpreter: .venv/bin/python when it exists, else python3);
# TORCHRUN (default: torchrun on PATH, else $PY -m torch.distributed.run).

PY=${PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
DRY_RUN=${DRY_RUN:-0}

# launcher_flags "$@": DRY_RUN=1 when --dry-run is among the arguments; POSITIONAL: the others, in order.
launcher_flags() {
    POSITIONAL=()
    local a
    for a in "$@"; do
        if [[ "$a" == --dry-run ]]; then DRY_RUN=1; else POSITIONAL+=("$a"); fi
    done
}

# launcher_args "$@": launcher_flags, then HF_CKPT and RUN_DIR from the first two other arguments when given (else
# the environment's, else the recipe's defaults).
launcher_args() {
    launcher_flags "$@"
    [[ -z "${POSITIONAL[0]:-}" ]] || HF_CKPT=${POSITIONAL[0]}
    [[ -z "${POSITIONAL[1]:-}" ]] || RUN_DIR=${POSITIONAL[1]}
    [[ ${#POSITIONAL[@]} -le 2 ]] || die "unexpected arguments: ${POSITIONAL[*]:2} (usage: [HF_CKPT] [RUN_DIR] [--dry-run])"
}

die() { echo "error: $*" >&2; exit 2; }

# positive_count NAME WHAT: exit 2 naming NAME unless $NAME is a whole number from 1 to 99999 (WHAT: what it counts),
# then NAME holds its decimal value ("08" -> 8). Checked before any arithmetic reads it: bash evaluates a word there
# as a variable name or an expression ("abc" ends in "unbound variable", "a[\$(cmd)]" runs cmd).
positive_count() {
    local value=${!1:-}
    [[ "$value" =~ ^[0-9]{1,5}$ ]] && ((10#$value > 0)) || die "$1=${value@Q} must be a whole number from 1 to 99999 ($2)"
    printf -v "$1" '%d' "$((10#$value))"
}

# check_node_counts: the recipe's node counts (ACTOR_NODES; ROLLOUT_NODES where set), both from the environment too.
check_node_counts() {
    positive_count ACTOR_NODES "split: the nodes that train; colocated: every node (set from NODES)"
    [[ -z "${ROLLOUT_NODES:-}" ]] || positive_count ROLLOUT_NODES "split: the rollout nodes a plan outside Slurm shows"
}

# NODES: the node count of a DRY_RUN plan outside Slurm, and the colocated recipes' ACTOR_NODES.
[[ -z "${NODES:-}" ]] || positive_count NODES "the job's node count, as sbatch -N takes it"

# torchrun_node NNODES NODE_RANK: NODE_CMD, this node's torchrun of the trainer (TORCHRUN: default torchrun on PATH,
# else $PY -m torch.distributed.run) over NNODES nodes, GPUS_PER_NODE ranks each, rendezvous at MASTER_ADDR; the
# caller appends the trainer's arguments and runs (or execs) it.
torchrun_node() {
    local launcher
    if [[ -n "${TORCHRUN:-}" ]]; then read -r -a launcher <<<"$TORCHRUN"
    elif command -v torchrun >/dev/null 2>&1; then launcher=(torchrun)
    else launcher=("$PY" -m torch.distributed.run); fi
    NODE_CMD=(env ${TRAIN_ENV:-} "${launcher[@]}" --nnodes "$1" --node_rank "$2" --nproc_per_node "$GPUS_PER_NODE"
              --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m megatron_dapo.train)
}

# export_weight_sync_addr: where this node's pipeline-stage source ranks open their weight-sync groups, its address
# on the cluster network (MEGATRON_DAPO_WEIGHT_SYNC_ADDR); left to the trainer (weight_sync/stage_sync.py) when the
# hostname resolves to loopback here.
export_weight_sync_addr() {
    MEGATRON_DAPO_WEIGHT_SYNC_ADDR=${MEGATRON_DAPO_WEIGHT_SYNC_ADDR:-$(node_address "$(hostname)")}
    if [[ -n "$MEGATRON_DAPO_WEIGHT_SYNC_ADDR" ]]; then export MEGATRON_DAPO_WEIGHT_SYNC_ADDR
    else unset MEGATRON_DAPO_WEIGHT_SYNC_ADDR; fi
}

# node_address NAME: NAME's IPv4 address as this host resolves it, or nothing when it resolves to none or to loopback
# (Debian's `127.0.1.1 <hostname>` line): other nodes could not reach a rendezvous or weight-sync store there.
node_address() {
    local addr
    addr=$(getent ahostsv4 "$1" 2>/dev/null | awk 'NR == 1 {print $1}')
    [[ -z "$addr" || "$addr" == 127.* ]] || echo "$addr"
}

# roles NODE...: evaluates megatron_dapo.launch.roles' shell assignments (ACTOR_HOSTS, ROLLOUT_HOSTS, SERVER_URLS,
# ROUTER_URL, WORLD_SIZE, SERVERS_PER_NODE) and prints its table.
roles() {
    local args=(--mode "$MODE" --nodes "$@" --actor-nodes "$ACTOR_NODES" --gpus-per-node "$GPUS_PER_NODE"
                --sglang-tp "$SGLANG_TP" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
                --weight-sync-port "$WEIGHT_SYNC_PORT" --sglang-base-port "$SGLANG_BASE_PORT")
    [[ -z "${SERVERS_PER_NODE:-}" ]] || args+=(--servers-per-node "$SERVERS_PER_NODE")
    [[ "${ROUTER:-1}" == 1 ]] || args+=(--no-router)
    if [[ -n "${ATTACH_URLS:-}" ]]; then  # servers already running (split.sbatch with SGLANG_URLS)
        local attach
        read -r -a attach <<<"$ATTACH_URLS"
        args+=(--attach-urls "${attach[@]}")
        [[ -z "${ATTACH_ROUTER_URL:-}" ]] || args+=(--attach-router-url "$ATTACH_ROUTER_URL")
    fi
    local shell
    shell=$("$PY" -m megatron_dapo.launch.roles "${args[@]}" --format shell) || exit 2
    eval "$shell"
    "$PY" -m megatron_dapo.launch.roles "${args[@]}" --format table
}

# trainer_args URL...: TRAIN_ARGS, the trainer's whole command line after `-m megatron_dapo.train`: the recipe's
# arrays plus the servers (URL..., in global order), ROUTER_URL, the weight-sync master (split) and the key file.
trainer_args() {
    local attach=(--sglang-server-urls "$@")
    if [[ "$MODE" == split ]]; then
        [[ -z "${ROUTER_URL:-}" ]] || attach+=(--sglang-router-url "$ROUTER_URL")
        attach+=(--weight-sync-mode distributed --weight-sync-master-addr "$MASTER_ADDR"
                 --weight-sync-master-port "$WEIGHT_SYNC_PORT")
    fi
    [[ -z "${API_KEY_FILE:-}" ]] || attach+=(--sglang-api-key-file "$API_KEY_FILE")
    # the trainer waits for a lost server as long as the job waits for one to start (a restart is a start)
    [[ -z "${SERVER_WAIT_S:-}" ]] || attach+=(--sglang-server-wait-s "$SERVER_WAIT_S")
    TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${attach[@]}" "${DAPO_ARGS[@]}"
                "${OPTIM_ARGS[@]}" "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}")
}

# server_flags: SGLANG_SERVER_ARGS completed with the sglang.launch_server flags the recipe's trainer flags require of
# every server, each added once (python -m megatron_dapo.launch.server_args, the rule the trainer applies to the
# servers it launches itself: --enable-return-routed-experts with --moe-routing-replay). Exit 2 when they do not parse.
server_flags() {
    SGLANG_SERVER_ARGS=$("$PY" -m megatron_dapo.launch.server_args "--server-args=${SGLANG_SERVER_ARGS:-}" -- \
        "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" "${OPTIM_ARGS[@]}" \
        "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}") || exit 2
}

# memory_plan: the trainer's --dry-run for TRAIN_ARGS at WORLD_SIZE ranks (reads only config.json; exit 1 when the
# plan does not fit). HF_CKPT without a config.json on this host: the recipe's examples/models/<MODEL>/.
memory_plan() {
    local args=("${TRAIN_ARGS[@]}") i
    if [[ ! -f "$HF_CKPT/config.json" ]]; then
        [[ -f "examples/models/$MODEL/config.json" ]] || die "no config.json in $HF_CKPT to plan with"
        echo "(planning with examples/models/$MODEL/config.json: $HF_CKPT/config.json is not on this host)"
        for i in "${!args[@]}"; do [[ "${args[$i]}" != --hf-checkpoint ]] || args[i + 1]="examples/models/$MODEL"; done
    fi
    "$PY" -m megatron_dapo.train "${args[@]}" --dry-run --world-size "$WORLD_SIZE"
}

# rollout_node_args: ENGINE_ARGS, this node's `python -m megatron_dapo.launch.rollout_node` arguments in a Slurm step
# (examples/slurm/rollout_node.sh, colocated_node.sh), from what examples/slurm/job.sh exports; each value stays one
# word whatever it holds (a SGLANG_PY, HF_CKPT or run directory with a space). The servers' flags go as
# --sglang-extra-args=VALUE: argparse takes a lone "--enable-return-routed-experts" after a space for an option of
# its own.
rollout_node_args() {
    ENGINE_ARGS=(--hf-checkpoint "$HF_CKPT" --sglang-tp-size "$SGLANG_TP" --sglang-num-servers "$SERVERS_PER_NODE"
                 --sglang-device "$SGLANG_DEVICE" --sglang-python "$SGLANG_PY" --max-restarts "$MAX_SERVER_RESTARTS"
                 --sglang-base-port "$SGLANG_BASE_PORT" --sglang-host 0.0.0.0 --sglang-api-key-file "$API_KEY_FILE"
                 "--sglang-extra-args=$SGLANG_SERVER_ARGS" --sglang-server-wait-s "$SERVER_WAIT_S"
                 --log-dir "$JOB_DIR/sglang-$(hostname)")
}

# The ports every launcher derives the same way (override any of them in the environment).
MASTER_PORT=${MASTER_PORT:-29500}
WEIGHT_SYNC_PORT=${WEIGHT_SYNC_PORT:-29650}
SGLANG_BASE_PORT=${SGLANG_BASE_PORT:-30000}

# actor_node_by_hand: the per-node launchers' end (examples/run_*_multinode.sh, colocated.sh): this node's torchrun
# with NODE_RANK, MASTER_ADDR and SGLANG_URLS (every server, space-separated; SGLANG_ROUTER_URL optional) from the
# environment, the API key from SGLANG_API_KEY or SGLANG_API_KEY_FILE. DRY_RUN=1: the roles and the memory plan.
actor_node_by_hand() {
    local nodes=() i
    check_node_counts
    for ((i = 0; i < ACTOR_NODES; i++)); do nodes+=("actor$i"); done
    if [[ "$MODE" == split ]]; then
        for ((i = 0; i < ${ROLLOUT_NODES:-1}; i++)); do nodes+=("rollout$i"); done
    fi
    if [[ "$DRY_RUN" == 1 ]]; then
        MASTER_ADDR=${MASTER_ADDR:-actor0}
        roles "${nodes[@]}"
        local urls=("${SERVER_URLS[@]}")
        [[ -z "${SGLANG_URLS:-}" ]] || read -r -a urls <<<"$SGLANG_URLS"
        ROUTER_URL=${SGLANG_ROUTER_URL:-$ROUTER_URL}
        trainer_args "${urls[@]}"
        server_flags
        if [[ "$MODE" == split && -n "${SGLANG_SERVER_ARGS:-}" ]]; then  # started apart, on each rollout node
            echo "SGLang servers' extra flags: $SGLANG_SERVER_ARGS (start them with" \
                 "SGLANG_EXTRA_ARGS=\"$SGLANG_SERVER_ARGS\" examples/launch_sglang_servers.sh)"
        else echo "SGLang servers' extra flags: ${SGLANG_SERVER_ARGS:-(none)}"; fi
        memory_plan
        exit $?
    fi
    : "${NODE_RANK:?set NODE_RANK (this node's rank among the ACTOR_NODES=$ACTOR_NODES actor nodes)}"
    : "${MASTER_ADDR:?set MASTER_ADDR (node 0's address)}" "${SGLANG_URLS:?set SGLANG_URLS (every server URL)}"
    local urls
    read -r -a urls <<<"$SGLANG_URLS"
    ROUTER_URL=${SGLANG_ROUTER_URL:-}
    API_KEY_FILE=${SGLANG_API_KEY_FILE:-}
    trainer_args "${urls[@]}"
    torchrun_node "$ACTOR_NODES" "$NODE_RANK"
    exec "${NODE_CMD[@]}" "${TRAIN_ARGS[@]}"
}
