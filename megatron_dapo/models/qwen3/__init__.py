"""Qwen3 dense (`Qwen3ForCausalLM`): the model family plug-in.

Qwen2's decoder with three differences: an RMSNorm over each head's q and k before RoPE (HF `q_norm` /
`k_norm`, megatron-core's `qk_layernorm`; eps = rms_norm_eps), no q/k/v bias (`attention_bias` false in every
released config), and an explicit `head_dim` (128 in every size, although Qwen3-8B's hidden 4096 / 32 heads
is 128 and Qwen3-32B's 5120 / 64 heads is 80: its q projection is 8192 wide, not 5120). Plain RoPE (theta
1e6); tied embeddings in the small sizes (0.6B-4B), untied from 8B.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models import dense
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields


def parse(config: dict[str, Any]) -> ModelArch:
    """config.json -> ModelArch; ValueError naming a field this implementation would ignore."""
    dense.check_plain_decoder(config)
    dense.reject_rope_scaling(config)
    if config.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (Qwen3 then has a bias on o_proj too; megatron's "
                         "dense layer has none there)")
    return ModelArch(**dense_decoder_fields(config), qkv_bias=False, qk_layernorm=True)


FAMILY = dense.dense_family(
    model_type="qwen3",
    hf_class_prefix="Qwen3",
    order=1,
    parse=parse,
    arch_defaults={"qkv_bias": False, "qk_layernorm": True},
    # head_dim 24 != hidden 64 / 4 heads: the explicit head_dim path (q projection 96 wide) is exercised.
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128,
                     rms_norm_eps=1e-6, rope_theta=10000.0),
)
