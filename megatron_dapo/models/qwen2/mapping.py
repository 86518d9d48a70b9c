"""The HF <-> megatron-core name table of Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), as data.

`{layer}` is the layer number; the layout kinds are those of `weights/mapping.py`. The q/k/v bias entry
exists under `arch.qkv_bias`, which every Qwen2 model sets.
"""

from __future__ import annotations

from megatron_dapo.models.family import MappingEntry

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
        mcore=_L + "pre_mlp_layernorm.weight",
        hf=(_H + "post_attention_layernorm.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("hidden_size",),),
        aliases=(_L + "mlp.linear_fc1.layer_norm_weight",),
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc1.weight",
        hf=(_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        kind="fc1",
        stage="layer",
        shapes=(("intermediate_size", "hidden_size"), ("intermediate_size", "hidden_size")),
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc2.weight",
        hf=(_H + "mlp.down_proj.weight",),
        kind="row",
        stage="layer",
        shapes=(("hidden_size", "intermediate_size"),),
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
