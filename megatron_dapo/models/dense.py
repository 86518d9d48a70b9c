"""What the dense decoder families (RMSNorm, SwiGLU, RoPE, GQA) share: the HF <-> megatron-core name table,
the config.json checks for features megatron-core's dense GPT layer lacks, and the hooks that do not differ.

A family folder (`models/<model_type>/`) composes these and adds what is its own (docs/MODELS.md): which
optional tensors exist (`qkv_bias`, `qk_layernorm` decide the `requires` entries below), its rope, and the
config.json fields it rejects.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models.family import MappingEntry, ModelFamily

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

MAPPING: tuple[MappingEntry, ...] = (
    MappingEntry(
        mcore="embedding.word_embeddings.weight",
        hf=("model.embed_tokens.weight",),
        kind="vocab",
        stage="first",
        shapes=(("vocab_size", "hidden_size"),),
    ),
    MappingEntry(
        mcore=_L + "input_layernorm.weight",
        hf=(_H + "input_layernorm.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("hidden_size",),),
        aliases=(_L + "self_attention.linear_qkv.layer_norm_weight",),
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_qkv.weight",
        hf=(_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        kind="qkv",
        stage="layer",
        shapes=(("q_size", "hidden_size"), ("kv_size", "hidden_size"), ("kv_size", "hidden_size")),
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_qkv.bias",
        hf=(_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
        kind="qkv",
        stage="layer",
        shapes=(("q_size",), ("kv_size",), ("kv_size",)),
        requires="qkv_bias",
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_proj.weight",
        hf=(_H + "self_attn.o_proj.weight",),
        kind="row",
        stage="layer",
        shapes=(("hidden_size", "q_size"),),
    ),
    MappingEntry(
        mcore=_L + "self_attention.q_layernorm.weight",
        hf=(_H + "self_attn.q_norm.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("head_dim",),),
        requires="qk_layernorm",
    ),
    MappingEntry(
        mcore=_L + "self_attention.k_layernorm.weight",
        hf=(_H + "self_attn.k_norm.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("head_dim",),),
        requires="qk_layernorm",
    ),
    MappingEntry(
        mcore=_L + "pre_mlp_layernorm.weight",
        hf=(_H + "post_attention_layernorm.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("hidden_size",),),
        aliases=(_L + "mlp.linear_fc1.layer_norm_weight",),
        te_moe_dist=_L + "pre_mlp_layernorm.weight",  # a TE MoE layer's own TENorm (models/family.py)
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc1.weight",
        hf=(_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        kind="fc1",
        stage="layer",
        shapes=(("intermediate_size", "hidden_size"), ("intermediate_size", "hidden_size")),
        layers="dense",
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc2.weight",
        hf=(_H + "mlp.down_proj.weight",),
        kind="row",
        stage="layer",
        shapes=(("hidden_size", "intermediate_size"),),
        layers="dense",
    ),
    MappingEntry(
        mcore="decoder.final_layernorm.weight",
        hf=("model.norm.weight",),
        kind="replicated",
        stage="last",
        shapes=(("hidden_size",),),
    ),
    MappingEntry(
        mcore="output_layer.weight",
        hf=("lm_head.weight",),
        kind="vocab",
        stage="last",
        shapes=(("vocab_size", "hidden_size"),),
        tied_hf=("model.embed_tokens.weight",),
    ),
)
"""HF names in the HF order of a dense decoder layer; `requires` drops the q/k/v bias and the per-head q/k
RMSNorm (Qwen3's q_norm / k_norm, megatron-core's q_layernorm / k_layernorm, the same names in the TE spec)
for families without them. The MLP entries are `layers="dense"`: an MoE family's MoE layers have experts
there instead (`models/moe.py`)."""


def check_plain_decoder(config: dict[str, Any]) -> None:
    """ValueError naming the first config.json field whose value megatron-core's dense layer would ignore.

    Checks what every dense family shares: SwiGLU (hidden_act silu), full attention (no sliding window, no
    other layer types), no attention dropout, no bias on o_proj or the MLP (`attention_bias` gives q/k/v
    *and* o_proj a bias in Qwen3 and Llama; `mlp_bias`). Rope scaling is the family's own check.
    """
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (SwiGLU needs 'silu')")
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window true is not supported (megatron-core runs full attention)")
    if any(t != "full_attention" for t in config.get("layer_types") or ()):
        raise ValueError("layer_types other than 'full_attention' are not supported (no sliding window)")
    if config.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout {config['attention_dropout']} is not supported (training runs with 0)")
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias true is not supported (the MLP linears have no bias)")


def rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling dict of a config.json (`rope_scaling`, or transformers 5's `rope_parameters`), {} for
    plain RoPE. Its `rope_type` (older files: `type`) says which; 'default' is plain."""
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type"))
    return {} if rope_type in (None, "default") else {**scaling, "rope_type": rope_type}


