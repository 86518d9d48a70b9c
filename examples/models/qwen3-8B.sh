# Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 kv heads of head_dim 128, per-head q/k RMSNorm, ffn 12288,
# vocab 151936, untied, rope 1e6, 40960 positions. TP must divide the 8 kv heads: TP in {1, 2, 4, 8}.
HF_CKPT=${HF_CKPT:-/models/Qwen3-8B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=2
