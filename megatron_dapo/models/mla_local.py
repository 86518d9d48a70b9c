"""megatron-core 0.16.1's multi-head latent attention on the local spec (CPU), made to match its TE layer.

Three things stand between `get_gpt_layer_local_spec(multi_latent_attention=True)` and a local MLA layer that trains
and checkpoints like the TransformerEngine one a GPU run builds:

- **The core attention.** MLASelfAttention passes `k_channels` (q/k head dim: nope + rope) and `v_channels` (v head
  dim) to its core attention, which only TEDotProductAttention accepts: the local DotProductAttention raises
  TypeError on them. The scores already take their head dim from q and k (MLASelfAttention passes its
  softmax_scale); only the context's reshape assumes kv_channels per head, so `local_mla_core`'s subclass sets it
  from v_channels. Without transformer_engine, megatron-core's `multi_latent_attention` module still sets HAVE_TE
  (its `extensions.transformer_engine` import succeeds and leaves MagicMock placeholders), so MLASelfAttention's
  `isinstance(self.linear_proj, TELinear)` raises TypeError: `local_mla_core` clears that flag when TE does not
  import (it gates only TE-linear branches).
- **The latent norms.** The local spec builds them as modules of their own, `q_layernorm` / `kv_layernorm`. Under
  TP > 1 without SP each rank normalises the whole gathered latent and receives its whole gradient (the up
  projection's input gradient is all-reduced), yet `finalize_model_grads` sums every parameter named `q_layernorm`
  over TP when `qk_layernorm` is set (the rule for per-head q/k norms, whose gradients are partial): the local q
  norm would learn at TP x its rate. TE fuses each norm into its up projection (TELayerNormColumnParallelLinear,
  `linear_q_up_proj.layer_norm_weight`), a name that rule does not match. `NormColumnParallelLinear` is that
  fusion on the local spec: the same parameter names and checkpoint keys as TE's, its norm weight tagged
  `sequence_parallel` under SP (each rank then normalises its own s / tp slice, a partial gradient TP sums).
- **The checkpoint keys.** The local MLA layer has no `sharded_state_dict_keys_map`, so its dense layers' pre-MLP
  norm is saved as `pre_mlp_layernorm.weight` where TE's dense layer (the norm fused into linear_fc1) saves
  `mlp.linear_fc1.layer_norm_weight`; `set_local_mla_layer` adds the map the other local layers have, so a
  checkpoint moves between the two implementations (an MoE layer's own pre-MLP norm: `MappingEntry.te_moe_dist`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dapo.models.spec import te_available


def local_mla_core() -> type:
    """megatron-core's local DotProductAttention taking MLA's k_channels / v_channels (see the module doc)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not te_available():
        multi_latent_attention.HAVE_TE = False

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # context [s, b, heads / tp * v_head_dim]
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def norm_column_parallel_linear() -> type:
    """RMSNorm fused in front of megatron-core's ColumnParallelLinear: the local counterpart of TE's
    TELayerNormColumnParallelLinear (parameters `layer_norm_weight` [in] and `weight` [out / tp, in]; see the
    module doc). Its forward maps [s, b, in] (or [s / tp, b, in] under SP) to ColumnParallelLinear's output."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.norm_eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_weight.sequence_parallel = config.sequence_parallel

        def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
            normed = torch.nn.functional.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight,
                                                  self.norm_eps)
            return super().forward(normed, weight, runtime_gather_output)

    return NormColumnParallelLinear


LOCAL_MLA_KEYS_MAP = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The local MLA layer's dist-checkpoint key map: a dense layer's pre-MLP norm under TE's name (module doc)."""


def set_local_mla_layer(layer: ModuleSpec) -> None:
    """Make a local MLA layer spec (from megatron-core's local MoE block spec) build like TE's MLA layer: the core
    attention that takes MLA's head dims, the latent norms fused into their up projections, TE's checkpoint keys."""
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = local_mla_core()
    fused = norm_column_parallel_linear()
    attention.linear_q_up_proj = attention.linear_kv_up_proj = fused
    attention.q_layernorm = attention.kv_layernorm = _identity()
    layer.submodules.sharded_state_dict_keys_map = dict(LOCAL_MLA_KEYS_MAP)


def _identity() -> type:
    from megatron.core.transformer.identity_op import IdentityOp

    return IdentityOp
