"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the model family plug-in.

RMSNorm, SwiGLU MLP, RoPE (theta from config.json, no scaling), GQA attention with bias on q, k and v
only (Qwen2's attention always has it: no config field turns it off), no dropout. The 32B launcher
(examples/run_qwen2.5_32b*.sh) runs this family.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models import dense
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields


def parse(config: dict[str, Any]) -> ModelArch:
    """config.json -> ModelArch; ValueError naming a field this implementation would ignore."""
    dense.check_plain_decoder(config)
    dense.reject_rope_scaling(config)
    return ModelArch(**dense_decoder_fields(config), qkv_bias=True, qk_layernorm=False)


FAMILY = dense.dense_family(
    model_type="qwen2",
    hf_class_prefix="Qwen2",
    order=0,  # first in model_types(): the tests' reference family
    parse=parse,
    arch_defaults={"qkv_bias": True, "qk_layernorm": False},
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     rms_norm_eps=1e-6, rope_theta=10000.0),
)
