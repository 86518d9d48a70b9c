# Qwen2.5-7B: 28 layers, hidden 3584, 28 heads / 4 kv heads, ffn 18944, vocab 152064, untied, rope 1e6.
# TP must divide the 4 kv heads: TP in {1, 2, 4}.
HF_CKPT=${HF_CKPT:-/models/Qwen2.5-7B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=2
