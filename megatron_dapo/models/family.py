"""ModelFamily: everything the library needs to know about one HF model family, in one object;
MappingEntry: one row of a family's HF <-> megatron-core name table (read by `weights/mapping.py`).

A family is one folder `models/<model_type>/` whose `__init__.py` defines `FAMILY = ModelFamily(...)`; the
registry finds it there (`registry.family_modules`, docs/MODELS.md). Every other module takes a `ModelArch` and
reaches the family through `arch.family`; none names a family.

Hooks (functions of the arch, so a family option such as `qk_layernorm` or a rope scaling reaches
megatron-core without code outside the folder):

- `parse(config) -> ModelArch`: the config.json dict -> the architecture; an unsupported value is a
  ValueError naming the config.json field (`hf_config.dense_decoder_fields` reads the common ones);
- `transformer_config_fields(arch)`: the family's TransformerConfig fields (norm, activation, biases,
  dropout, qk_layernorm, ...); sizes and parallelism are added by `models/config.py`;
- `layer_spec_options(arch)`: keyword arguments of megatron-core's GPT layer-spec builders
  (`get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`, e.g. qk_layernorm);
- `model_kwargs(arch)`: GPTModel keyword arguments for positions (rope type, base, scaling);
- `activation_terms(arch)`: the planner's `ActivationSpec` fields that depend on the model (gated MLP,
  dropout, rope), next to the ones the layer implementation decides;
- `kv_cache_elements(arch, tp)` (optional): the inference engine's KV cache per token, layer and TP rank when it is
  not GQA's K and V (MLA caches one latent);
- `sglang_refusal(arch)` (optional): why SGLang would serve this config wrong in silence, or None;
- `dropped_hf_tensors(arch)` (optional): name prefixes of HF checkpoint tensors the family does not load, and why
  (DeepSeek-V3's multi-token-prediction layer): a load skips them and says so, where any other unplaceable tensor
  is an error;
- `mapping`: the HF <-> megatron-core name table (`weights/mapping.py` entries; data);
- `hf_model_class` / `hf_config_class`: the transformers class names the embedded engine and the tests
  build (`hf_causal_lm()`, `hf_config()`);
- `tiny_config`: a small config.json dict the shared tests build random models from (docs/MODELS.md).
- `order`: the family's place in `registry.model_types()` (the numbered ones first; optional).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

LayoutKind = Literal["replicated", "column", "row", "qkv", "fc1", "vocab"]
Stage = Literal["first", "layer", "last"]
LayerKind = Literal["all", "dense", "moe"]
LAYER_KINDS: tuple[str, ...] = ("all", "dense", "moe")
LAYOUT_KINDS: tuple[str, ...] = ("replicated", "column", "row", "qkv", "fc1", "vocab")


@dataclass(frozen=True, kw_only=True)
class MappingEntry:
    mcore: str
    """megatron-core local-spec name; `{layer}` is the layer number (stage-local in a module), `{expert}` the
    expert number local to this expert-parallel rank (an expert entry: one tensor per expert)."""
    hf: tuple[str, ...]
    """HF name template(s) in the order the layout function takes them; `{layer}` and `{expert}` are global."""
    kind: LayoutKind
    stage: Stage
    """first: only on PP stage 0; last: only on the last stage; layer: in every decoder layer."""
    aliases: tuple[str, ...] = ()
    """Other megatron-core names for the same tensor (the Transformer Engine spec), accepted on read."""
    shapes: tuple[tuple[str, ...], ...]
    """Shape of each HF tensor in `hf`, one ModelArch attribute or family option name per dim (`ModelArch.fact`, e.g.
    ("q_size", "hidden_size"))."""
    tied_hf: tuple[str, ...] = ()
    """HF source when tie_word_embeddings is set (the output layer then reuses the embedding)."""
    requires: str | None = None
    """A boolean ModelArch field or family option the entry exists under (e.g. "qkv_bias"); None: always present."""
    layers: LayerKind = "all"
    """Which decoder layers hold it: all, those with a dense MLP, or the MoE layers (`ModelArch.moe_layers`)."""
    dist: str | None = None
    """An expert entry's key in a dist checkpoint, `{layer}` where the layers are not stacked: megatron-core
    saves a layer's experts as one tensor with a leading global expert axis (`weights.mapping.dist_key`)."""
    te_moe_dist: str | None = None
    """Its dist-checkpoint key in an MoE layer of a Transformer Engine model, `{layer}` where the layers are not
    stacked, when that differs from the other layers' (`weights.mapping.dist_key`). megatron-core 0.16.1 names a
    norm differently per layer kind and implementation: its TE MoE layer keeps the pre-MLP norm as a TENorm of its
    own (`pre_mlp_layernorm.weight`), while a TE dense layer fuses it into linear_fc1 and the local spec maps it to
    that fused name (`mlp.linear_fc1.layer_norm_weight`) in every layer, MoE or dense."""
    sync_with_next: bool = False
    """A weight-sync bucket carries this entry's HF tensor and the next entry's together
    (`weights.mapping.keep_together`): the inference server's loader fuses them only when both arrive in one request
    (SGLang 0.5.23 concatenates DeepSeek's q_a_proj and
    kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa within one load_weights call, and drops a half that arrives
    alone)."""
    buffer: bool = False
    """A buffer, not a parameter, in HF and megatron-core (DeepSeek-V3's e_score_correction_bias, megatron-core's
    router expert_bias): in the checkpoint and the weight sync, not in `ModelArch.num_parameters`, no gradient and no
    optimizer state."""

    @property
    def per_expert(self) -> bool:
        """One tensor per routed expert: split over the expert-parallel ranks, TP-split over the expert-TP
        ranks (`--expert-tensor-parallel-size`)."""
        return "{expert}" in self.mcore

    def present(self, arch: Any) -> bool:
        """Whether `arch` (a ModelArch) has this tensor: it requires nothing, or its `requires` fact is set."""
        return self.requires is None or bool(arch.fact(self.requires))

    def in_layer(self, arch: Any, layer: int) -> bool:
        """Whether global decoder layer `layer` of `arch` holds this entry (dense-MLP entries skip the MoE layers and
        the reverse)."""
        return self.layers == "all" or arch.is_moe_layer(layer) == (self.layers == "moe")

    def numel(self, arch: Any) -> int:
        """Elements of its HF tensors together (`shapes` read off `arch`, `ModelArch.fact`): one expert's for an
        expert entry, the vocab rows unpadded."""
        return sum(math.prod(arch.fact(dim) for dim in shape) for shape in self.shapes)

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.hf):
            raise ValueError(f"mapping entry {self.mcore}: {len(self.hf)} HF tensors but {len(self.shapes)} shapes")
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"mapping entry {self.mcore}: kind {self.kind!r} is not one of {LAYOUT_KINDS}")
        if ("{layer}" in self.mcore) != (self.stage == "layer"):
            raise ValueError(f"mapping entry {self.mcore}: only stage='layer' entries carry {{layer}}")
        if self.layers not in LAYER_KINDS:
            raise ValueError(f"mapping entry {self.mcore}: layers {self.layers!r} is not one of {LAYER_KINDS}")
        if self.per_expert != (self.dist is not None) or (self.per_expert and self.layers != "moe"):
            raise ValueError(f"mapping entry {self.mcore}: an {{expert}} entry needs layers='moe' and its dist key")
        if any(("{expert}" in name) != self.per_expert for name in (*self.hf, *self.aliases)):
            raise ValueError(f"mapping entry {self.mcore}: {{expert}} must be in every name or in none")
        if self.te_moe_dist is not None and ("{layer}" not in self.te_moe_dist or self.layers != "all"):
            raise ValueError(f"mapping entry {self.mcore}: te_moe_dist is a per-layer key of an entry in every layer")


