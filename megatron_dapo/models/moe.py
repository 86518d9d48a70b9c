"""What a mixture-of-experts decoder family adds to the dense one: the router and per-expert name-table
entries, the config.json MoE fields, and megatron-core's MoE TransformerConfig fields.

An MoE layer replaces the dense SwiGLU MLP by a router (a [num_experts, hidden] linear: softmax over the
experts, top-k, optionally renormalised) and `num_experts` SwiGLU experts of `moe_intermediate_size`.
megatron-core runs it as its MoELayer: TopKRouter, the alltoall token dispatcher, SequentialMLP of
local experts on CPU, TEGroupedMLP (grouped GEMM) under TransformerEngine; experts are split over the
expert-parallel ranks (`--expert-model-parallel-size`), each expert's linears over the expert-TP ranks
(`--expert-tensor-parallel-size`). docs/MODELS.md and docs/PARALLELISM.md say more.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models.family import MappingEntry

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_E = _L + "mlp.experts.local_experts.{expert}."

MOE_ENTRIES: tuple[MappingEntry, ...] = (
    MappingEntry(
        mcore=_L + "mlp.router.weight",
        hf=(_H + "mlp.gate.weight",),
        kind="replicated",
        stage="layer",
        shapes=(("num_experts", "hidden_size"),),
        layers="moe",
    ),
    MappingEntry(
        mcore=_E + "linear_fc1.weight",
        hf=(_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight"),
        kind="fc1",
        stage="layer",
        shapes=(("moe_intermediate_size", "hidden_size"), ("moe_intermediate_size", "hidden_size")),
        aliases=(_L + "mlp.experts.linear_fc1.weight{expert}",),  # TEGroupedMLP (grouped GEMM)
        layers="moe",
        dist=_L + "mlp.experts.experts.linear_fc1.weight",
    ),
    MappingEntry(
        mcore=_E + "linear_fc2.weight",
        hf=(_H + "mlp.experts.{expert}.down_proj.weight",),
        kind="row",
        stage="layer",
        shapes=(("hidden_size", "moe_intermediate_size"),),
        aliases=(_L + "mlp.experts.linear_fc2.weight{expert}",),
        layers="moe",
        dist=_L + "mlp.experts.experts.linear_fc2.weight",
    ),
)
"""Router and experts of an MoE layer. HF names are the on-disk per-expert ones (Qwen3-MoE safetensors,
what SGLang's /update_weights_from_tensor takes); megatron-core's local spec holds expert j of EP rank r as
`local_experts.j` (global expert r * E / EP + j); a dist checkpoint holds all E of a layer in one tensor with a
leading expert axis (`dist`)."""


def with_moe_entries(mapping: tuple[MappingEntry, ...]) -> tuple[MappingEntry, ...]:
    """`mapping` (a dense table) with MOE_ENTRIES after its dense MLP entries (HF's order within a layer)."""
    at = max(i for i, e in enumerate(mapping) if e.layers == "dense") + 1
    return mapping[:at] + MOE_ENTRIES + mapping[at:]


def moe_layers(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The MoE layers of a config.json: not in `mlp_only_layers`, and (layer + 1) a multiple of
    `decoder_sparse_step` (HF Qwen3MoeDecoderLayer's rule). ValueError naming the field on a bad value."""
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ValueError(f"mlp_only_layers must be a list of layer indices in 0..{num_layers - 1}, got {dense!r}")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def moe_fields(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelArch MoE fields of a config.json (`num_experts`, or transformers 5's `num_local_experts`)."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", config.get("num_experts_per_tok")),
                              ("moe_intermediate_size", config.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"missing {missing}")
    norm = config.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob must be true or false, got {norm!r}")
    coef = config.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)):
        raise ValueError(f"router_aux_loss_coef must be a number, got {coef!r}")
    return dict(num_experts=experts, num_experts_per_tok=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"], norm_topk_prob=norm,
                moe_layers=moe_layers(config, num_layers), router_aux_loss_coef=float(coef))


def moe_layer_freq(arch: Any) -> int | list[int]:
    """megatron-core's `moe_layer_freq`: 1 when every layer is MoE (the layers then stack in a dist
    checkpoint, as Megatron-LM's default), else the 0/1 list (1 = MoE) of the per-layer block spec."""
    if arch.all_layers_moe:
        return 1
    return [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)]


def transformer_config_fields(arch: Any) -> dict[str, Any]:
    """megatron-core's MoE TransformerConfig fields for `arch`'s routing.

    Routing equals HF's "softmax over all experts, top-k, renormalise when norm_topk_prob": megatron-core's
    `moe_router_pre_softmax=False` (top-k of the logits, softmax over the k kept) is the same function when
    renormalised; `pre_softmax=True` (softmax over all, top-k, no renormalisation) is HF's norm_topk_prob false.
    The load-balancing loss is megatron-core's Switch loss per layer (`aux_loss`; docs/MODELS.md has how it
    relates to HF's); its coefficient is `--moe-aux-loss-coeff` (the actor's override), config.json's
    router_aux_loss_coef by default.
    """
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.num_experts_per_tok,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_layer_freq=moe_layer_freq(arch),
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        moe_token_dispatcher_type="alltoall",
    )
