"""megatron-core 0.16.1's multi-head latent attention on the local spec (CPU), made to match its TE layer.

Four things stand between `get_gpt_layer_local_spec(multi_latent_attention=True)` and a local MLA layer that trains
and checkpoints like the TransformerEngine one a GPU run builds:

- **The core attention.** MLASelfAttention passes `k_channels` (q/k head dim: nope + rope) and `v_channels` (v head
  dim) to its core attention, which only TEDotProductAttention accepts: the local DotProductAttention raises
  TypeError on them. The scores already take their head dim from q and k (MLASelfAttention passes its
  softmax_scale); only the context's reshape assumes kv_channels per head, so `local_mla_core`'s subclass sets it
  from v_channels. Without transformer_engine, megatron-core's `multi_latent_attention` module still sets HAVE_TE
  (its `extensions.transformer_engine` import succeeds and leaves MagicMock placeholders), so MLASelfAttention's
  `isinstance(self.linear_proj, TELinear)` raises TypeError: `install_without_te` clears that flag when TE does not
  import (it gates only TE-linear branches).
- **The down projections.** The local spec builds q_a / kv_a as ColumnParallelLinear and all-gathers their outputs;
  the gather's backward keeps only this rank's slice of the gradient, right for the latent (its consumer, the
  column-parallel up projection, all-reduces it) but not for the rope key, which each rank applies to its own heads
  only: its gradient stays partial (Megatron-LM issue #1699, open in 0.16.1), with or without SP. TE builds them
  'duplicated' (whole weight, no gather) and, under SP, all-gathers the rope key over the sequence, whose backward
  (a reduce-scatter) sums those partial gradients. `duplicated_linear` is that module on the local spec, so the
  local layer runs TE's path. Without SP at TP > 1 both paths leave the rope key's gradient partial:
  `distributed.parallel.validate_layout` refuses that layout for MLA, as Megatron-LM's arguments do.
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

from functools import cache
from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec


def install_without_te() -> None:
    """Where transformer_engine does not import: clear megatron-core's MLA module's HAVE_TE (its TE import left
    MagicMock placeholders, which its isinstance checks trip on) and make `duplicated_linear` its TELinear, the class
    it builds the duplicated down projections of (module doc). Idempotent."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    multi_latent_attention.TELinear = duplicated_linear()


@cache
def local_mla_core() -> type:
    """megatron-core's local DotProductAttention taking MLA's k_channels / v_channels (see the module doc)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # context [s, b, heads / tp * v_head_dim]
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


@cache
def duplicated_linear() -> type:
    """The local twin of TELinear in its 'duplicated' mode (MLA's q / kv down projections under TE; module doc): the
    whole weight [out, in] on every TP rank, y = x W^T on this rank's input ([s, b, in], or [s / tp, b, in] under SP)
    with no TP communication, the weight tagged `sequence_parallel` under SP (each rank's gradient is then partial
    and TP sums it, as TE tags it), checkpointed replicated (as TELinear.sharded_state_dict). One class per process:
    MLASelfAttention picks the duplicated mode by identity with its module's `TELinear`, which `install_without_te` sets
    to it where TE does not import."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class LocalDuplicatedLinear(torch.nn.Module):
        def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, config: Any,
                     init_method: Any, bias: bool, skip_bias_add: bool, skip_weight_param_allocation: bool = False,
                     tp_comm_buffer_name: str | None = None, is_expert: bool = False, tp_group: Any = None,
                     **_: Any) -> None:
            super().__init__()
            if parallel_mode != "duplicated" or bias or is_expert or skip_weight_param_allocation:
                raise ValueError("DuplicatedLinear builds MLA's duplicated down projections only (parallel_mode "
                                 f"'duplicated', no bias), got parallel_mode={parallel_mode!r}, bias={bias}")
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(self.weight)
            self.weight.sequence_parallel = config.sequence_parallel

        def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
            # One 2-D GEMM over the folded tokens whatever the grad mode: torch.matmul folds [s, b, in] only when
            # the weight needs no grad (else it runs a batched GEMM, other bits), and megatron-core's own linears
            # (inside autograd Functions) always fold; a reference model must give its actor's log-probs bit for bit
            out = torch.mm(input_.reshape(-1, input_.shape[-1]), self.weight.t())
            return out.view(*input_.shape[:-1], out.shape[-1]), None

        def get_extra_state(self) -> None:
            return None

        def set_extra_state(self, state: Any) -> None:
            pass

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                               ) -> dict:
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, None, sharded_offsets,
                tp_group=parallel_state.get_tensor_model_parallel_group(),
                dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return LocalDuplicatedLinear


@cache
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


def with_norm_eps(cls: type, eps: float) -> type:
    """A subclass of the norm-fused linear `cls` (TE's TELayerNormColumnParallelLinear, `norm_column_parallel_linear`'s
    local one) whose fused norm uses `eps` instead of the model's `layernorm_epsilon`: each reads the eps off the
    config it is built with, so the subclass builds it with a copy that says `eps`. DeepSeek-V3's q_a_layernorm and
    kv_a_layernorm keep HF's 1e-6 whatever rms_norm_eps says (Moonlight: 1e-5 elsewhere)."""
    import copy

    class LatentNormLinear(cls):
        def __init__(self, *args: Any, config: Any, **kwargs: Any) -> None:
            config = copy.copy(config)
            config.layernorm_epsilon = eps
            super().__init__(*args, config=config, **kwargs)

    LatentNormLinear.__name__ = LatentNormLinear.__qualname__ = f"{cls.__name__}Eps{eps:g}"
    return LatentNormLinear


def set_latent_norm_eps(layer: ModuleSpec, eps: float) -> None:
    """Build an MLA layer spec's two up projections (their fused latent norms) with `eps` (`with_norm_eps`)."""
    attention = layer.submodules.self_attention.submodules
    for name in ("linear_q_up_proj", "linear_kv_up_proj"):
        spec = getattr(attention, name)
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        setattr(attention, name, _eps_class(module, eps))


@cache
def _eps_class(cls: type, eps: float) -> type:
    return with_norm_eps(cls, eps)


LOCAL_MLA_KEYS_MAP = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The local MLA layer's dist-checkpoint key map: a dense layer's pre-MLP norm under TE's name (module doc)."""


def set_local_mla_layer(layer: ModuleSpec, *, te_imports: bool) -> None:
    """Make a local MLA layer spec (from megatron-core's local MoE block spec) build like TE's MLA layer: the core
    attention that takes MLA's head dims, the down projections duplicated, the latent norms fused into their up
    projections, TE's checkpoint keys. `te_imports`: whether transformer_engine imports (`install_without_te`
    otherwise)."""
    if not te_imports:
        install_without_te()
    attention = layer.submodules.self_attention.submodules
    attention.core_attention = local_mla_core()
    attention.linear_q_down_proj = attention.linear_kv_down_proj = duplicated_linear()
    fused = norm_column_parallel_linear()
    attention.linear_q_up_proj = attention.linear_kv_up_proj = fused
    attention.q_layernorm = attention.kv_layernorm = _identity()
    layer.submodules.sharded_state_dict_keys_map = dict(LOCAL_MLA_KEYS_MAP)


def _identity() -> type:
    from megatron.core.transformer.identity_op import IdentityOp

    return IdentityOp
