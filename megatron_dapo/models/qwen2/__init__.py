"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the model family plug-in.

RMSNorm, SwiGLU MLP, RoPE (theta from config.json, no scaling), GQA attention with bias on q, k and v
only (Qwen2's attention always has it: no config field turns it off), no dropout. The 32B launcher
(examples/run_qwen2.5_32b*.sh) runs this family.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models.family import ModelFamily
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields
from megatron_dapo.models.qwen2.mapping import MAPPING


def _unsupported(config: dict[str, Any]) -> None:
    """ValueError naming the first config.json field whose value this implementation would silently ignore."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window true is not supported (megatron-core runs full attention)")
    if any(t != "full_attention" for t in config.get("layer_types") or ()):
        raise ValueError("layer_types other than 'full_attention' are not supported (no sliding window)")
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or (config.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling / rope_parameters rope_type {rope_type!r} is not supported (plain RoPE only)")
    if config.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout {config['attention_dropout']} is not supported (training runs with 0)")


def parse(config: dict[str, Any]) -> ModelArch:
    _unsupported(config)
    return ModelArch(**dense_decoder_fields(config), qkv_bias=True, qk_layernorm=False)


def transformer_config_fields(arch: ModelArch) -> dict[str, Any]:
    import torch.nn.functional as F

    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_layernorm, hidden_dropout=0.0,
                attention_dropout=0.0)


def layer_spec_options(arch: ModelArch) -> dict[str, Any]:
    return {"qk_layernorm": arch.qk_layernorm}


def model_kwargs(arch: ModelArch) -> dict[str, Any]:
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta)


def activation_terms(arch: ModelArch) -> dict[str, Any]:
    return dict(gated=True, dropout=False, rope="unfused")


FAMILY = ModelFamily(
    model_type="qwen2",
    hf_model_class="Qwen2ForCausalLM",
    hf_config_class="Qwen2Config",
    mapping=MAPPING,
    parse=parse,
    transformer_config_fields=transformer_config_fields,
    layer_spec_options=layer_spec_options,
    model_kwargs=model_kwargs,
    activation_terms=activation_terms,
    arch_defaults={"qkv_bias": True, "qk_layernorm": False},
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     rms_norm_eps=1e-6, rope_theta=10000.0),
)
