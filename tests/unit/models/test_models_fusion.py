"""Megatron-LM's GPU fusions: on in the config built for the CUDA path, off on CPU (issue 11, item 4)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dapo.models import ModelArch
from megatron_dapo.models import config as config_module
from megatron_dapo.models.config import FUSIONS, fusion_settings, transformer_config_from_arch

ARCH = ModelArch(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16)


class _Fields(dict):
    """Stands in for TransformerConfig: keeps the keyword fields."""

    __dataclass_fields__ = TransformerConfig.__dataclass_fields__

    def __init__(self, **fields):
        super().__init__(fields)


def _gpu_path_fields(monkeypatch, *, te: bool, apex: bool) -> dict:
    """transformer_config_from_arch as it runs on a CUDA machine, returning the fields it would pass to
    TransformerConfig (whose own checks need TE's rope kernel, absent here)."""
    monkeypatch.setattr(config_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config_module, "te_available", lambda: te)
    monkeypatch.setattr(config_module, "apex_wgrad_available", lambda: apex)
    monkeypatch.setattr(config_module, "TransformerConfig", _Fields)
    return transformer_config_from_arch(ARCH, params_dtype=torch.bfloat16)


def test_cpu_config_has_every_fusion_off():
    cfg = transformer_config_from_arch(ARCH)
    assert not torch.cuda.is_available()
    assert {f: getattr(cfg, f) for f in FUSIONS} == dict.fromkeys(FUSIONS, False)
    assert cfg.use_cpu_initialization


def test_gpu_path_config_turns_the_fusions_on(monkeypatch):
    fields = _gpu_path_fields(monkeypatch, te=True, apex=True)
    assert {f: fields[f] for f in FUSIONS} == dict.fromkeys(FUSIONS, True)
    assert "use_cpu_initialization" not in fields  # none of the CPU-only settings
    # Without apex, megatron-core's output layer (ColumnParallelLinear) cannot fuse the wgrad accumulation.
    fields = _gpu_path_fields(monkeypatch, te=True, apex=False)
    assert not fields["gradient_accumulation_fusion"]
    assert fields["bias_activation_fusion"] and fields["bias_dropout_fusion"] and fields["apply_rope_fusion"]
    # The local spec on CUDA: megatron's own fusions, not TE's rope kernel.
    fields = _gpu_path_fields(monkeypatch, te=False, apex=False)
    assert (fields["bias_activation_fusion"], fields["apply_rope_fusion"]) == (True, False)


def test_gpu_fusions_are_what_megatron_core_accepts_and_gates():
    """The GPU fields pass TransformerConfig's own validation (SwiGLU fusion with gated silu), and its rope
    check shows why apply_rope_fusion follows TE: without TE it is rejected."""
    cpu = {f: getattr(transformer_config_from_arch(ARCH), f) for f in TransformerConfig.__dataclass_fields__
           if f not in ("use_cpu_initialization",)}
    fused = fusion_settings(cuda=True, use_te=False, apex_wgrad=True)
    cfg = TransformerConfig(**{**cpu, **fused})
    assert cfg.bias_activation_fusion and cfg.bias_dropout_fusion and cfg.gradient_accumulation_fusion
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(**{**cpu, **fusion_settings(cuda=True, use_te=True, apex_wgrad=False)})
    assert fusion_settings(cuda=False, use_te=True, apex_wgrad=True) == dict.fromkeys(FUSIONS, False)
