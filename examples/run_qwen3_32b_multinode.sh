#!/usr/bin/env bash
# DAPO's own setting for Qwen2.5-32B (arXiv 2503.14476, Sec. 4.1) applied to Qwen3-32B:
# run_qwen2.5_32b_multinode.sh's layout (TP 8 x PP 2 with sequence parallelism and block recompute of 16 of each
# stage's 32 layers; SGLang servers on the rollout nodes) with Qwen3-32B's model file.
#
# Memory (--dry-run --world-size 64): stage 0, two 24k-token micro-batches in flight, at ~56 GiB of 80 (30%
# headroom).
#
# usage: NODE_RANK=<i> MASTER_ADDR=<node 0> SGLANG_URLS="http://r0:30000 http://r0:30001 ..." \
#        examples/run_qwen3_32b_multinode.sh [HF_CKPT] [RUN_DIR]
set -euo pipefail
HERE="$(dirname "$0")"
MODEL=qwen3-32B exec bash "$HERE/run_qwen2.5_32b_multinode.sh" "${1:-${HF_CKPT:-/models/Qwen3-32B}}" \
    "${2:-runs/qwen3-32b-dapo}"
