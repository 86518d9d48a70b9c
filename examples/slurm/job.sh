# The body of examples/slurm/split.sbatch and colocated.sbatch, sourced in the repository root with JOB_MODE set.
# Arguments: RECIPE [HF_CKPT] [RUN_DIR] [--dry-run]. The batch script runs on the job's first node (node 0).
#
# 1. The recipe (examples/recipes/RECIPE.sh) gives the run's flags; a GPU recipe in a job without its GPUs ends here
#    (require_gpus). The node list (scontrol show hostnames) and megatron_dapo.launch.roles give every role, URL and
#    port; node 0's address is resolved here; the servers' flags follow from the recipe's (server_flags).
# 2. The memory plan (the trainer's --dry-run, a few seconds): a layout that does not fit ends the job before any
#    server starts. DRY_RUN=1 stops after printing it (outside Slurm: NODES=N names placeholder nodes).
# 3. A fresh API key for this job: $RUN_DIR/slurm-$SLURM_JOB_ID/sglang-api-key, mode 0600 on the shared run
#    directory, read by the servers and the trainer from there, never on a command line; removed when the job ends.
# 4. split: one srun step on the rollout nodes (examples/slurm/rollout_node.sh: the servers, the router, their
#    restarts), then the wait for every server (SERVER_WAIT_S, default 900 s: at 32B a server loads 65.5 GB and
#    answers in 1-3 min; the error names the nodes that did not come up), then one srun step on the actor nodes
#    (examples/slurm/actor_node.sh: torchrun). colocated: one srun step on every node
#    (examples/slurm/colocated_node.sh: the engines, the wait, torchrun).
# 5. Whichever step ends first ends the job: the actor's with exit 0 is a finished run (exit 0), anything else a
#    failure (exit 1). Either way, Slurm then stops every step left on every node (SIGTERM, KillWait, SIGKILL); each
#    node's launcher stops what it started on SIGTERM, so a scancel or a failed node leaves nothing behind,
#    whatever the proctrack plugin. srun --kill-on-bad-exit ends a step when one of its nodes fails.
source examples/lib/launch.sh
launcher_flags "$@"
RECIPE=${POSITIONAL[0]:-}
if [[ -z "$RECIPE" || ! -f "examples/recipes/$RECIPE.sh" ]]; then
    die "usage: sbatch -N NODES examples/slurm/$JOB_MODE.sbatch RECIPE [HF_CKPT] [RUN_DIR]; RECIPE '${RECIPE}' is" \
        "not one of: $(cd examples/recipes && ls -- *.sh | sed 's/\.sh$//' | tr '\n' ' ')"
