"""Llama 3 / 3.1 / 3.2 and Llama-architecture models such as SmolLM2 (`LlamaForCausalLM`): the family plug-in.

No bias anywhere, RMSNorm, SwiGLU, GQA, RoPE with Llama 3's frequency-dependent scaling (rope_type
`llama3`: wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`,
those below original / high_freq_factor kept, a smooth blend between), tied embeddings in the small ones
(Llama-3.2-1B/3B, SmolLM2). megatron-core 0.16.1 takes the factor (`rope_scaling_factor`) but hard-codes
the other three constants (low 1, high 4, original 8192, the values of every Llama 3.1 / 3.2 release):
`parse` rejects a config.json with other values instead of silently running a different rope.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models import dense
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields

# megatron-core 0.16.1 RotaryEmbedding._apply_scaling's fixed constants.
MCORE_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_options(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """family_options for the config's rope: () for plain RoPE, (("rope_scaling_factor", f),) for llama3."""
    scaling = dense.rope_scaling(config)
    if not scaling:
        return ()
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"rope_scaling rope_type {scaling['rope_type']!r} is not supported (plain RoPE or llama3)")
    for name, want in MCORE_ROPE_CONSTANTS.items():
        if name not in scaling or float(scaling[name]) != want:
            raise ValueError(f"rope_scaling {name} {scaling.get(name)!r} is not supported: megatron-core 0.16.1 "
                             f"hard-codes {want:g}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"rope_scaling factor must be a positive number, got {factor!r}")
    return (("rope_scaling_factor", float(factor)),)


def parse(config: dict[str, Any]) -> ModelArch:
    """config.json -> ModelArch; ValueError naming a field this implementation would ignore."""
    dense.check_plain_decoder(config)
    if config.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (it puts a bias on q, k, v and o_proj; megatron's "
                         "dense layer has none on o_proj)")
    return ModelArch(**dense_decoder_fields(config), qkv_bias=False, qk_layernorm=False,
                     family_options=_rope_options(config))


def model_kwargs(arch: ModelArch) -> dict[str, Any]:
    """GPTModel kwargs: RoPE with the arch's base, plus llama3 scaling when config.json has it."""
    factor = arch.option("rope_scaling_factor")
    scaling = {} if factor is None else {"rope_scaling": True, "rope_scaling_factor": factor}
    return {**dense.rope_model_kwargs(arch), **scaling}


FAMILY = dense.dense_family(
    model_type="llama",
    hf_class_prefix="Llama",
    order=2,
    parse=parse,
    model_kwargs=model_kwargs,
    arch_defaults={"qkv_bias": False, "qk_layernorm": False},
    # llama3 rope scaling on: with head_dim 16 and theta 1e4 the lowest frequencies' wavelengths (up to ~2e4)
    # exceed 8192, so the scaling changes the rope even at these short positions.
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     rms_norm_eps=1e-5,
                     rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
)
