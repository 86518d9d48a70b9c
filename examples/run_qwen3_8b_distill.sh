#!/usr/bin/env bash
# On-policy distillation of Qwen3-8B from a Qwen3-235B-A22B teacher served apart (--teacher-url), on one 8-GPU node:
# run_qwen3_8b_single_node.sh's layout (the student at TP 4 + SP on GPUs 0-3, its two rollout servers at TP 2 on
# GPUs 4-7) and the teacher on SGLang servers of its own. The student trains on the teacher's per-token reverse KL
# added to DAPO's advantage (--distill-coef; docs/ALGORITHMS.md "On-policy distillation").
#
# The teacher: its 470 GB of bf16 weights fit one 8 x 80 GB node at TP 8 with ~15 GB a GPU left for the KV cache of
# the prefills; two such nodes halve the scoring time. On each teacher node:
#     SGLANG_API_KEY_FILE=/secrets/teacher.key examples/launch_sglang_servers.sh /models/Qwen3-235B-A22B 1 8 30000 0.0.0.0
# then here: TEACHER_URLS="http://t0:30000 http://t1:30000" TEACHER_API_KEY_FILE=/secrets/teacher.key.
# At start-up the trainer checks the teacher's tokenizer against the student's: launch_sglang_servers.sh starts
# servers with --skip-tokenizer-init, so the servers' tokenizer directory (/models/Qwen3-235B-A22B) must be readable
# on this node too (a shared file system), or start the teacher with sglang.launch_server yourself, tokenizer loaded.
#
# Per step (--dry-run prints it): 1,024 scoring requests (64 prompts x 16), one prefill each of up to 10,240 tokens,
# from the student's one data-parallel replica, at most --teacher-max-concurrency (64) in flight.
#
# usage: TEACHER_URLS="URL ..." examples/run_qwen3_8b_distill.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run)
set -euo pipefail
HERE="$(dirname "$0")"
[[ -n "${TEACHER_URLS:-}" ]] || { echo "error: TEACHER_URLS is not set: the teacher's SGLang server URLs" \
                                      "(see the top of $0)" >&2; exit 2; }
read -r -a urls <<<"$TEACHER_URLS"
EXTRA=(--teacher-url "${urls[@]}" --distill-coef "${DISTILL_COEF:-1}")
[[ -z "${TEACHER_API_KEY_FILE:-}" ]] || EXTRA+=(--teacher-api-key-file "$TEACHER_API_KEY_FILE")
MODEL=qwen3-8B HF_CKPT=${HF_CKPT:-/models/Qwen3-8B} RUN_DIR=${RUN_DIR:-runs/qwen3-8b-distill} \
    EXTRA_TRAIN_ARGS="${EXTRA[*]}" exec bash "$HERE/run_qwen2.5_7b_single_node.sh" "$@"
