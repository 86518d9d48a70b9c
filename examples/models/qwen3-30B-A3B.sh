# Qwen3-30B-A3B: 48 layers, every one MoE: 128 SwiGLU experts of width 768, each token routed to 8 (softmax router,
# top-8 renormalised: norm_topk_prob), no shared expert, load-balancing loss coefficient 0.001; hidden 2048, 32 heads /
# 4 kv heads of head_dim 128 (q projection 4096 wide), per-head q/k RMSNorm, vocab 151936, untied, rope 1e6, 40960
# positions. 30.5B parameters, 3.3B active per token (29.0B of them in experts).
# TP must divide the 4 kv heads (TP in {1, 2, 4}; > 1 needs --sequence-parallel); EP must divide the 128 experts and
# EP x ETP the TP x CP x DP ranks of a stage; ETP must divide 768. PP must divide 48.
HF_CKPT=${HF_CKPT:-/models/Qwen3-30B-A3B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
               --expert-tensor-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=4
