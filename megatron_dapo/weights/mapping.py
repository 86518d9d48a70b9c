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
from typing import TYPE_CHECKING, NamedTuple

from megatron_dapo.models.family import LAYOUT_KINDS, LayoutKind, MappingEntry, Stage

if TYPE_CHECKING:
    from megatron_dapo.models.hf_config import ModelArch

__all__ = ["LAYER_IMPLS", "LAYOUT_KINDS", "LayoutKind", "MappingEntry", "MatchedName", "Stage", "arch_mapping",
           "canonical_mcore_name", "dist_key", "entry_in_layer", "fill", "has_output_layer", "hf_names",
           "layer_dist_key", "resolve_mcore_name", "stacked_layers"]


class MatchedName(NamedTuple):
    """A megatron-core name resolved against a table: its entry, layer and expert numbers (None where the
    entry has none; both are whatever the name carries: stage-local / EP-local in a module)."""

    entry: MappingEntry
    layer: int | None
    expert: int | None


def fill(template: str, layer: int | None = None, expert: int | None = None) -> str:
    """`template` with its `{layer}` / `{expert}` placeholders replaced."""
    if layer is not None:
        template = template.replace("{layer}", str(layer))
    if expert is not None:
        template = template.replace("{expert}", str(expert))
    return template


def entry_in_layer(entry: MappingEntry, arch: ModelArch, layer: int) -> bool:
    """Whether global decoder layer `layer` of `arch` holds `entry` (dense-MLP entries skip the MoE layers and
    the reverse)."""
    return entry.in_layer(arch, layer)


def _template_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    return re.compile("^" + pattern.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")


def arch_mapping(arch: ModelArch) -> tuple[MappingEntry, ...]:
    """The entries of `arch`'s family table that exist for `arch` (those whose `requires` field or family option is
    set, `ModelArch.fact`)."""
    table = arch.family.mapping
    present = tuple(sorted({e.requires for e in table if e.requires and arch.fact(e.requires)}))
    return _filter(table, present)


@cache
def _filter(table: tuple[MappingEntry, ...], present: tuple[str, ...]) -> tuple[MappingEntry, ...]:
    return tuple(e for e in table if e.requires is None or e.requires in present)


@cache
def _lookup(table: tuple[MappingEntry, ...]) -> tuple[tuple[re.Pattern[str], MappingEntry], ...]:
    return tuple((_template_regex(name), entry) for entry in table for name in (entry.mcore, *entry.aliases))


def resolve_mcore_name(name: str, arch: ModelArch) -> MatchedName:
    """Find the entry of `arch`'s table for a megatron-core name (canonical or alias), its layer and expert.

    Raises KeyError naming the tensor and the model type when the table has no such parameter.
    """
    for pattern, entry in _lookup(arch_mapping(arch)):
        match = pattern.match(name)
        if match:
            found = match.groupdict()
            return MatchedName(entry, *(None if found.get(k) is None else int(found[k]) for k in ("layer", "expert")))
    raise KeyError(f"{name!r} is not a megatron-core parameter of a {arch.model_type!r} model "
                   f"(models/{arch.model_type}/)")


def canonical_mcore_name(name: str, arch: ModelArch) -> str:
    """The local-spec name of a megatron-core parameter given any accepted alias."""
    entry, layer, expert = resolve_mcore_name(name, arch)
    return fill(entry.mcore, layer, expert)


LAYER_IMPLS: tuple[str, ...] = ("transformer_engine", "local")
"""megatron-core's two layer implementations (--transformer-impl). The dist-checkpoint keys a model of each saves and
asks for differ in one tensor only: an MoE layer's pre-MLP norm (`MappingEntry.te_moe_dist`)."""


def keep_together(arch: ModelArch) -> dict[str, str]:
    """{HF name: its partner's} of every pair a weight-sync bucket must carry together (`MappingEntry.sync_with_next`:
    an entry and the next one of the table), for every layer of `arch` that holds them."""
    table = arch_mapping(arch)
    return {fill(entry.hf[0], layer): fill(table[i + 1].hf[0], layer) for i, entry in enumerate(table)
            if entry.sync_with_next for layer in range(arch.num_layers) if entry_in_layer(entry, arch, layer)}


def dist_key(entry: MappingEntry) -> str:
    """The key of `entry` in a megatron-core dist checkpoint (torch_dist), e.g. Megatron-LM's.

    Decoder layers are stacked on a leading layer axis (no `{layer}` in the key), and the fused norms
    use the Transformer Engine spec names (`linear_qkv.layer_norm_weight`, the first alias) whichever
    spec the model runs: `GPTModel.sharded_state_dict()` of megatron-core 0.16.1 maps both to these.
    An expert entry's key is its `dist` (all experts of a layer as one tensor on a leading expert axis).
    Two cases need `layer_dist_key` instead: an MoE layer of a TE model, whose pre-MLP norm is a TENorm of its
    own (the entry's `te_moe_dist`, `pre_mlp_layernorm.weight`; the local spec keeps the fused name there too),
    and a mixed dense / MoE model, which megatron-core does not stack (`stacked_layers`): the key then holds
    the layer number.
    """
    return _dist_template(entry, te_moe_layer=False).replace("{layer}.", "")


def _dist_template(entry: MappingEntry, *, te_moe_layer: bool) -> str:
    """An entry's dist-checkpoint key with its `{layer}` placeholder (see `dist_key`), in an MoE layer of a TE
    model when `te_moe_layer`."""
    if te_moe_layer and entry.te_moe_dist:
        return entry.te_moe_dist
    return entry.dist or (entry.aliases[0] if entry.aliases else entry.mcore)


def stacked_layers(arch: ModelArch) -> bool:
    """Whether a dist checkpoint stacks the decoder layers on a leading axis: megatron-core 0.16.1 does unless
    the layers differ (a `moe_layer_freq` list: some layers MoE, some dense; TransformerBlock.sharded_state_dict)."""
    return not arch.is_moe or arch.all_layers_moe


def layer_dist_key(entry: MappingEntry, arch: ModelArch, layer: int | None,
                   impl: str = "transformer_engine") -> str:
    """`dist_key` of `entry` in global `layer` of `arch` as a model of layer implementation `impl` names it (an MoE
    layer's TE name differs, `MappingEntry.te_moe_dist`), with the layer number in it where the layers are not
    stacked (`stacked_layers`); `layer` None: an entry off the decoder layers."""
    if impl not in LAYER_IMPLS:
        raise ValueError(f"layer implementation must be one of {LAYER_IMPLS}, got {impl!r}")
    te_moe_layer = impl == "transformer_engine" and layer is not None and arch.is_moe_layer(layer)
    name = _dist_template(entry, te_moe_layer=te_moe_layer)
    if layer is None or stacked_layers(arch):
        return name.replace("{layer}.", "")
    return fill(name, layer)


def has_output_layer(*, tied: bool, is_first_stage: bool) -> bool:
    """Whether a last PP stage holds `output_layer.weight`.

    Untied: always. Tied: only when the last stage is not also the first, because megatron-core
    then keeps a copy of the embedding there (synchronised by its embedding group).
    """
    return not tied or not is_first_stage


def hf_names(entry: MappingEntry, *, layer: int | None, tied: bool, expert: int | None = None) -> tuple[str, ...]:
    """HF tensor names feeding `entry` (global `layer` and `expert`); tied output layers read the embedding."""
    templates = entry.tied_hf if tied and entry.tied_hf else entry.hf
    return tuple(fill(t, layer, expert) for t in templates)
