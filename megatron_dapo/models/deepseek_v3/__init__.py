"""DeepSeek-V3 / V2-style decoders (`DeepseekV3ForCausalLM`): the model family plug-in, on megatron-core's MLA.

Multi-head latent attention (DeepSeek-V2 paper, sec. 2.1): q through a low-rank bottleneck (`q_a_proj` ->
RMSNorm -> `q_b_proj`, or one `q_proj` when q_lora_rank is null, as in V2-Lite), k/v from one shared latent
(`kv_a_proj_with_mqa` -> [kv_lora_rank latent | qk_rope_head_dim rope key shared by all heads], the latent
RMSNorm'd and expanded per head by `kv_b_proj` into [qk_nope_head_dim key | v_head_dim value]); RoPE (plain or
YaRN, applied to the interleaved pairs) on the rope part only. The first `first_k_dense_replace` layers have a
dense SwiGLU MLP, the others an MoE: sigmoid scores, `e_score_correction_bias` added for the choice only, top-2 sum
per group -> `topk_group` of `n_group` groups -> top-k experts, weights = the chosen sigmoid scores renormalised, x
`routed_scaling_factor`; plus `n_shared_experts` always-on experts (one SwiGLU of n_shared x moe_intermediate_size).

megatron-core 0.16.1 runs it as MLATransformerConfig + MLASelfAttention (local spec: ColumnParallelLinear q/kv
down and up projections, separate q/kv RMSNorms) and its MoELayer (TopKRouter with score_function sigmoid,
expert_bias, group-limited top-k, topk_scaling_factor; shared experts). Deviations refused by `parse` (each a
config.json field): norm_topk_prob false (megatron-core's sigmoid path always renormalises a top-k > 1), a group
choice by other than the top-2 sum (megatron-core sums the top topk / group_topk per group), rope_interleave false
(megatron-core's MLA de-interleaves the rope dims), attention_bias, scoring_func / topk_method other than DeepSeek-V3's.

On the local spec (CPU) the MLA layer is made to train and checkpoint like TE's (duplicated down projections, the
latent norms fused into the up projections, TE's checkpoint keys): `models/mla_local.py`. At TP > 1 MLA needs
--sequence-parallel (`distributed.parallel.validate_layout`: megatron-core leaves the rope key's gradient partial
without it).
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models import dense
from megatron_dapo.models.family import MappingEntry, ModelFamily
from megatron_dapo.models.hf_config import ModelArch, dense_decoder_fields

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_A = _L + "self_attention."
_HA = _H + "self_attn."

MLA_ENTRIES: tuple[MappingEntry, ...] = (
    MappingEntry(mcore=_A + "linear_q_down_proj.weight", hf=(_HA + "q_a_proj.weight",), kind="replicated",
                 stage="layer", shapes=(("q_lora_rank", "hidden_size"),), requires="q_lora", sync_with_next=True),
    MappingEntry(mcore=_A + "linear_kv_down_proj.weight", hf=(_HA + "kv_a_proj_with_mqa.weight",), kind="replicated",
                 stage="layer", shapes=(("kv_down_rows", "hidden_size"),)),
    MappingEntry(mcore=_A + "linear_q_up_proj.layer_norm_weight", hf=(_HA + "q_a_layernorm.weight",),
                 kind="replicated", stage="layer", shapes=(("q_lora_rank",),), requires="q_lora"),
    MappingEntry(mcore=_A + "linear_q_up_proj.weight", hf=(_HA + "q_b_proj.weight",), kind="column",
                 stage="layer", shapes=(("q_size", "q_lora_rank"),), requires="q_lora"),
    MappingEntry(mcore=_A + "linear_q_proj.weight", hf=(_HA + "q_proj.weight",), kind="column",
                 stage="layer", shapes=(("q_size", "hidden_size"),), requires="no_q_lora"),
    MappingEntry(mcore=_A + "linear_kv_up_proj.layer_norm_weight", hf=(_HA + "kv_a_layernorm.weight",),
                 kind="replicated", stage="layer", shapes=(("kv_lora_rank",),)),
    MappingEntry(mcore=_A + "linear_kv_up_proj.weight", hf=(_HA + "kv_b_proj.weight",), kind="column",
                 stage="layer", shapes=(("kv_up_rows", "kv_lora_rank"),)),
    MappingEntry(mcore=_A + "linear_proj.weight", hf=(_HA + "o_proj.weight",), kind="row",
                 stage="layer", shapes=(("hidden_size", "o_cols"),)),
)
"""One MLA layer: the down projections, whole on every TP rank (TELinear 'duplicated' under TE, its local twin on
CPU) and next to each other (SGLang fuses q_a_proj and kv_a_proj_with_mqa only when both arrive in one weight-sync
request: `sync_with_next`), the up projections column-parallel with the latent norms fused in, o_proj
row-parallel, on either implementation (`models/mla_local.py`)."""

_S = _L + "mlp.shared_experts."
MOE_EXTRA_ENTRIES: tuple[MappingEntry, ...] = (
    MappingEntry(mcore=_L + "mlp.router.expert_bias", hf=(_H + "mlp.gate.e_score_correction_bias",),
                 kind="replicated", stage="layer", shapes=(("num_experts",),), layers="moe", buffer=True),
    MappingEntry(mcore=_S + "linear_fc1.weight",
                 hf=(_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"),
                 kind="fc1", stage="layer",
                 shapes=(("shared_expert_size", "hidden_size"), ("shared_expert_size", "hidden_size")), layers="moe"),
    MappingEntry(mcore=_S + "linear_fc2.weight", hf=(_H + "mlp.shared_experts.down_proj.weight",), kind="row",
                 stage="layer", shapes=(("hidden_size", "shared_expert_size"),), layers="moe"),
)
"""The router's e_score_correction_bias (a buffer in both: megatron-core's `expert_bias`, kept fp32) and the
shared experts of an MoE layer."""


def _mapping() -> tuple[MappingEntry, ...]:
    """Embedding, input norm, MLA, pre-MLP norm, dense MLP / router + bias + experts + shared experts, head."""
    from megatron_dapo.models import moe

    by_name = {e.mcore: e for e in dense.MAPPING}
    input_norm = MappingEntry(mcore=_L + "input_layernorm.weight", hf=(_H + "input_layernorm.weight",),
                              kind="replicated", stage="layer", shapes=(("hidden_size",),))
    mlp = [e for e in dense.MAPPING if "mlp" in e.mcore]  # pre-MLP norm, dense fc1 / fc2
    router, *experts = moe.MOE_ENTRIES
    return (by_name["embedding.word_embeddings.weight"], input_norm, *MLA_ENTRIES, *mlp, router,
            MOE_EXTRA_ENTRIES[0], *experts, *MOE_EXTRA_ENTRIES[1:], by_name["decoder.final_layernorm.weight"],
            by_name["output_layer.weight"])


MAPPING = _mapping()

HF_NORM_EPS = 1e-6
"""The eps of HF's q_a_layernorm / kv_a_layernorm (DeepseekV3RMSNorm's default; rms_norm_eps does not reach them)."""

DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                n_group=8, topk_group=4, first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5,
                n_shared_experts=1, rope_interleave=True, rms_norm_eps=1e-6)
"""DeepseekV3Config's defaults (transformers 5.19), for a config.json that leaves a field out."""

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _int(config: dict[str, Any], name: str, *, minimum: int = 1) -> int:
    value = config.get(name, DEFAULTS.get(name))
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _rope_options(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """("rope_type", "rope") or ("rope_type", "yarn") and the YaRN fields megatron-core's MLATransformerConfig takes
    (beta_fast / beta_slow default 32 / 1, mscale 1, mscale_all_dim 0 as in transformers' YaRN)."""
    scaling = dense.rope_scaling(config)
    if not scaling:
        return (("rope_type", "rope"),)
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"rope_scaling rope_type {scaling['rope_type']!r} is not supported (plain RoPE or yarn)")
    for key in ("attention_factor", "partial_rotary_factor"):
        if scaling.get(key) is not None:
            raise ValueError(f"rope_scaling {key} is not supported (megatron-core's YaRN derives it from the mscales)")
    if scaling.get("truncate", True) is not True:
        raise ValueError("rope_scaling truncate false is not supported (megatron-core rounds the correction range)")
    values = dict(factor=scaling.get("factor"), original_max_position_embeddings=scaling.get(
        "original_max_position_embeddings"), beta_fast=scaling.get("beta_fast") or 32,
        beta_slow=scaling.get("beta_slow") or 1, mscale=scaling.get("mscale") or 1.0,
        mscale_all_dim=scaling.get("mscale_all_dim") or 0.0)
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 and key != "mscale_all_dim":
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")
    if not values["mscale"] or not values["mscale_all_dim"]:
        # transformers' attention factor is then get_mscale(factor) (mscale 1 over 1), megatron-core's
        # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim): equal only with mscale 1, no mscale_all_dim
        if values["mscale"] != 1.0:
            raise ValueError("rope_scaling mscale without mscale_all_dim is not supported (transformers then ignores "
                             "it, megatron-core would not)")
        values["mscale_all_dim"] = 0.0
    return (("rope_type", "yarn"), *((f"yarn_{k}", float(v) if k != "original_max_position_embeddings" else int(v))
                                      for k, v in values.items()))


