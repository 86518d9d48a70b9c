# Qwen3-32B: 64 layers, hidden 5120, 64 heads / 8 kv heads of head_dim 128 (q projection 8192 wide), per-head
# q/k RMSNorm, ffn 25600, vocab 151936, untied, rope 1e6, 40960 positions.
# TP in {1, 2, 4, 8}; PP must divide 64. `python -m checkpoint_convert hf-to-mcore --dry-run` checks a layout.
HF_CKPT=${HF_CKPT:-/models/Qwen3-32B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --use-distributed-optimizer)
SGLANG_TP=4
