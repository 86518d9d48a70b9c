#!/usr/bin/env bash
# A CPU rehearsal of the 32B multi-node launcher's code path (examples/run_qwen2.5_32b_multinode.sh): attach
# mode (--sglang-server-urls) to two real CPU SGLang servers started here (server 1 at SGLang TP 2) behind an
# sglang-router (--sglang-router-url), --weight-sync-mode distributed over gloo, the DAPO flags of
# examples/common_dapo_args.sh, and the actor at TP 2 x PP 2 x DP 2 (8 gloo ranks) on a tiny Qwen2 (hidden 32,
# 4 heads / 2 kv heads, 2 layers). Once step 1 is logged, server 0's process group gets kill -9 and this script,
# playing the cluster's supervisor, restarts it at once. A restarted CPU server takes 60+ s to answer while a
# tiny step takes seconds (at 32B: 1-3 min against a 20-45 min step), so the step that sees the kill holds its
# scoring until the server answers again (tests/rewards.py:length_parity_held); the engine finds it restarted
# before that step's weight update, leaves it out of the update's group and re-syncs it. At the end it checks: NUM_STEPS steps logged, the loss, the return and the
# re-sync counted (rollout/servers_lost, rollout/server_returns, sync/servers_recovered), rollout-vs-actor
# mismatch small in every step, no NaN, and the two servers give the same log-probs for one sequence (the
# restarted one holds the current weights).
#
# MOE=1: the MoE variant of examples/run_qwen3_30b_a3b_multinode.sh's code path instead: a tiny all-MoE Qwen3-MoE
# (8 experts, top-2; made here from the tiny base's tokenizer) on one real SGLang server, the actor at EP 2 x DP 2
# (2 gloo ranks), distributed weight sync of the per-expert HF names, no router and no kill (a restarted CPU
# server alone costs 60+ s); 2 steps. It checks the same metrics, and that the server moved from the base.
#
# usage: examples/rehearse_multinode.sh [RUN_DIR]     (needs .venv and .venv-sglang: `make sglang-env`)
# Env: NUM_STEPS (3; MoE 2), ACTOR_TP (2; MoE 1), ACTOR_PP (2; MoE 1), ACTOR_EP (1; MoE 2), NPROC (8; MoE 2),
# NUM_SERVERS (2; MoE 1), SERVER1_TP (2), ROUTER (1; MoE 0), BASE_PORT (31400), KILL (1: kill a server; MoE 0),
# MOE (0), TINY_BASE (a tiny base made by an earlier run, reused instead of made again).
# Every process it starts is stopped by pid (process group) on exit; their pids are in $RUN_DIR/pids.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/rehearsal}
MOE=${MOE:-0}
if [[ "$MOE" == 1 ]]; then
    : "${NUM_STEPS:=2}" "${ACTOR_TP:=1}" "${ACTOR_PP:=1}" "${ACTOR_EP:=2}" "${NPROC:=2}" "${NUM_SERVERS:=1}"
    : "${ROUTER:=0}" "${KILL:=0}"
fi
NUM_STEPS=${NUM_STEPS:-3}
ACTOR_TP=${ACTOR_TP:-2}
ACTOR_PP=${ACTOR_PP:-2}
ACTOR_EP=${ACTOR_EP:-1}
NPROC=${NPROC:-8}
NUM_SERVERS=${NUM_SERVERS:-2}
SERVER1_TP=${SERVER1_TP:-2}
ROUTER=${ROUTER:-1}
BASE_PORT=${BASE_PORT:-31400}
KILL=${KILL:-1}
PY=${PY:-.venv/bin/python}
SGL_PY=${SGL_PY:-.venv-sglang/bin/python}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
[[ -x "$SGL_PY" ]] || { echo "no $SGL_PY: run \`make sglang-env\`" >&2; exit 2; }
T0=$(date +%s)
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"