fi
[[ -z "${POSITIONAL[1]:-}" ]] || HF_CKPT=${POSITIONAL[1]}
[[ -z "${POSITIONAL[2]:-}" ]] || RUN_DIR=${POSITIONAL[2]}
[[ ${#POSITIONAL[@]} -le 3 ]] || die "unexpected arguments: ${POSITIONAL[*]:3}"
source "examples/recipes/$RECIPE.sh"
[[ "$MODE" == "$JOB_MODE" ]] || die "recipe $RECIPE is a $MODE run: submit examples/slurm/$MODE.sbatch"
check_node_counts

# require_gpus: a GPU recipe (SGLANG_DEVICE cuda, the default; the CPU rehearsals' recipes set cpu) in a job that got
# no GPUs would run the trainer on CPU with gloo and fp32 and fail late: refuse it here, naming the line to add. Node
# 0's GPUs: Slurm's count when the job asked for GPUs (SLURM_GPUS_ON_NODE, set by --gpus-per-node and --gres=gpu:N
# alike), else what torch sees there (a cluster where GPUs are no Slurm resource shows them all).
require_gpus() {
    [[ "${SGLANG_DEVICE:-cuda}" != cpu ]] || return 0
    local have=${SLURM_GPUS_ON_NODE:-} how
    if [[ "$have" =~ ^[0-9]+$ ]]; then
        how="SLURM_GPUS_ON_NODE=$have"
    else
        have=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) || have=0
        [[ "$have" =~ ^[0-9]+$ ]] || have=0
        how="the job asked Slurm for no GPU, and torch sees $have on node 0"
    fi
    ((have >= GPUS_PER_NODE)) && return 0
    die "recipe $RECIPE runs $GPUS_PER_NODE GPU ranks a node, but node 0 of this job has $have GPU(s) ($how): the" \
        "trainer would fall back to CPU, gloo and fp32. Add \`#SBATCH --gpus-per-node=$GPUS_PER_NODE\` to" \
        "examples/slurm/$JOB_MODE.sbatch or submit with \`sbatch --gpus-per-node $GPUS_PER_NODE ...\`" \
        "(\`--gres=gpu:$GPUS_PER_NODE\` where your cluster names GPUs so)"
}
[[ -z "${SLURM_JOB_ID:-}" ]] || require_gpus

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    mapfile -t NODE_LIST < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    JOB_ID=$SLURM_JOB_ID
elif [[ "$DRY_RUN" == 1 ]]; then
    if [[ "$MODE" == split ]]; then count=${NODES:-$((ACTOR_NODES + ${ROLLOUT_NODES:-1}))}; else count=${NODES:-$ACTOR_NODES}; fi
    NODE_LIST=()
    for ((i = 0; i < count; i++)); do NODE_LIST+=("$(printf 'node%03d' "$i")"); done
    JOB_ID=dry-run
else
    die "not inside a Slurm job: submit it with sbatch, or print the plan with DRY_RUN=1 NODES=N bash $0 $RECIPE"
fi
[[ "$MODE" == split ]] || ACTOR_NODES=${#NODE_LIST[@]}
# SGLANG_URLS: attach to servers already running (a long-lived rollout fleet): every node of the job is an actor node
ATTACH_URLS=${SGLANG_URLS:-}
ATTACH_ROUTER_URL=${SGLANG_ROUTER_URL:-}
if [[ "$DRY_RUN" == 1 ]]; then MASTER_ADDR=${MASTER_ADDR:-${NODE_LIST[0]}}
else
    # node 0's address; where it resolves to loopback here, its name (the other nodes resolve it, the stores on
    # node 0 listen on every interface)
    [[ -n "${MASTER_ADDR:-}" ]] || MASTER_ADDR=$(node_address "${NODE_LIST[0]}")
    MASTER_ADDR=${MASTER_ADDR:-${NODE_LIST[0]}}
fi
echo "== $RECIPE ($MODE), job $JOB_ID, run directory $RUN_DIR"
roles "${NODE_LIST[@]}"
SERVER_WAIT_S=${SERVER_WAIT_S:-900}
JOB_DIR="$RUN_DIR/slurm-$JOB_ID"
API_KEY_FILE="$JOB_DIR/sglang-api-key"
trainer_args "${SERVER_URLS[@]}"
server_flags  # what the recipe's trainer flags require of every server (--moe-routing-replay: routed experts)
if [[ -n "$ATTACH_URLS" ]]; then echo "== the attached servers must run with: ${SGLANG_SERVER_ARGS:-(no extra flags)}"
else echo "== SGLang servers' extra flags: ${SGLANG_SERVER_ARGS:-(none)}"; fi
echo "== memory plan (the trainer's --dry-run at $WORLD_SIZE ranks)"
if [[ "$DRY_RUN" == 1 ]]; then memory_plan; exit $?; fi
mkdir -p "$JOB_DIR"
memory_plan >"$JOB_DIR/memory-plan.txt" 2>&1 || { cat "$JOB_DIR/memory-plan.txt" >&2; die "the memory plan does not fit (above)"; }
tail -n 1 "$JOB_DIR/memory-plan.txt"

trap 'exit 143' TERM INT  # scancel: exit through the EXIT trap (the key's removal); Slurm stops the steps
if [[ -n "$ATTACH_URLS" ]]; then  # their key, if they have one: a 0600 file the trainer reads
    API_KEY_FILE=${SGLANG_API_KEY_FILE:-}
else
    rm -f "$API_KEY_FILE"
    (umask 077 && "$PY" -c 'import secrets; print(secrets.token_hex(32))' >"$API_KEY_FILE")
    trap 'rm -f "$API_KEY_FILE"' EXIT
fi
trainer_args "${SERVER_URLS[@]}"
# What the node scripts read (srun passes the environment on).
export MASTER_ADDR MASTER_PORT GPUS_PER_NODE API_KEY_FILE JOB_DIR HF_CKPT SGLANG_BASE_PORT
export TRAIN_ENV=${TRAIN_ENV:-} SERVER_WAIT_S PY
# Each a variable of its own, so a value with a space (a SGLANG_PY path) reaches the nodes as one word
# (examples/lib/launch.sh rollout_node_args).
export SGLANG_TP SERVERS_PER_NODE SGLANG_DEVICE=${SGLANG_DEVICE:-cuda} SGLANG_PY=${SGLANG_PY:-$PY}
export MAX_SERVER_RESTARTS=${MAX_SERVER_RESTARTS:-3}
export SGLANG_SERVER_ARGS=${SGLANG_SERVER_ARGS:-} SERVER_URLS_LIST="${SERVER_URLS[*]}" ROUTER_URL
hosts() { local IFS=,; echo "$*"; }

# wait_for_servers [--watch-pid PID]: every server (and the router) answers /health within SERVER_WAIT_S, else exit 1
# naming the nodes that did not.
wait_for_servers() {
    local urls=("${SERVER_URLS[@]}")
    [[ -z "$ROUTER_URL" ]] || urls+=("$ROUTER_URL")
    "$PY" -m megatron_dapo.launch.wait_servers "${urls[@]}" --timeout-s "$SERVER_WAIT_S" "$@" \
        --log-hint "the servers' logs: $JOB_DIR/rollout-<node>.log" || exit 1
}

# step NAME NODE_CSV SCRIPT [ARGS...]: one srun step, one task on each of those nodes, its output in
# $JOB_DIR/NAME-<node>.log; any task failing ends the step on all of its nodes.
step() {
    local name=$1 nodes=$2 count
    shift 2
    count=$(tr ',' '\n' <<<"$nodes" | wc -l)
    srun --nodelist="$nodes" --nodes="$count" --ntasks="$count" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        --output="$JOB_DIR/$name-%N.log" bash "$@"
}

finish() {  # finish RC WHAT: the job's exit, said once
    if [[ $1 == 0 ]]; then echo "== training finished"; else echo "error: $2 ended with exit $1: ending the job on every node" >&2; fi
    exit "$1"
}

if [[ "$MODE" == colocated ]]; then
    echo "== every node: its engines, then its actor ranks (logs: $JOB_DIR/node-<node>.log)"
    rc=0
    step node "$(hosts "${NODE_LIST[@]}")" examples/slurm/colocated_node.sh "${TRAIN_ARGS[@]}" || rc=$?
    finish $rc "a node's step (logs: $JOB_DIR/node-<node>.log)"
fi
if [[ -n "$ATTACH_URLS" ]]; then  # split, the servers already running elsewhere
    wait_for_servers
    echo "== actor nodes: ${ACTOR_HOSTS[*]} (logs: $JOB_DIR/actor-<node>.log)"
    rc=0
    step actor "$(hosts "${ACTOR_HOSTS[@]}")" examples/slurm/actor_node.sh "${TRAIN_ARGS[@]}" || rc=$?
    finish $rc "the actor nodes' step (logs: $JOB_DIR/actor-<node>.log)"
fi
echo "== rollout nodes: ${ROLLOUT_HOSTS[*]} (logs: $JOB_DIR/rollout-<node>.log)"
step rollout "$(hosts "${ROLLOUT_HOSTS[@]}")" examples/slurm/rollout_node.sh &
ROLLOUT_STEP=$!
wait_for_servers --watch-pid "$ROLLOUT_STEP"
echo "== actor nodes: ${ACTOR_HOSTS[*]} (logs: $JOB_DIR/actor-<node>.log)"
step actor "$(hosts "${ACTOR_HOSTS[@]}")" examples/slurm/actor_node.sh "${TRAIN_ARGS[@]}" &
ACTOR_STEP=$!
rc=0
wait -n -p DONE "$ROLLOUT_STEP" "$ACTOR_STEP" || rc=$?
if [[ "$DONE" == "$ACTOR_STEP" ]]; then
    finish $rc "the actor nodes' step (logs: $JOB_DIR/actor-<node>.log)"  # 0: the servers stop with the job
fi
finish $((rc == 0 ? 1 : rc)) "the rollout nodes' step, while training ran (logs: $JOB_DIR/rollout-<node>.log)"
