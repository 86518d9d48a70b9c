#!/usr/bin/env bash
# DAPO on one 8-GPU node for Llama-3.1-8B: run_qwen2.5_7b_single_node.sh's layout (the actor at TP 4 with sequence
# parallelism on GPUs 0-3, two SGLang servers at TP 2 on GPUs 4-7) with Llama-3.1-8B's model file.
#
# Memory (--dry-run --world-size 4): one packed 16k-token micro-batch at ~62 GiB of 80 (22% headroom).
# DAPO's math verifier reads "Answer: ..." lines: use an instruct model or expect a low start on a base one.
#
# usage: examples/run_llama3.1_8b_single_node.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run: the plan)
set -euo pipefail
HERE="$(dirname "$0")"
MODEL=llama3.1-8B HF_CKPT=${HF_CKPT:-/models/Llama-3.1-8B} RUN_DIR=${RUN_DIR:-runs/llama3.1-8b-dapo} \
    exec bash "$HERE/run_qwen2.5_7b_single_node.sh" "$@"
