# Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 kv heads of head_dim 128, ffn 14336, vocab 128256,
# untied, rope 5e5 with llama3 scaling (factor 8, low 1, high 4, original 8192), 131072 positions.
# TP must divide the 8 kv heads: TP in {1, 2, 4, 8}.
HF_CKPT=${HF_CKPT:-/models/Llama-3.1-8B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=2
