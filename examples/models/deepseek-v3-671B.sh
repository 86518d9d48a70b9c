# DeepSeek-V3 (671B): 61 layers, the first 3 dense (SwiGLU 18432), the other 58 MoE: 256 SwiGLU experts of width 2048,
# each token routed to 8 (sigmoid scores + e_score_correction_bias, top-4 of 8 groups by their top-2 sum, renormalised,
# x 2.5) plus 1 shared expert; multi-head latent attention: hidden 7168, 128 heads, q through a 1536 latent to 128 nope
# + 64 rope dims, k/v from a 512 latent + one 64-dim rope key, v 128; vocab 129280, untied, YaRN rope (factor 40 over
# 4096, theta 10000), 163840 positions. 671.0B parameters, 37.6B active per token (654B of them in experts); the
# multi-token-prediction layer (num_nextn_predict_layers 1) is left out on load (docs/MODELS.md).
# The bf16 checkpoint is needed: deepseek-ai/DeepSeek-V3 ships fp8 (config.json's quantization_config), which the
# loader refuses; convert it first (DeepSeek's inference/fp8_cast_bf16.py, ~1.3 TB) and drop quantization_config.
# TP must divide the 128 heads (> 1 needs --sequence-parallel: MLA refuses TP > 1 without it); EP must divide the 256
# experts and EP x ETP the TP x CP x DP ranks of a stage; ETP must divide 2048. 61 layers are prime: PP > 1 needs
# --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers.
HF_CKPT=${HF_CKPT:-/models/DeepSeek-V3-bf16}
MODEL_ARGS=(--hf-checkpoint "$HF_CKPT")
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 12
               --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 4
               --expert-model-parallel-size 16 --expert-tensor-parallel-size 1 --use-distributed-optimizer)
SGLANG_TP=8
