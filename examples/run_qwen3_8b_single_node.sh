#!/usr/bin/env bash
# DAPO on one 8-GPU node for Qwen3-8B: run_qwen2.5_7b_single_node.sh's layout (the actor at TP 4 with sequence
# parallelism on GPUs 0-3, two SGLang servers at TP 2 on GPUs 4-7) with Qwen3-8B's model file.
#
# Memory (--dry-run --world-size 4): one packed 16k-token micro-batch at ~65 GiB of 80 (19% headroom); Qwen3's
# per-head q/k norms add ~1.4 GiB over 36 layers.
#
# usage: examples/run_qwen3_8b_single_node.sh [HF_CKPT] [RUN_DIR]    (DRY_RUN=1 or --dry-run: the plan)
set -euo pipefail
HERE="$(dirname "$0")"
MODEL=qwen3-8B HF_CKPT=${HF_CKPT:-/models/Qwen3-8B} RUN_DIR=${RUN_DIR:-runs/qwen3-8b-dapo} \
    exec bash "$HERE/run_qwen2.5_7b_single_node.sh" "$@"