PIDS=()  # process-group leaders (setsid): servers, router, the supervisor, torchrun; also in $RUN_DIR/pids
track() { PIDS+=("$1"); echo "$1" >>"$RUN_DIR/pids"; }
cleanup() {
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

BASE=${TINY_BASE:-$RUN_DIR/base}
if [[ -z "${TINY_BASE:-}" ]]; then
    echo "== tiny Qwen2 (hidden 32, 4 heads / 2 kv heads, 2 layers) in $BASE"
    "$PY" tools/make_tiny_base.py --out "$BASE" --sft-steps 20 --num-train 300 --num-eval 16 \
        --hidden-size 32 --ffn-hidden-size 64 --num-heads 4 --num-kv-heads 2 --num-layers 2 --sft-batch-size 16 \
        >"$RUN_DIR/make_tiny_base.log" 2>&1
fi
MODEL="$BASE/model"
if [[ "$MOE" == 1 ]]; then
    # A tiny all-MoE Qwen3-MoE (every layer MoE: SGLang 0.5.23 serves no mixed layout) with the base's tokenizer,
    # random weights (routers drawn N(0, 0.2): HF's zero init would tie every route), saved with HF's per-expert names.
    echo "== tiny Qwen3-MoE (hidden 32, 2 layers, 8 experts top-2 of width 16) in $RUN_DIR/moe-model"
    "$PY" - "$MODEL" "$RUN_DIR/moe-model" <<'PY' >"$RUN_DIR/make_moe.log" 2>&1
import json, shutil, sys
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

base, out = Path(sys.argv[1]), Path(sys.argv[2])
dense = json.loads((base / "config.json").read_text())
torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=dense["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                        router_aux_loss_coef=0.001, max_position_embeddings=dense["max_position_embeddings"],
                        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        bos_token_id=dense.get("bos_token_id"), eos_token_id=dense.get("eos_token_id"),
                        pad_token_id=dense.get("pad_token_id"))
model = Qwen3MoeForCausalLM(config).float()
with torch.no_grad():
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight") or ".experts." in name:
            param.normal_(0.0, 0.2)
model.save_pretrained(out)
for f in base.iterdir():  # the tokenizer and generation config
    if f.is_file() and f.name not in ("config.json", "model.safetensors"):
        shutil.copy(f, out / f.name)
print("saved", out, sum(p.numel() for p in model.parameters()), "parameters")
PY
    MODEL="$RUN_DIR/moe-model"
fi

# The CPU form of examples/launch_sglang_servers.sh's command (megatron_dapo/rollout/sglang/server.py,
# shared/notes/sglang-on-cpu.md), bound to 127.0.0.1. At TP 2 SGLang's CPU backend binds one core per rank.
start_server() {  # i tp -> starts server i on BASE_PORT + i, records its pid in $RUN_DIR/sglang-i.pid
    local i=$1 tp=$2 bind=()
    [[ "$tp" == 2 ]] && bind=(env "SGLANG_CPU_OMP_THREADS_BIND=0|1")
    SGLANG_USE_CPU_ENGINE=1 setsid "${bind[@]}" "$SGL_PY" -m sglang.launch_server --model-path "$MODEL" \
        --host 127.0.0.1 --port $((BASE_PORT + i)) --tp-size "$tp" --skip-tokenizer-init --device cpu \
        --attention-backend torch_native --disable-cuda-graph --max-total-tokens 8192 --mem-fraction-static 0.1 \
        --dtype float32 --sleep-on-idle >>"$RUN_DIR/sglang-$i.log" 2>&1 &
    echo $! >"$RUN_DIR/sglang-$i.pid"
    track $!
}
wait_healthy() {  # url timeout_s
    local deadline=$(($(date +%s) + $2))
    until curl -sf "$1/health" >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || { echo "$1 not healthy after $2 s" >&2; return 1; }
        sleep 1
    done
}
URLS=("http://127.0.0.1:$BASE_PORT")
if [[ "$NUM_SERVERS" == 1 ]]; then
    echo "== SGLang server 0 at TP 1"
    start_server 0 1
else
    echo "== SGLang servers: 0 at TP 1, 1 at TP $SERVER1_TP"
    start_server 0 1
    start_server 1 "$SERVER1_TP"
    URLS+=("http://127.0.0.1:$((BASE_PORT + 1))")
fi
ROUTER_ARGS=()
if [[ "$ROUTER" == 1 ]]; then  # as a cluster runs it in front of the rollout nodes' servers
    for u in "${URLS[@]}"; do wait_healthy "$u" 300; done
    echo "   healthy after $(($(date +%s) - T0)) s"
    ROUTER_URL="http://127.0.0.1:$((BASE_PORT + 2))"
    setsid "$SGL_PY" -m sglang_router.launch_router --host 127.0.0.1 --port $((BASE_PORT + 2)) \
        --policy round_robin --worker-urls "${URLS[@]}" >"$RUN_DIR/router.log" 2>&1 &
    track $!
    wait_healthy "$ROUTER_URL" 120
    ROUTER_ARGS=(--sglang-router-url "$ROUTER_URL")
    echo "== router at $ROUTER_URL, healthy after $(($(date +%s) - T0)) s"
fi  # without a router the trainer starts next to the servers' start-up and waits for them (--sglang-server-wait-s)

# The supervisor: kill -9 server 0 once step 1 is logged, have it restarted at once (by this shell, below), and
# mark it "back" once it answers /health: length_parity_held holds the scoring in between. The trainer finds it
# restarted (its weight version) at the next update and re-syncs it; the supervisor marks that "resynced" from
# the log line, and the step after the return holds its scoring until then (so the counts land in its metrics).
export REHEARSAL_HOLD_DIR="$RUN_DIR"
if [[ "$KILL" == 1 ]]; then
    setsid bash -c '
        until [[ -f "$0/metrics.jsonl" ]] && grep -q "\"step\": 1[,}]" "$0/metrics.jsonl"; do sleep 0.5; done
        pid=$(cat "$0/sglang-0.pid"); kill -KILL -- "-$pid"
        echo "$(date +%s.%N) killed server 0 (pid $pid)" >>"$0/supervisor.log"; touch "$0/killed"
        until curl -sf "$1/health" >/dev/null 2>&1; do sleep 0.5; done
        echo "$(date +%s.%N) server 0 back" >>"$0/supervisor.log"; touch "$0/back"
        until grep -q "lost: back after .* re-synced to weight version" "$0/train.log" 2>/dev/null; do sleep 0.5; done
        echo "$(date +%s.%N) server 0 re-synced" >>"$0/supervisor.log"; touch "$0/resynced"' "$RUN_DIR" "${URLS[0]}" &
    track $!
fi

source examples/common_dapo_args.sh
# The launcher's arrays at tiny scale: same flags, sizes that fit hidden 32 / 128 positions / 2 cores.
MODEL_ARGS=(--hf-checkpoint "$MODEL")
PARALLEL_ARGS=(--tensor-model-parallel-size "$ACTOR_TP" --pipeline-model-parallel-size "$ACTOR_PP" --use-distributed-optimizer
               ${EXTRA_PARALLEL_ARGS:-})
[[ "$ACTOR_EP" == 1 ]] || PARALLEL_ARGS+=(--expert-model-parallel-size "$ACTOR_EP")
ROLLOUT_ARGS=(
    --rollout-engine sglang --sglang-server-urls "${URLS[@]}" "${ROUTER_ARGS[@]}" --sglang-max-concurrency 64
    --sglang-server-wait-s 300
    --weight-sync-mode distributed --weight-sync-master-addr 127.0.0.1 --weight-sync-master-port $((BASE_PORT + 50))
    --rollout-batch-size 4 --n-samples-per-prompt 4 --over-sample-factor 1.3
    --rollout-temperature 1.0 --max-response-length 40 --max-prompt-length 16
)
# The tiny model answers no sum right (every group all wrong, nothing for dynamic sampling to keep): the
# rehearsal rewards the response length's parity instead (tests/rewards.py), so groups differ and weights move.
DAPO_ARGS+=(--overlong-buffer-length 8 --reward-fn tests.rewards:length_parity_held --on-gen-exhausted partial)
DATA_ARGS=(--prompt-data "$BASE/train.jsonl")
OPTIM_ARGS+=(--lr 1e-4 --lr-warmup-steps 1)
BATCH_ARGS=(--global-batch-size 16 --max-tokens-per-micro-batch 256 ${EXTRA_BATCH_ARGS:-}
            --num-steps "$NUM_STEPS")
RUN_ARGS=(--log-dir "$RUN_DIR" --no-wandb --no-progress --seed 7)

echo "== torchrun: $NPROC ranks (TP $ACTOR_TP x PP $ACTOR_PP, EP $ACTOR_EP), $NUM_STEPS steps"
setsid "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port $((BASE_PORT + 60)) \
    -m megatron_dapo.train "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${DAPO_ARGS[@]}" \
    "${OPTIM_ARGS[@]}" "${DATA_ARGS[@]}" "${BATCH_ARGS[@]}" "${RUN_ARGS[@]}" >"$RUN_DIR/train.log" 2>&1 &
TRAIN=$!
track $TRAIN
if [[ "$KILL" == 1 ]]; then
    # The restart runs from this shell, so that cleanup knows the new pid.
    while kill -0 "$TRAIN" 2>/dev/null && [[ ! -f "$RUN_DIR/killed" ]]; do sleep 0.5; done
    if [[ -f "$RUN_DIR/killed" ]]; then
        echo "== supervisor: $(cat "$RUN_DIR/supervisor.log"); restarting it"
        start_server 0 1
    fi
fi
rc=0
wait "$TRAIN" || rc=$?
WALL=$(($(date +%s) - T0))
if [[ $rc != 0 ]]; then
    tail -n 40 "$RUN_DIR/train.log" >&2
    echo "rehearsal FAILED: torchrun exit $rc after $WALL s (logs in $RUN_DIR)" >&2
    exit 1
fi
"$PY" - "$RUN_DIR/metrics.jsonl" "$NUM_STEPS" "$KILL" "$WALL" "$MODEL" "${URLS[@]}" <<'PY'
import json
import math
import sys

import httpx
import torch
from transformers import AutoModelForCausalLM

records = [json.loads(line) for line in open(sys.argv[1])]
num_steps, kill, wall, model_dir, urls = int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5], sys.argv[6:]
for r in records:
    print(f"step {r['step']}: sync {r['time/sync_s']:.2f} s, rollout {r['time/rollout_s']:.1f} s, "
          f"train {r['time/train_s']:.1f} s, mismatch {r['mismatch/logprob_abs_diff_mean']:.2e}, "
          f"servers_lost {r['rollout/servers_lost']:.0f}, returns {r['rollout/server_returns']:.0f}, "
          f"recovered {r['sync/servers_recovered']:.0f}, retried {r['rollout/retried_requests']:.0f}")
