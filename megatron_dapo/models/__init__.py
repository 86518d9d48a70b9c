"""Qwen2 / Qwen2.5 on megatron-core: HF config -> TransformerConfig, layer spec, GPTModel.

`hf_config` stays importable without megatron-core (rollout and converter environments import it);
the megatron-backed names below are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_dapo.models.hf_config import ModelArch

_LAZY = {
    "transformer_config_from_arch": "megatron_dapo.models.config",
    "get_layer_spec": "megatron_dapo.models.spec",
    "te_available": "megatron_dapo.models.spec",
    "build_gpt_model": "megatron_dapo.models.gpt",
}

__all__ = ["ModelArch", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_dapo.models' has no attribute {name!r}")
