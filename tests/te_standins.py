"""megatron-core's Transformer Engine layer specs on CPU, without Transformer Engine.

The module trees, parameter names and `sharded_state_dict()` keys of a TE build come from megatron-core's own spec
builders (`get_gpt_layer_with_transformer_engine_spec`, `get_gpt_decoder_block_spec(use_transformer_engine=True)`);
only the TE modules they pick are replaced by CPU twins registering the same parameters and `_extra_state`:

- `CpuLayerNormColumnParallelLinear`: TELayerNormColumnParallelLinear (the pre-attention / dense pre-MLP norm fused
  into linear_qkv / linear_fc1 as `layer_norm_weight`);
- `CpuTENorm`: TENorm (TE's RMSNorm: a weight and `_extra_state`): the final norm, the q/k norms, and an MoE layer's
  separate `pre_mlp_layernorm`;
- `cpu_te_dot_product_attention`: TEDotProductAttention (the local attention, taking MLA's k / v head dims);
- `CpuTELinear`: TELinear in megatron-core's MLA's 'duplicated' mode (its q / kv down projections, whole on every
  TP rank; `sharded_state_dict` megatron-core's own, as below);
- `CpuColumnGroupedLinear` / `CpuRowGroupedLinear`: TEColumn/RowParallelGroupedLinear of TEGroupedMLP (an MoE layer's
  experts under grouped GEMM: `weight0..weight{E-1}`); their `sharded_state_dict` is megatron-core's own source,
  lifted from `megatron/core/extensions/transformer_engine.py` (defined there only when TE imports), so the expert
  keys of a TE checkpoint are megatron's, not a re-statement of them.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


class CpuLayerNormColumnParallelLinear(ColumnParallelLinear):
    """TELayerNormColumnParallelLinear's CPU twin: RMSNorm(layer_norm_weight) then the column-parallel linear."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon

    def forward(self, x, *args, **kwargs):
        return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps), *args, **kwargs)


class CpuTENorm(torch.nn.RMSNorm):
    """TE's RMSNorm as megatron-core's TENorm builds it: a norm with `_extra_state` in its state dict (TE 2.x's
    RMSNorm is a fusible operation, which serialises its quantization metadata there). Records what
    set_extra_state received."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.extra_state_loaded: list = []

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        self.extra_state_loaded.append(state)


class _CpuGroupedLinear(torch.nn.Module):
    """TE GroupedLinear's CPU twin as megatron-core's TEGroupedLinear wraps it: `num_gemms` expert weights
    `weight{i}` [out, in] (this expert-TP rank's slice), `forward(x, m_splits)` runs gemm i on the i-th block of
    m_splits[i] rows and returns (out, None); `_extra_state` in the state dict (None: no FP8 metadata)."""

    parallel_mode = ""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None = None,
                 pg_collection=None) -> None:
        super().__init__()
        if bias or not is_expert:
            raise NotImplementedError("the CPU grouped linear has no bias and serves experts only")
        self._pg_collection, self._tp_group = pg_collection, pg_collection.expt_tp
        tp = self._tp_group.size()
        output_size = output_size // tp if self.parallel_mode == "column" else output_size
        input_size = input_size // tp if self.parallel_mode == "row" else input_size
        self.num_gemms, self.use_bias, self.config = num_gemms, False, config
        self.fp8, self.fp8_calibration, self.fp8_meta = False, False, {"fp8_checkpoint": False}
        expert_parallel = config.expert_model_parallel_size > 1
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(weight)
            weight.allreduce = not expert_parallel  # what TEGroupedLinear sets (DDP's expert grouping)
            self.register_parameter(f"weight{i}", weight)
        self._register_load_state_dict_pre_hook(self._merge_extra_states)

    def _merge_extra_states(self, state_dict, prefix, *_args) -> None:
        """TEGroupedLinear's load pre-hook (`merge_extra_states`) for states without FP8 metadata: the dist
        checkpoint's per-gemm `_extra_state1..{n-1}` are dropped, `_extra_state` is the module's."""
        for i in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        blocks = torch.split(x, m_splits)
        out = [b @ getattr(self, f"weight{i}").t() for i, b in enumerate(blocks)]
        return torch.cat(out), None

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


class _CpuDuplicatedLinear(torch.nn.Module):
    """TELinear's CPU twin in the one mode megatron-core's multi-head latent attention builds it, 'duplicated' (its
    q / kv down projections): the whole `weight` [out, in] on every TP rank, no TP communication, tagged
    `sequence_parallel` under SP as TELinear tags it (each rank then sees its s / tp slice: a partial gradient);
    `_extra_state` in the state dict."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None, config, init_method,
                 bias: bool, skip_bias_add: bool, skip_weight_param_allocation: bool,
                 tp_comm_buffer_name: str | None = None, is_expert: bool = False, symmetric_ar_type=None,
                 tp_group=None) -> None:
        super().__init__()
        if parallel_mode != "duplicated" or bias or is_expert:
            raise NotImplementedError("the CPU TELinear is MLA's duplicated down projection only")
        self.parallel_mode, self._tp_group, self.config = None, tp_group, config  # TE's mode for 'duplicated'
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


