# Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 kv heads, ffn 4864, vocab 151936, tied embeddings.
# The architecture is read from config.json; these are the layout choices that fit it.
HF_CKPT=${HF_CKPT:-/models/Qwen2.5-0.5B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
SGLANG_TP=1
