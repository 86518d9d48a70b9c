"""The one choice of transformer layer implementation: TransformerEngine on GPU, mcore-local on CPU."""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.transformer.spec_utils import ModuleSpec


def te_available() -> bool:
    """True when transformer_engine imports (a half-built TE raises RuntimeError, not ImportError)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def get_layer_spec(use_te: bool | None = None) -> ModuleSpec:
    """Qwen2 decoder-layer spec (RMSNorm, SwiGLU, GQA attention).

    use_te: None picks TransformerEngine when CUDA is available and TE imports, else megatron-core's
    local spec; True requires TE (raises ImportError naming the fix); False forces the local spec.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = torch.cuda.is_available() and te_available()
    if use_te:
        if not te_available():
            raise ImportError(
                "use_te=True needs transformer_engine (pip install transformer-engine[pytorch] on a CUDA "
                "machine); pass use_te=False or None for megatron-core's local spec"
            )
        # TE fuses the pre-attention / pre-MLP RMSNorm into linear_qkv / linear_fc1; the norm type
        # comes from TransformerConfig.normalization.
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def apex_wgrad_available() -> bool:
    """True when apex's `fused_weight_gradient_mlp_cuda` extension imports.

    megatron-core 0.16.1 needs it for gradient_accumulation_fusion in its own Column/RowParallelLinear
    (tensor_parallel/layers.py raises at construction without it). TE linears fuse the wgrad accumulation
    themselves, but the GPT output layer is always megatron's ColumnParallelLinear, so the fusion needs apex.
    """
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        return False
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True