total = {k: sum(r[k] for r in records) for k in ("rollout/servers_lost", "rollout/server_returns",
                                                 "sync/servers_recovered")}
errors = []
if [r["step"] for r in records] != list(range(1, num_steps + 1)):
    errors.append(f"steps logged {[r['step'] for r in records]}, expected 1..{num_steps}")
if kill and not (total["rollout/servers_lost"] >= 1 and total["rollout/server_returns"] >= 1
                 and total["sync/servers_recovered"] >= 1):
    errors.append(f"the killed server's loss and return are not in the metrics: {total}")
worst = max(r["mismatch/logprob_abs_diff_mean"] for r in records)
if worst > 1e-3:
    errors.append(f"rollout-vs-actor log-prob mismatch {worst:.2e} > 1e-3: a server serves stale weights")
nan = [(r["step"], k) for r in records for k, v in r.items() if isinstance(v, float) and math.isnan(v)]
if nan:
    errors.append(f"NaN in the metrics: {nan[:5]}")
# The same 24 token ids scored by each server (the last weights pushed) and by the base checkpoint (HF): the
# restarted server must agree with the other one, and both must have moved away from the base.
ids = [(7 * i + 3) % 80 for i in range(24)]
body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": 0}
served = [torch.tensor([lp for lp, _, _ in httpx.post(f"{u}/generate", json=body, timeout=60).json()
                        ["meta_info"]["input_token_logprobs"][1:]]) for u in urls]
with torch.no_grad():
    logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(
        torch.tensor([ids])).logits[0, :-1].double()
base = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].float()
between, moved = (served[0] - served[-1]).abs().max().item(), (served[-1] - base).abs().max().item()
if len(served) > 1:
    print(f"log-probs of one sequence: server 0 vs server 1 max |diff| {between:.2e}, vs the base checkpoint "
          f"{moved:.2e}")
else:
    print(f"log-probs of one sequence: server 0 vs the base checkpoint max |diff| {moved:.2e}")
if not between < 1e-4 or not moved > 10 * max(between, 1e-6):
    errors.append(f"servers disagree ({between:.2e}) or did not move from the base ({moved:.2e})")
print(f"rehearsal wall time {wall} s; recovery totals {total}; worst mismatch {worst:.2e}")
if errors:
    sys.exit("rehearsal FAILED: " + "; ".join(errors))
print("rehearsal OK")
PY
