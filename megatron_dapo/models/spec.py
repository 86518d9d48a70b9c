"""The one choice of transformer layer implementation: TransformerEngine on GPU, mcore-local on CPU.

On CUDA TransformerEngine is required (fused/flash attention keeps no [b, heads, s, s] scores; the local
spec would materialise them: 2 x 40/8 heads x 20480^2 x 2 B = 8.4 GiB per layer at the production
setting), unless --transformer-impl local asks for the local spec explicitly.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

TE_HINT = "pip install transformer-engine[pytorch] on a CUDA machine"


def te_available() -> bool:
    """True when transformer_engine imports (a half-built TE raises RuntimeError, not ImportError)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def cuda_available() -> bool:
    """torch.cuda.is_available(), as the layer-spec choice asks it: the one place that choice reads the device
    (the GPU smoke's dry run on CPU answers True here to rehearse a CUDA machine's choice)."""
    return torch.cuda.is_available()


def resolve_transformer_impl(impl: str | None) -> str:
    """--transformer-impl -> 'transformer_engine' or 'local'.

    None: transformer_engine when CUDA is available (and then TE must import: no silent fallback to the
    local spec), local otherwise. Raises ImportError naming the flag when TE is asked for but missing.
    """
    cuda = cuda_available()
    if impl is None:
        impl = "transformer_engine" if cuda else "local"
    if impl not in ("transformer_engine", "local"):
        raise ValueError(f"--transformer-impl must be transformer_engine or local, got {impl!r}")
    if impl == "transformer_engine" and not te_available():
        where = "CUDA is available, so " if cuda else ""
        raise ImportError(
            f"{where}the decoder layers need transformer_engine, which does not import ({TE_HINT}); pass "
            "--transformer-impl local to run megatron-core's local spec instead (it materialises "
            "[b, heads, s, s] attention scores: only for short sequences)"
        )
    return impl


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm for the local spec under --sequence-parallel.

    megatron-core 0.16.1's local norm (WrappedTorchNorm) asserts sequence_parallel is off. Under SP each
    TP rank normalises its own s/tp slice, so the weight's gradient is partial: tagging the weight
    `sequence_parallel` makes finalize_model_grads sum it over the TP group (TE's norms do the same).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _local_sequence_parallel_spec(config: Any, options: dict[str, Any]) -> ModuleSpec:
    """The local layer spec with SP-aware norms, as a block spec so the final norm is one too."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options)
    # The per-head q/k norms see whole sequences (after the qkv all-gather) but only this rank's heads:
    # finalize_model_grads sums their weight grads over TP by name (q_layernorm / k_layernorm) under
    # qk_layernorm, SP or not. Only WrappedTorchNorm's SP assert is in the way.
    _set_sp_norms(layer, options)
    layers = [layer] * get_num_layers_to_build(config)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=SequenceParallelRMSNorm))


def _set_sp_norms(layer: ModuleSpec, options: dict[str, Any]) -> None:
    """Replace a local layer spec's norms (pre-attention, pre-MLP, the per-head q/k ones) by SP-aware ones."""
    layer.submodules.input_layernorm = SequenceParallelRMSNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if options.get("qk_layernorm") and not options.get("multi_latent_attention"):  # MLA's: mla_local
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = SequenceParallelRMSNorm
        attention.k_layernorm = SequenceParallelRMSNorm


def _moe_block_spec(use_te: bool, config: Any, options: dict[str, Any], vp_stage: int | None,
                    latent_eps: float | None = None) -> Any:
    """The block spec of an MoE model: megatron-core's per-layer choice of an MoE or a dense layer spec
    (config.moe_layer_freq), sliced to this pipeline stage (and model chunk `vp_stage`); multi-head latent
    attention's latent norms with `latent_eps` where given and not the model's eps (`mla_local.with_norm_eps`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                       normalization="RMSNorm", vp_stage=vp_stage)
    layers = {id(spec): spec for spec in block.layer_specs}.values()
    if not use_te and config.sequence_parallel:
        for layer in layers:
            _set_sp_norms(layer, options)
        block.layer_norm = SequenceParallelRMSNorm
    if not use_te and config.multi_latent_attention:
        from megatron_dapo.models.mla_local import set_local_mla_layer

        for layer in layers:
            set_local_mla_layer(layer, te_imports=te_available())
    if config.multi_latent_attention and latent_eps is not None and latent_eps != config.layernorm_epsilon:
        from megatron_dapo.models.mla_local import set_latent_norm_eps

        for layer in layers:
            if layer.submodules.self_attention.module.__name__ == "MLASelfAttention":
                set_latent_norm_eps(layer, latent_eps)
    return block


def get_layer_spec(use_te: bool | None = None, config: Any = None, options: dict[str, Any] | None = None,
                   vp_stage: int | None = None) -> Any:
    """Decoder-layer spec (RMSNorm, SwiGLU, GQA attention) with the family's `options`.

    options: keyword arguments of megatron-core's spec builders from `arch.family.layer_spec_options(arch)`
    (e.g. qk_layernorm), and `latent_norm_eps` (the eps of MLA's latent norms where it is not the model's); None:
    the builders' defaults. An MoE model (config.num_moe_experts) gets a block spec of this stage's layers
    (`vp_stage`: the model chunk), each an MoE or a dense layer as config.json says.
    use_te: None resolves like --transformer-impl's default (TE required on CUDA, local without CUDA);
    True requires TE (raises ImportError naming the fix); False forces the local spec. `config` (the
    TransformerConfig) is needed for the local spec under sequence parallelism (SP-aware norms).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    options = dict(options or {})
    latent_eps = options.pop("latent_norm_eps", None)  # ours, not a megatron-core spec builder argument
    if use_te is None:
        use_te = resolve_transformer_impl(None) == "transformer_engine"
    if config is not None and config.num_moe_experts:
        if use_te and not te_available():
            raise ImportError(f"use_te=True needs transformer_engine ({TE_HINT})")
        return _moe_block_spec(use_te, config, options, vp_stage, latent_eps)
    if use_te:
        if not te_available():
            raise ImportError(
                f"use_te=True needs transformer_engine ({TE_HINT}); pass --transformer-impl local "
                "(use_te=False) for megatron-core's local spec"
            )
        # TE fuses the pre-attention / pre-MLP RMSNorm into linear_qkv / linear_fc1; the norm type
        # comes from TransformerConfig.normalization.
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)
    if config is not None and config.sequence_parallel:
        return _local_sequence_parallel_spec(config, options)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options)


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