ARCH_OPTIONS = ("qkv_bias", "qk_layernorm")
"""ModelArch fields a family fills (its `arch_defaults` give them when a ModelArch is built directly)."""


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    model_type: str
    """HF config.json `model_type` this family is registered under."""
    hf_model_class: str
    """transformers causal-LM class name (the embedded engine and the tests build it)."""
    hf_config_class: str
    """transformers config class name."""
    mapping: tuple[MappingEntry, ...]
    """HF <-> megatron-core name table (entries with `requires` exist only under that arch option)."""
    # The hooks take / return a `models.hf_config.ModelArch` (typed Any here: hf_config reaches the family
    # through the registry, so this module cannot import it without an import cycle).
    parse: Callable[[dict[str, Any]], Any]
    """config.json dict -> ModelArch; ValueError naming the field on an unsupported value."""
    transformer_config_fields: Callable[[Any], dict[str, Any]]
    layer_spec_options: Callable[[Any], dict[str, Any]]
    model_kwargs: Callable[[Any], dict[str, Any]]
    activation_terms: Callable[[Any], dict[str, Any]]
    kv_cache_elements: Callable[[Any, int], int] | None = None
    """(arch, engine TP size) -> elements one token's KV cache takes per layer on one TP rank of the inference engine
    (the colocated plan's SGLang pool); None: GQA's K and V of the rank's kv heads (`planner.colocated`)."""
    sglang_refusal: Callable[[Any], str | None] | None = None
    """arch -> why SGLang 0.5.23 would serve this config wrong without saying so (a sentence naming the config.json
    fields and what to use instead), or None; checked before any server starts (`rollout.sglang.setup`)."""
    dropped_hf_tensors: Callable[[Any], tuple[tuple[str, ...], str]] | None = None
    """arch -> (HF name prefixes a load skips, why); None: a checkpoint holds nothing the family leaves out."""
    arch_defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values of ARCH_OPTIONS for a ModelArch built without them (a test's ModelArch(model_type=...))."""
    tiny_config: Mapping[str, Any] = field(default_factory=dict)
    """A tiny config.json (without model_type) the family-parametrized tests build random HF models from."""
    order: int | None = None
    """Where the family stands in `registry.model_types()` (the supported values an error lists; the
    family-parametrized tests take the first as their reference family, e.g. for the converter's full TP/PP matrix);
    None: after the ordered ones, by package name."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.arch_defaults) - set(ARCH_OPTIONS))
        if unknown:
            raise ValueError(f"family {self.model_type}: arch_defaults {unknown} are not ModelArch options "
                             f"{ARCH_OPTIONS}")

    def hf_causal_lm(self) -> type:
        """The transformers causal-LM class (imports transformers)."""
        import transformers

        return getattr(transformers, self.hf_model_class)

    def hf_config(self, **fields: Any) -> Any:
        """A transformers config of this family from config.json fields."""
        import transformers

        return getattr(transformers, self.hf_config_class)(**fields)