def parse(config: dict[str, Any]) -> ModelArch:
    """config.json -> ModelArch; ValueError naming a field this implementation would ignore or compute otherwise."""
    dense.check_plain_decoder(config)
    if config.get("attention_bias"):
        raise ValueError("attention_bias true is not supported (megatron-core's MLA projections have no bias)")
    if config.get("rope_interleave", True) is not True:
        raise ValueError("rope_interleave false is not supported (megatron-core's MLA applies RoPE to interleaved "
                         "pairs, as DeepSeek-V3's checkpoints are laid out)")
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config.get(name, want) != want:
            raise ValueError(f"{name} {config[name]!r} is not supported (DeepSeek-V3's {want!r})")
    if config.get("norm_topk_prob", True) is not True:
        raise ValueError("norm_topk_prob false is not supported (megatron-core's sigmoid router always renormalises "
                         "the top-k weights)")
    fields = dense_decoder_fields(config)
    heads, layers = fields["num_heads"], fields["num_layers"]
    q_lora = config.get("q_lora_rank", DEFAULTS["q_lora_rank"])
    q_lora = None if q_lora is None else _int(config, "q_lora_rank")
    kv_lora, nope, rope, v = (_int(config, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                         "v_head_dim"))
    experts = config.get("n_routed_experts", config.get("num_local_experts"))
    if experts is None:
        raise ValueError("missing ['n_routed_experts']")
    experts, topk, moe_size = experts, _int(config, "num_experts_per_tok"), _int(config, "moe_intermediate_size")
    first_dense = _int(config, "first_k_dense_replace", minimum=0)
    if first_dense >= layers:
        raise ValueError(f"first_k_dense_replace {first_dense} leaves no MoE layer of {layers} (a dense model)")
    groups, topk_group = _int(config, "n_group"), _int(config, "topk_group")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1 or experts % groups:
        raise ValueError(f"n_routed_experts {experts!r} must be a positive multiple of n_group ({groups})")
    if topk_group > groups:
        raise ValueError(f"topk_group {topk_group} exceeds n_group {groups}")
    if topk_group < groups and (topk // topk_group != 2 or experts // groups < 2):
        raise ValueError(f"topk_group {topk_group} with num_experts_per_tok {topk} is not supported: HF scores a group "
                         "by its top-2 sum, megatron-core by the top num_experts_per_tok // topk_group")
    shared = _int(config, "n_shared_experts", minimum=0) if config.get("n_shared_experts", 1) is not None else 0
    if shared == 0:
        raise ValueError("n_shared_experts 0 / null is not supported (DeepseekV3MoE always builds its shared experts)")
    scale = config.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"routed_scaling_factor must be a positive number, got {scale!r}")
    mtp = _int(config, "num_nextn_predict_layers", minimum=0) if config.get("num_nextn_predict_layers") else 0
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {config['moe_layer_freq']!r} is not supported (every layer from "
                         "first_k_dense_replace on is MoE, as in DeepSeek-V3's releases)")
    options = (("mtp_layers", mtp), ("multi_latent_attention", True), ("q_lora", q_lora is not None),
               ("no_q_lora", q_lora is None),
               ("q_lora_rank", q_lora or 0), ("kv_lora_rank", kv_lora), ("qk_nope_head_dim", nope),
               ("qk_rope_head_dim", rope),
               ("v_head_dim", v), ("kv_down_rows", kv_lora + rope), ("kv_up_rows", heads * (nope + v)),
               ("o_cols", heads * v), ("shared_expert_size", shared * moe_size), ("n_group", groups),
               ("topk_group", topk_group), ("routed_scaling_factor", float(scale)), *_rope_options(config))
    fields.update(num_kv_heads=heads, head_dim=nope + rope)  # q heads of nope + rope dims; k/v: the latent
    return ModelArch(**fields, qkv_bias=False, qk_layernorm=True, family_options=options, num_experts=experts,
                     num_experts_per_tok=topk, moe_intermediate_size=moe_size, norm_topk_prob=True,
                     moe_layers=tuple(range(first_dense, layers)), router_aux_loss_coef=0.0)


