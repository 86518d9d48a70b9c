# Qwen2.5-32B: 64 layers, hidden 5120, 40 heads / 8 kv heads, ffn 27648, vocab 152064, untied, rope 1e6.
# TP in {1, 2, 4, 8}; PP must divide 64. `python -m checkpoint_convert hf-to-mcore --dry-run` checks a layout.
HF_CKPT=${HF_CKPT:-/models/Qwen2.5-32B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --use-distributed-optimizer)
SGLANG_TP=4
