"""The registered model families, keyed by HF config.json `model_type`.

The folder is the registration: every subpackage of `megatron_dapo.models` that defines `FAMILY` (a
`models.family.ModelFamily`) is a family, found on the first lookup (as `dotted_path.Registry` finds the losses),
so a new family is one new folder and nothing lists it. Subpackages are imported on that first lookup, so importing
this module (and `models.hf_config`) never pulls in megatron-core or transformers.
"""

from __future__ import annotations

import importlib
import pkgutil

from megatron_dapo.models.family import ModelFamily

PACKAGE = "megatron_dapo.models"
"""Where the family folders live: its subpackages that define FAMILY."""

_FAMILIES: dict[str, ModelFamily] = {}


def family_modules() -> dict[str, ModelFamily]:
    """Dotted path -> FAMILY of every subpackage of PACKAGE that defines one (imports them), in registry order:
    by `ModelFamily.order`, then the ones without an order by package name. Modules (not packages) and packages
    without FAMILY are not families."""
    found: dict[str, ModelFamily] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(PACKAGE).__path__), key=lambda i: i.name):
        if not info.ispkg:
            continue
        path = f"{PACKAGE}.{info.name}"
        fam = getattr(importlib.import_module(path), "FAMILY", None)
        if fam is None:
            continue
        if not isinstance(fam, ModelFamily):
            raise TypeError(f"{path}.FAMILY is a {type(fam).__name__}, not a models.family.ModelFamily")
        found[path] = fam
    return dict(sorted(found.items(), key=lambda item: (item[1].order is None, item[1].order or 0)))


def families() -> dict[str, ModelFamily]:
    """model_type -> family, for every registered family (imports them on the first call); ValueError naming both
    packages when two register one model_type."""
    if not _FAMILIES:
        paths: dict[str, str] = {}
        found: dict[str, ModelFamily] = {}
        for path, fam in family_modules().items():
            if fam.model_type in found:
                raise ValueError(f"model_type {fam.model_type!r} is registered twice ({paths[fam.model_type]} and "
                                 f"{path})")
            paths[fam.model_type], found[fam.model_type] = path, fam
        _FAMILIES.update(found)  # all or nothing: a failed first call leaves the next one to fail the same way
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