def transformer_config_fields(arch: ModelArch) -> dict[str, Any]:
    """MLATransformerConfig's MLA, rope and routing fields (models/config.py builds an MLATransformerConfig when
    multi_latent_attention is set).

    Routing equals HF's DeepseekV3TopkRouter: sigmoid scores; expert_bias (= e_score_correction_bias) added for the
    choice only; group-limited top-k (moe_router_num_groups / group_topk; None when every group is kept, a no-op);
    weights = chosen scores / their sum (megatron-core always renormalises sigmoid top-k > 1, HF under
    norm_topk_prob), then x moe_router_topk_scaling_factor (HF: x routed_scaling_factor after the renormalisation,
    the same order). The bias is not updated (moe_router_bias_update_rate 0): an RL run keeps the pretrained
    balance; megatron-core's update would move it from token counts every step.
    """
    from megatron_dapo.models import moe

    o = dict(arch.family_options)
    grouped = o["topk_group"] < o["n_group"]
    rope = {"rope_type": o["rope_type"], "rotary_base": arch.rope_theta}
    if o["rope_type"] == "yarn":
        rope.update(rotary_scaling_factor=o["yarn_factor"],
                    original_max_position_embeddings=o["yarn_original_max_position_embeddings"],
                    beta_fast=o["yarn_beta_fast"], beta_slow=o["yarn_beta_slow"], mscale=o["yarn_mscale"],
                    mscale_all_dim=o["yarn_mscale_all_dim"])
    else:  # softmax_scale's yarn mscale (factor 40 by default) is 1 with mscale_all_dim 0
        rope.update(mscale_all_dim=0.0)
    return {
        **dense.transformer_config_fields(arch),
        **moe.transformer_config_fields(arch),
        "multi_latent_attention": True,
        "q_lora_rank": o["q_lora_rank"] or None,
        "kv_lora_rank": o["kv_lora_rank"],
        "qk_head_dim": o["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": o["qk_rope_head_dim"],
        "v_head_dim": o["v_head_dim"],
        **rope,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": o["n_group"] if grouped else None,
        "moe_router_group_topk": o["topk_group"] if grouped else None,
        "moe_router_topk_scaling_factor": o["routed_scaling_factor"],
        "moe_shared_expert_intermediate_size": o["shared_expert_size"],
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
    }


MTP_WHY = ("DeepSeek-V3's multi-token-prediction layer (num_nextn_predict_layers) is not part of the policy: RL "
           "trains and syncs the main model only; a rollout server's MTP speculative decoding would keep the "
           "pretrained draft layer, whose acceptance falls as the policy moves (docs/MODELS.md)")


def dropped_hf_tensors(arch: ModelArch) -> tuple[tuple[str, ...], str]:
    """The multi-token-prediction layers' HF prefixes (`model.layers.{num_hidden_layers + i}.`, as DeepSeek-V3's
    release stores them) and why a load leaves them out (MTP_WHY)."""
    n = dict(arch.family_options)["mtp_layers"]
    return tuple(f"model.layers.{arch.num_layers + i}." for i in range(n)), MTP_WHY


def layer_spec_options(arch: ModelArch) -> dict[str, Any]:
    """The MLA layer with its q / kv latent RMSNorms (megatron-core builds them under qk_layernorm), at HF's eps for
    them (HF_NORM_EPS: Moonlight's rms_norm_eps 1e-5 is not theirs)."""
    return {"qk_layernorm": True, "multi_latent_attention": True, "latent_norm_eps": HF_NORM_EPS}


def model_kwargs(arch: ModelArch) -> dict[str, Any]:
    """GPTModel kwargs: 'rope' (GPTModel then builds no rotary embedding of its own under MLA: MLASelfAttention
    holds the plain or YaRN one, per transformer_config_fields)."""
    return dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta)


