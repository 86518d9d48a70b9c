"""HF decoder families on megatron-core: HF config -> TransformerConfig, layer spec, GPTModel.

Each family is a plug-in folder (`models/<model_type>/`, found by `registry.py`; docs/MODELS.md).
`hf_config`, `family` and `registry` stay importable without megatron-core (rollout and converter environments
import them);
the megatron-backed names below are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_dapo.models.family import ModelFamily
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families, family

_LAZY = {
    "transformer_config_from_arch": "megatron_dapo.models.config",
    "get_layer_spec": "megatron_dapo.models.spec",
    "te_available": "megatron_dapo.models.spec",
    "build_gpt_model": "megatron_dapo.models.gpt",
}

__all__ = ["ModelArch", "ModelFamily", "families", "family", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_dapo.models' has no attribute {name!r}")
