"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): the model family plug-in.

Qwen3's attention (per-head q/k RMSNorm, no bias, explicit head_dim) with mixture-of-experts MLPs: each MoE layer
routes a token to `num_experts_per_tok` of `num_experts` SwiGLU experts (softmax router, top-k, renormalised when
`norm_topk_prob`), no shared expert. Layers in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a
dense MLP of `intermediate_size` (every released config has none: all 48 / 94 layers are MoE).
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models import dense, moe
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields


def parse(config: dict[str, Any]) -> ModelArch:
    """config.json -> ModelArch; ValueError naming a field this implementation would ignore."""
    dense.check_plain_decoder(config)
    dense.reject_rope_scaling(config)
    if config.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (Qwen3-MoE then has a bias on o_proj too; megatron's "
                         "layer has none there)")
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("shared_expert_intermediate_size is not supported (Qwen3-MoE has no shared expert; a "
                         "Qwen2-MoE checkpoint needs its own family)")
    fields = dense_decoder_fields(config)
    return ModelArch(**fields, qkv_bias=False, qk_layernorm=True, **moe.moe_fields(config, fields["num_layers"]))


def transformer_config_fields(arch: ModelArch) -> dict[str, Any]:
    """The dense decoder's fields plus megatron-core's MoE ones (`models/moe.py`)."""
    return {**dense.transformer_config_fields(arch), **moe.transformer_config_fields(arch)}


def sglang_refusal(arch: ModelArch) -> str | None:
    """Why SGLang 0.5.23 cannot serve a Qwen3-MoE config with dense layers (config.json `mlp_only_layers` non-empty,
    or `decoder_sparse_step` != 1): its qwen3_moe builds every decoder layer sparse (sglang/srt/models/qwen3_moe.py:877,
    `is_layer_sparse = True`) and its load_weights drops the dense layers' mlp.{gate,up,down}_proj weights (:1224,
    `if name not in params_dict: continue`), so those layers run experts no weight ever reaches (uninitialised
    memory). The server starts and logs nothing; measured on a tiny model: log-probs off by 4.7 nats, some outputs
    NaN. None for an all-MoE config (every released Qwen3-MoE)."""
    if arch.all_layers_moe:
        return None
    dense_layers = [i for i in range(arch.num_layers) if not arch.is_moe_layer(i)]
    return (f"layers {dense_layers} of this mixture-of-experts model are dense (config.json mlp_only_layers / "
            "decoder_sparse_step), which SGLang 0.5.23 cannot serve: its qwen3_moe builds every layer sparse "
            "(sglang/srt/models/qwen3_moe.py:877) and drops the dense layers' weights on load (:1224), a silently "
            "wrong model. Use an all-MoE config (mlp_only_layers [] and decoder_sparse_step 1, as every released "
            "Qwen3-MoE checkpoint is) or the embedded engine (--rollout-engine embedded)")


FAMILY = dense.dense_family(
    model_type="qwen3_moe",
    hf_class_prefix="Qwen3Moe",
    order=3,
    parse=parse,
    arch_defaults={"qkv_bias": False, "qk_layernorm": True},
    mapping=moe.with_moe_entries(dense.MAPPING),
    transformer_config_fields=transformer_config_fields,
    sglang_refusal=sglang_refusal,
    # Every layer MoE, as every released Qwen3-MoE (and the only layout SGLang 0.5.23 serves); the mixed
    # dense / MoE layout has its own tests. head_dim 24 != 64 / 4: the explicit-head_dim path.
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128,
                     rms_norm_eps=1e-6, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     router_aux_loss_coef=0.001),
)