def cpu_te_dot_product_attention() -> type:
    """TEDotProductAttention's CPU twin: megatron-core's local DotProductAttention (the same softmax(q k^T) v, unfused)
    taking TE's `k_channels` / `v_channels`, which multi-head latent attention passes (q/k heads of nope + rope dims,
    v heads of v_head_dim): the context is then v_channels wide per head. The scores take their head dim from q and
    k and MLASelfAttention passes its softmax_scale."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CpuTEDotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_attention_head = v_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return CpuTEDotProductAttention


def _megatron_methods(class_name: str, names: tuple[str, ...]) -> list[ast.FunctionDef]:
    """The FunctionDefs `names` of class `class_name` in megatron-core's transformer_engine.py (found inside its
    `if HAVE_TE` block)."""
    from megatron.core.extensions import transformer_engine as te_ext

    tree = ast.parse(inspect.getsource(te_ext))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            found = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in names]
            if len(found) == len(names):
                return found
    raise AssertionError(f"megatron-core's transformer_engine.py has no {class_name}.{names}")


def _with_megatron_methods(base: type, class_name: str, names: tuple[str, ...]) -> type:
    """A subclass of `base` whose methods `names` are megatron-core's `class_name`'s, compiled in that module's
    globals (so their helpers and zero-argument super() resolve as there)."""
    from megatron.core.extensions import transformer_engine as te_ext

    cls = ast.ClassDef(name=class_name, bases=[ast.Name("_Base", ast.Load())], keywords=[],
                       body=_megatron_methods(class_name, names), decorator_list=[], type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
    namespace: dict[str, Any] = {**vars(te_ext), "_Base": base}
    exec(compile(module, inspect.getsourcefile(te_ext), "exec"), namespace)  # noqa: S102 (megatron's own source)
    return namespace[class_name]


_Grouped = _with_megatron_methods(_CpuGroupedLinear, "TEGroupedLinear",
                                  ("_split_extra_state", "_sharded_state_dict_grouped"))


class _ColumnBase(_Grouped):
    parallel_mode = "column"


class _RowBase(_Grouped):
    parallel_mode = "row"


CpuColumnGroupedLinear = _with_megatron_methods(_ColumnBase, "TEColumnParallelGroupedLinear", ("sharded_state_dict",))
CpuRowGroupedLinear = _with_megatron_methods(_RowBase, "TERowParallelGroupedLinear", ("sharded_state_dict",))
CpuTELinear = _with_megatron_methods(_CpuDuplicatedLinear, "TELinear", ("sharded_state_dict",))


class CpuTESpecProvider(LocalSpecProvider):
    """megatron-core's TESpecProvider choices where they matter for names: the norm fused into the linear, TENorm
    for the other norms, TEGroupedMLP of grouped linears for the experts under grouped GEMM."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def linear(self) -> type:
        return CpuTELinear

    def core_attention(self) -> type:
        return cpu_te_dot_product_attention()

    def column_parallel_layer_norm_linear(self) -> type:
        return CpuLayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return CpuTENorm

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        if not moe_use_grouped_gemm or moe_use_legacy_grouped_gemm:
            return super().grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)
        return TEGroupedMLP, MLPSubmodules(linear_fc1=CpuColumnGroupedLinear, linear_fc2=CpuRowGroupedLinear)


def patch_te_build(mp: pytest.MonkeyPatch) -> None:
    """Under `mp`: megatron-core's spec builders and megatron_dapo's `get_layer_spec(use_te=True)` build the TE specs
    with the CPU twins (TESpecProvider, TENorm, a TE build's final norm), as on a TE build."""
    from megatron.core.models.gpt import gpt_layer_specs

    mp.setattr(gpt_layer_specs, "TESpecProvider", CpuTESpecProvider, raising=False)
    mp.setattr(gpt_layer_specs, "TENorm", CpuTENorm, raising=False)
    mp.setattr("megatron.core.transformer.transformer_block.LayerNormImpl", CpuTENorm)
    mp.setattr("megatron_dapo.models.spec.te_available", lambda: True)
    # MLASelfAttention picks the 'duplicated' mode for its down projections by identity with its own TELinear name
    mp.setattr("megatron.core.transformer.multi_latent_attention.TELinear", CpuTELinear)