def activation_terms(arch: ModelArch) -> dict[str, Any]:
    """The planner's model terms (`planner.activations.ActivationSpec`): the dense decoder's (gated MLP, no dropout,
    unfused rope, qk_norm: here MLA's q / kv latent RMSNorms), MLA's latent ranks and head dims, the shared experts,
    sigmoid routing without a load-balancing loss."""
    o = dict(arch.family_options)
    return {**dense.activation_terms(arch), "q_lora": o["q_lora_rank"], "kv_lora": o["kv_lora_rank"],
            "rope_dim": o["qk_rope_head_dim"], "v_dim": o["v_head_dim"], "shared_ffn": o["shared_expert_size"],
            "router_scores": "sigmoid", "aux_loss": False}


def kv_cache_elements(arch: ModelArch, tp: int) -> int:
    """SGLang's MLA KV cache per token and layer: the normalised kv latent and the roped shared key, kv_lora_rank +
    qk_rope_head_dim, whole on every TP rank: 576, 70 KB per token over DeepSeek-V3's 61 layers in bf16 (GQA's K and V
    of 128 / 8 heads x 192 at TP8 would be 2 x 16 x 192 per layer, 10.7x that)."""
    return arch.option("kv_lora_rank") + arch.option("qk_rope_head_dim")


FAMILY = ModelFamily(
    model_type="deepseek_v3",
    order=4,
    hf_model_class="DeepseekV3ForCausalLM",
    hf_config_class="DeepseekV3Config",
    mapping=MAPPING,
    parse=parse,
    transformer_config_fields=transformer_config_fields,
    layer_spec_options=layer_spec_options,
    model_kwargs=model_kwargs,
    activation_terms=activation_terms,
    kv_cache_elements=kv_cache_elements,
    dropped_hf_tensors=dropped_hf_tensors,
    arch_defaults={"qkv_bias": False, "qk_layernorm": True},
    # q_lora_rank set, first layer dense, 8 experts in 4 groups (top-2 groups, top-4 experts: top-2 sums agree),
    # one shared expert, routed_scaling_factor 2.5; heads' q dims (16 nope + 8 rope) != v dims (12). moe_layer_freq,
    # topk_method, scoring_func: DeepSeek-V3's values, which its config.json carries and SGLang reads.
    tiny_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
                     rms_norm_eps=1e-6, rope_theta=10000.0, n_routed_experts=8, num_experts_per_tok=4,
                     moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, moe_layer_freq=1,
                     topk_method="noaux_tc", scoring_func="sigmoid"),
)
