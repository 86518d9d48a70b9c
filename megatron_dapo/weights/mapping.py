"""The functions that read a model family's HF <-> Megatron-core name table.

Each model family's table (`models/<family>/mapping.py`, reached through `arch.family.mapping`) is data: a
tuple of `MappingEntry` (defined with the family in `models/family.py`). Each entry names a megatron-core
parameter (local layer spec, `{layer}` = layer number), the HF tensor(s) it is built from, and a layout
kind that says how it is split over TP ranks:

- ``replicated``: the same tensor on every TP rank (norms).
- ``column``: split along dim 0 (output features).
- ``row``: split along dim 1 (input features): attention output and MLP down projections.
- ``qkv``: HF q, k, v interleaved per query group (its q heads, then k, then v), then dim 0 split.
- ``fc1``: HF gate and up; TP shard r = [gate chunk r; up chunk r].
- ``vocab``: rows padded to a multiple of 128 x TP, then dim 0 split.

The converter, the checkpoint loader and weight sync all read the table of the arch they are given
(`arch_mapping`), so a model family adds its table in its own folder and nothing here. The functions
that interpret the kinds live in `layout.py`.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING

from megatron_dapo.models.family import LAYOUT_KINDS, LayoutKind, MappingEntry, Stage

if TYPE_CHECKING:
    from megatron_dapo.models.hf_config import ModelArch

__all__ = ["LAYOUT_KINDS", "LayoutKind", "MappingEntry", "Stage", "arch_mapping", "canonical_mcore_name", "dist_key",
           "has_output_layer", "hf_names", "resolve_mcore_name"]

def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{layer}"), r"(\d+)") + "$")


def arch_mapping(arch: ModelArch) -> tuple[MappingEntry, ...]:
    """The entries of `arch`'s family table that exist for `arch` (those whose `requires` field is set)."""
    table = arch.family.mapping
    present = tuple(sorted({e.requires for e in table if e.requires and getattr(arch, e.requires)}))
    return _filter(table, present)


@cache
def _filter(table: tuple[MappingEntry, ...], present: tuple[str, ...]) -> tuple[MappingEntry, ...]:
    return tuple(e for e in table if e.requires is None or e.requires in present)


@cache
def _lookup(table: tuple[MappingEntry, ...]) -> tuple[tuple[re.Pattern[str], MappingEntry], ...]:
    return tuple((_template_regex(name), entry) for entry in table for name in (entry.mcore, *entry.aliases))


def resolve_mcore_name(name: str, arch: ModelArch) -> tuple[MappingEntry, int | None]:
    """Find the entry of `arch`'s table for a megatron-core name (canonical or alias) and its layer number.

    Raises KeyError naming the tensor and the model type when the table has no such parameter.
    """
    for pattern, entry in _lookup(arch_mapping(arch)):
        match = pattern.match(name)
        if match:
            return entry, int(match.group(1)) if match.groups() else None
    raise KeyError(f"{name!r} is not a megatron-core parameter of a {arch.model_type!r} model "
                   f"(models/{arch.model_type}/mapping.py)")


def canonical_mcore_name(name: str, arch: ModelArch) -> str:
    """The local-spec name of a megatron-core parameter given any accepted alias."""
    entry, layer = resolve_mcore_name(name, arch)
    return entry.mcore.format(layer=layer) if layer is not None else entry.mcore


def dist_key(entry: MappingEntry) -> str:
    """The key of `entry` in a megatron-core dist checkpoint (torch_dist), e.g. Megatron-LM's.

    Decoder layers are stacked on a leading layer axis (no `{layer}` in the key), and the fused norms
    use the Transformer Engine spec names (`linear_qkv.layer_norm_weight`, the first alias) whichever
    spec the model runs: `GPTModel.sharded_state_dict()` of megatron-core 0.16.1 maps both to these.
    """
    name = entry.aliases[0] if entry.aliases else entry.mcore
    return name.replace("{layer}.", "")


def has_output_layer(*, tied: bool, is_first_stage: bool) -> bool:
    """Whether a last PP stage holds `output_layer.weight`.

    Untied: always. Tied: only when the last stage is not also the first, because megatron-core
    then keeps a copy of the embedding there (synchronised by its embedding group).
    """
    return not tied or not is_first_stage


def hf_names(entry: MappingEntry, *, layer: int | None, tied: bool) -> tuple[str, ...]:
    """HF tensor names feeding `entry` (global `layer`); tied output layers read the embedding."""
    templates = entry.tied_hf if tied and entry.tied_hf else entry.hf
    return tuple(t.format(layer=layer) for t in templates) if layer is not None else templates