def reject_rope_scaling(config: dict[str, Any]) -> None:
    """ValueError naming rope_scaling when a config.json asks for any rope scaling (plain RoPE families)."""
    scaling = rope_scaling(config)
    if scaling:
        raise ValueError(f"rope_scaling / rope_parameters rope_type {scaling['rope_type']!r} is not supported "
                         "(plain RoPE only)")


def transformer_config_fields(arch: Any) -> dict[str, Any]:
    """TransformerConfig fields of a dense decoder: RMSNorm, gated silu, no bias but the optional q/k/v one,
    optional per-head q/k RMSNorm, dropout 0."""
    import torch.nn.functional as F

    return dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_layernorm, hidden_dropout=0.0,
                attention_dropout=0.0)


def layer_spec_options(arch: Any) -> dict[str, Any]:
    """megatron-core layer-spec builder kwargs: the per-head q/k norm when the arch has it."""
    return {"qk_layernorm": arch.qk_layernorm}


def rope_model_kwargs(arch: Any) -> dict[str, Any]:
    """GPTModel kwargs for plain RoPE with the arch's base (theta)."""
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta)


def activation_terms(arch: Any) -> dict[str, Any]:
    """The planner's model-decided terms: gated MLP, no dropout, unfused rope, the per-head q/k norm when the
    arch has it."""
    return dict(gated=True, dropout=False, rope="unfused", qk_norm=arch.qk_layernorm)


def dense_family(*, model_type: str, hf_class_prefix: str, parse: Any, arch_defaults: dict[str, Any],
                 tiny_config: dict[str, Any], order: int | None = None, **hooks: Any) -> ModelFamily:
    """A `ModelFamily` of a dense decoder: this module's table and hooks, the family's `parse`, and `hooks`
    (e.g. `model_kwargs`) where the family differs. HF classes are `<prefix>ForCausalLM` / `<prefix>Config`."""
    fields: dict[str, Any] = dict(
        mapping=MAPPING, transformer_config_fields=transformer_config_fields, layer_spec_options=layer_spec_options,
        model_kwargs=rope_model_kwargs, activation_terms=activation_terms)
    if "mapping" in hooks:  # a family's own table (an MoE family: this one plus its expert entries)
        fields["mapping"] = hooks.pop("mapping")
    optional = {k: hooks.pop(k) for k in ("sglang_refusal", "dropped_hf_tensors", "kv_cache_elements") if k in hooks}
    unknown = sorted(set(hooks) - set(fields))
    if unknown:
        raise TypeError(f"dense_family({model_type}): {unknown} are not overridable hooks {sorted(fields)}")
    return ModelFamily(model_type=model_type, hf_model_class=f"{hf_class_prefix}ForCausalLM",
                       hf_config_class=f"{hf_class_prefix}Config", parse=parse, arch_defaults=arch_defaults,
                       tiny_config=tiny_config, order=order, **{**fields, **hooks, **optional})
