"""ModelArch -> megatron-core TransformerConfig (one mapping of HF fields to Megatron fields)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_dapo.distributed.parallel import ParallelLayout, validate_layout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.spec import apex_wgrad_available, te_available

# Kernels that need CUDA / apex: off on a CPU-only torch (the megatron-core-on-cpu note).
CPU_ONLY_SETTINGS: dict[str, Any] = {
    "use_cpu_initialization": True,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "cross_entropy_loss_fusion": False,
}

_DTYPE_FLAGS = {torch.float32: {}, torch.bfloat16: {"bf16": True}, torch.float16: {"fp16": True}}


def transformer_config_from_arch(
    arch: ModelArch, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32,
    layout: ParallelLayout | None = None, **overrides: Any
) -> TransformerConfig:
    """Megatron TransformerConfig of `arch`'s decoder split over tp x pp ranks.

    Sizes, GQA (`num_kv_heads` query groups), head_dim and the norm epsilon come from the arch; the norm,
    activation, biases, dropout and qk_layernorm from its family (`arch.family.transformer_config_fields`).
    `layout` (when given, its tp/pp must equal tp/pp) adds context parallelism, sequence
    parallelism and activation recomputation. `overrides` are TransformerConfig fields set last
    (e.g. calculate_per_token_loss=True).
    """
    if layout is None:
        layout = ParallelLayout(tp=tp, pp=pp)
    elif (layout.tp, layout.pp) != (tp, pp):
        raise ValueError(f"transformer_config_from_arch(tp={tp}, pp={pp}) differs from the layout's "
                         f"(tp={layout.tp}, pp={layout.pp})")
    validate_layout(arch, layout)
    if params_dtype not in _DTYPE_FLAGS:
        raise ValueError(f"params_dtype must be one of {list(_DTYPE_FLAGS)}, got {params_dtype}")
    fields: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        layernorm_epsilon=arch.rms_norm_eps,
        **arch.family.transformer_config_fields(arch),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        **_DTYPE_FLAGS[params_dtype],
    )
    # Parallel sizes, sequence parallelism and activation recomputation (--sequence-parallel,
    # --recompute-*, --context-parallel-size): one source, the layout.
    fields.update(layout.transformer_config_fields())
    if layout.layers_per_virtual_stage is not None:  # --num-layers-per-virtual-pipeline-stage
        fields["virtual_pipeline_model_parallel_size"] = layout.virtual_stages(arch.num_layers)
    if not torch.cuda.is_available():
        fields.update(CPU_ONLY_SETTINGS)
    cuda = torch.cuda.is_available()  # Megatron-LM's GPU fusions, each where its kernel exists
    fields.update(fusion_settings(cuda=cuda, use_te=cuda and te_available(),
                                  apex_wgrad=cuda and apex_wgrad_available()))
    if fields.get("multi_latent_attention") and fields.get("rope_type") != "yarn":
        # megatron-core 0.16.1's fused MLA rope kernel is YaRN's (MLATransformerConfig raises on it with plain RoPE)
        fields["apply_rope_fusion"] = False
    unknown = sorted(set(overrides) - set(TransformerConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"transformer_config_from_arch: {unknown} are not TransformerConfig fields")
    fields.update(overrides)
    # A family with multi-head latent attention sets its MLA fields (latent ranks, rope type): megatron-core keeps
    # them on a TransformerConfig subclass.
    config_class = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return config_class(**fields)


# The fusions Megatron-LM turns on for GPU training (megatron-core's dataclass defaults are all False).
FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


def fusion_settings(*, cuda: bool, use_te: bool, apex_wgrad: bool) -> dict[str, bool]:
    """FUSIONS on or off, each where its kernel exists (megatron-core 0.16.1); all off without CUDA.

    - bias_activation_fusion (SwiGLU) and bias_dropout_fusion: megatron-core's own torch.compile'd
      functions (megatron/core/fusions), on any CUDA device, with TE or local layers;
    - apply_rope_fusion: TransformerEngine's fused RoPE kernel (TransformerConfig rejects it without TE);
    - gradient_accumulation_fusion: the wgrad GEMM accumulates straight into the fp32 main_grad. TE linears
      do it themselves, but the GPT output layer is megatron's ColumnParallelLinear, which raises at
      construction without apex's fused_weight_gradient_mlp_cuda: on only with apex (`apex_wgrad`).
    """
    if not cuda:
        return dict.fromkeys(FUSIONS, False)
    return {"bias_activation_fusion": True, "bias_dropout_fusion": True, "apply_rope_fusion": use_te,
            "gradient_accumulation_fusion": apex_wgrad}
