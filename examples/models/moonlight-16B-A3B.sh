# Moonlight-16B-A3B (moonshotai, DeepseekV3ForCausalLM): 27 layers, the first dense (SwiGLU 11264), the other 26 MoE:
# 64 SwiGLU experts of width 1408, each token routed to 6 (sigmoid scores + e_score_correction_bias, one group,
# renormalised, x 2.446) plus 2 shared experts (one SwiGLU of 2816); multi-head latent attention: hidden 2048, 16
# heads, q projected directly (q_lora_rank null) to 128 nope + 64 rope dims, k/v from a 512 latent + one 64-dim rope
# key, v 128; vocab 163840, untied, rope 50000, 8192 positions. 16.0B parameters, 2.9B active per token (14.4B of them
# in experts). The base model (eos 163585); -Instruct ends turns with 163586.
# TP must divide the 16 heads (> 1 needs --sequence-parallel: MLA refuses TP > 1 without it); EP must divide the 64
# experts and EP x ETP the TP x CP x DP ranks of a stage; ETP must divide 1408. PP must divide 27 (or set
# --decoder-first-pipeline-num-layers).
HF_CKPT=${HF_CKPT:-/models/Moonlight-16B-A3B}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
               --expert-tensor-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=2
