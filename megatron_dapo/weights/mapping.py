"""The one HF <-> Megatron-core name table for Qwen2 / Qwen2.5, as data.

Each entry names a megatron-core parameter (local layer spec, `{layer}` = layer number), the HF
tensor(s) it is built from, and a layout kind that says how it is split over TP ranks:

- ``replicated``: the same tensor on every TP rank (norms).
- ``column``: split along dim 0 (output features).
- ``row``: split along dim 1 (input features): attention output and MLP down projections.
- ``qkv``: HF q, k, v interleaved per query group (its q heads, then k, then v), then dim 0 split.
- ``fc1``: HF gate and up; TP shard r = [gate chunk r; up chunk r].
- ``vocab``: rows padded to a multiple of 128 x TP, then dim 0 split.

The converter, the checkpoint loader and weight sync all read this table, so a model family is
added here and nowhere else. The functions that interpret the kinds live in `layout.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

LayoutKind = Literal["replicated", "column", "row", "qkv", "fc1", "vocab"]
Stage = Literal["first", "layer", "last"]
LAYOUT_KINDS: tuple[str, ...] = ("replicated", "column", "row", "qkv", "fc1", "vocab")


@dataclass(frozen=True, kw_only=True)
class MappingEntry:
    mcore: str
    """megatron-core local-spec name; `{layer}` is the layer number (stage-local in a module)."""
    hf: tuple[str, ...]
    """HF name template(s) in the order the layout function takes them; `{layer}` is global."""
    kind: LayoutKind
    stage: Stage
    """first: only on PP stage 0; last: only on the last stage; layer: in every decoder layer."""
    aliases: tuple[str, ...] = ()
    """Other megatron-core names for the same tensor (the Transformer Engine spec), accepted on read."""
    tied_hf: tuple[str, ...] = ()
    """HF source when tie_word_embeddings is set (the output layer then reuses the embedding)."""

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"mapping entry {self.mcore}: kind {self.kind!r} is not one of {LAYOUT_KINDS}")
        if ("{layer}" in self.mcore) != (self.stage == "layer"):
            raise ValueError(f"mapping entry {self.mcore}: only stage='layer' entries carry {{layer}}")


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

QWEN2_MAPPING: tuple[MappingEntry, ...] = (
    MappingEntry(
        mcore="embedding.word_embeddings.weight",
        hf=("model.embed_tokens.weight",),
        kind="vocab",
        stage="first",
    ),
    MappingEntry(
        mcore=_L + "input_layernorm.weight",
        hf=(_H + "input_layernorm.weight",),
        kind="replicated",
        stage="layer",
        aliases=(_L + "self_attention.linear_qkv.layer_norm_weight",),
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_qkv.weight",
        hf=(_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        kind="qkv",
        stage="layer",
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_qkv.bias",
        hf=(_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
        kind="qkv",
        stage="layer",
    ),
    MappingEntry(
        mcore=_L + "self_attention.linear_proj.weight",
        hf=(_H + "self_attn.o_proj.weight",),
        kind="row",
        stage="layer",
    ),
    MappingEntry(
        mcore=_L + "pre_mlp_layernorm.weight",
        hf=(_H + "post_attention_layernorm.weight",),
        kind="replicated",
        stage="layer",
        aliases=(_L + "mlp.linear_fc1.layer_norm_weight",),
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc1.weight",
        hf=(_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        kind="fc1",
        stage="layer",
    ),
    MappingEntry(
        mcore=_L + "mlp.linear_fc2.weight", hf=(_H + "mlp.down_proj.weight",), kind="row", stage="layer"
    ),
    MappingEntry(
        mcore="decoder.final_layernorm.weight", hf=("model.norm.weight",), kind="replicated", stage="last"
    ),
    MappingEntry(
        mcore="output_layer.weight",
        hf=("lm_head.weight",),
        kind="vocab",
        stage="last",
        tied_hf=("model.embed_tokens.weight",),
    ),
)


def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{layer}"), r"(\d+)") + "$")


_LOOKUP: tuple[tuple[re.Pattern[str], MappingEntry], ...] = tuple(
    (_template_regex(name), entry) for entry in QWEN2_MAPPING for name in (entry.mcore, *entry.aliases)
)


def resolve_mcore_name(name: str) -> tuple[MappingEntry, int | None]:
    """Find the table entry of a megatron-core name (canonical or alias) and its layer number.

    Raises KeyError naming the tensor when the table has no such parameter.
    """
    for pattern, entry in _LOOKUP:
        match = pattern.match(name)
        if match:
            return entry, int(match.group(1)) if match.groups() else None
    raise KeyError(f"{name!r} is not a Qwen2 megatron-core parameter known to weights/mapping.py")


def canonical_mcore_name(name: str) -> str:
    """The local-spec name of a megatron-core parameter given any accepted alias."""
    entry, layer = resolve_mcore_name(name)
    return entry.mcore.format(layer=layer) if layer is not None else entry.mcore


def dist_key(entry: MappingEntry) -> str:
    """The key of `entry` in a megatron-core dist checkpoint (torch_dist), e.g. Megatron-LM's.

    Decoder layers are stacked on a leading layer axis (no `{layer}` in the key), and the fused norms
    use the Transformer Engine spec names (`linear_qkv.layer_norm_weight`, the first alias) whichever
    spec the model runs: `GPTModel.sharded_state_dict()` of megatron-core 0.16.1 maps both to these.
    """
    name = entry.aliases[0] if entry.aliases else entry.mcore
    return name.replace("{layer}.", "")


def has_output_layer(*, tied: bool, is_first_stage: bool) -> bool:
    """Whether a last PP stage holds `output_layer.weight`.

    Untied: always. Tied: only when the last stage is not also the first, because megatron-core
    then keeps a copy of the embedding there (synchronised by its embedding group).
    """
    return not tied or not is_first_stage


def hf_names(entry: MappingEntry, *, layer: int | None, tied: bool) -> tuple[str, ...]:
    """HF tensor names feeding `entry` (global `layer`); tied output layers read the embedding."""
    templates = entry.tied_hf if tied and entry.tied_hf else entry.hf
    return tuple(t.format(layer=layer) for t in templates) if layer is not None else templates
