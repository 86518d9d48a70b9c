"""The registered model families, keyed by HF config.json `model_type`.

Registering a family is one line: its package's dotted path in FAMILY_MODULES (the package defines
`FAMILY`, a `models.family.ModelFamily`). Packages are imported on first lookup, so importing this
module (and `models.hf_config`) never pulls in megatron-core or transformers.
"""

from __future__ import annotations

import importlib

from megatron_dapo.models.family import ModelFamily

FAMILY_MODULES: tuple[str, ...] = (
    "megatron_dapo.models.qwen2",
    "megatron_dapo.models.qwen3",
    "megatron_dapo.models.llama",
    "megatron_dapo.models.qwen3_moe",
)

_FAMILIES: dict[str, ModelFamily] = {}


def families() -> dict[str, ModelFamily]:
    """model_type -> family, for every registered family (imports them on the first call)."""
    if not _FAMILIES:
        for path in FAMILY_MODULES:
            fam = importlib.import_module(path).FAMILY
            if fam.model_type in _FAMILIES:
                raise ValueError(f"model_type {fam.model_type!r} is registered twice ({path})")
            _FAMILIES[fam.model_type] = fam
    return _FAMILIES


def model_types() -> tuple[str, ...]:
    """The supported config.json model_type values."""
    return tuple(families())


def family(model_type: object) -> ModelFamily:
    """The family of a config.json model_type; ValueError naming the field and the supported values."""
    registered = families()
    if model_type is None:
        raise ValueError(f"model_type is missing; supported: {tuple(registered)} (a new family: docs/MODELS.md)")
    if model_type not in registered:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {tuple(registered)} "
                         "(a new family: docs/MODELS.md)")
    return registered[model_type]  # type: ignore[index]
