"""Walk the mapping table for one model and layout: which tensors live on which PP stage, in order.

The order is the one every writer and reader uses: a stage's first-stage tensors, then its layers
(each layer's entries in table order), then its last-stage tensors. Knowing names and shapes from
the config alone is what lets the converter write headers first and stream the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_dapo.distributed.parallel import ParallelLayout, layer_range, validate_layout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.layout import hf_shapes, hf_to_mcore_tensor
from megatron_dapo.weights.mapping import MappingEntry, arch_mapping, entry_in_layer, fill, has_output_layer, hf_names
from megatron_dapo.weights.safetensors_io import TensorSpec


@dataclass(frozen=True)
class StageTensor:
    """One megatron-core parameter of a PP stage."""

    mcore_name: str
    """Name with the stage-local layer number (what the stage's GPTModel.state_dict() uses)."""
    entry: MappingEntry
    global_layer: int | None
    hf_names: tuple[str, ...]
    """HF sources, global layer (and expert) numbers; for a tied output layer, the embedding."""
    global_expert: int | None = None
    """An expert entry's global expert number (the name carries the EP-local one)."""


def stage_tensors(arch: ModelArch, layout: ParallelLayout, pp_rank: int, ep_rank: int = 0, *,
                  chunk: int = 0) -> list[StageTensor]:
    """The parameters stage `pp_rank` holds, in file order; of the experts, those of expert-parallel rank `ep_rank`
    (experts ep_rank * E / EP .. (ep_rank + 1) * E / EP - 1, named local_experts.0 .. E / EP - 1). `chunk`: the
    model chunk under --num-layers-per-virtual-pipeline-stage (its layers: `layer_range`; the embedding on chunk 0
    of stage 0, the head on the last chunk of the last stage, as megatron-core builds them)."""
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{layout.pp - 1}")
    if not 0 <= ep_rank < layout.ep:
        raise ValueError(f"ep_rank {ep_rank} is outside 0..{layout.ep - 1}")
    validate_layout(arch, layout)
    local_experts = arch.num_experts // layout.ep
    layers = layer_range(arch.num_layers, layout, pp_rank, chunk)
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == layout.pp - 1 and chunk == layout.virtual_stages(arch.num_layers) - 1
    tied = arch.tie_word_embeddings
    out: list[StageTensor] = []
    for stage in ("first", "layer", "last"):
        for entry in arch_mapping(arch):
            if entry.stage != stage:
                continue
            if stage == "first" and not first:
                continue
            if stage == "last" and not last:
                continue
            if entry.tied_hf and not has_output_layer(tied=tied, is_first_stage=first):
                continue
            if stage == "layer":
                for local, glob in enumerate(layers):
                    if not entry_in_layer(entry, arch, glob):
                        continue
                    if entry.per_expert:
                        for j in range(local_experts):
                            expert = ep_rank * local_experts + j
                            out.append(StageTensor(fill(entry.mcore, local, j), entry, glob,
                                                   hf_names(entry, layer=glob, tied=tied, expert=expert), expert))
                        continue
                    out.append(
                        StageTensor(
                            entry.mcore.format(layer=local),
                            entry,
                            glob,
                            hf_names(entry, layer=glob, tied=tied),
                        )
                    )
            else:
                out.append(StageTensor(entry.mcore, entry, None, hf_names(entry, layer=None, tied=tied)))
    # Within a stage, group by layer so a reader/writer touches one layer at a time.
    return sorted(out, key=lambda t: (t.entry.stage != "first", t.entry.stage == "last", t.global_layer or 0))


def dropped_hf_tensors(arch: ModelArch) -> tuple[tuple[str, ...], str]:
    """(HF name prefixes a load of `arch` skips, why): the family's `dropped_hf_tensors`, or ((), "")."""
    hook = arch.family.dropped_hf_tensors
    return hook(arch) if hook is not None else ((), "")


def dropped_notice(skipped: list[str], prefixes: tuple[str, ...], why: str) -> str:
    """One line saying how many checkpoint tensors a load left out, under which of `prefixes`, and why ("" when
    none)."""
    if not skipped:
        return ""
    under = ", ".join(p for p in prefixes if any(n.startswith(p) for n in skipped))
    return f"not loading {len(skipped)} tensor(s) under {under}: {why}"


BUFFER_DTYPE = torch.float32
"""The dtype of a table entry that is a buffer (`MappingEntry.buffer`: DeepSeek-V3's e_score_correction_bias): what
megatron-core keeps the router's expert_bias in whatever the model's dtype, and what DeepSeek-V3's release stores;
bf16 would move each bias by up to 2^-9 of itself, enough to flip a top-k choice between near-tied experts."""


def entry_dtype(entry: MappingEntry, dtype: torch.dtype) -> torch.dtype:
    """The dtype `entry`'s tensors are written in by a model of `dtype` (BUFFER_DTYPE for a buffer)."""
    return BUFFER_DTYPE if entry.buffer else dtype


def buffer_hf_names(arch: ModelArch) -> set[str]:
    """The HF names of `arch`'s buffer entries (kept in BUFFER_DTYPE, not counted in a checkpoint's dtype)."""
    return {n for t in stage_tensors(arch, ParallelLayout(), 0) if t.entry.buffer for n in t.hf_names}


def hf_tensor_specs(arch: ModelArch, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor of the HF checkpoint in layer order (tied models have no lm_head.weight), in `dtype` but the
    buffers (BUFFER_DTYPE)."""
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for t in stage_tensors(arch, ParallelLayout(), 0):
        if t.entry.tied_hf and arch.tie_word_embeddings:
            continue
        for name, shape in zip(t.hf_names, hf_shapes(t.entry, arch), strict=True):
            if name not in seen:
                seen.add(name)
                specs.append(TensorSpec(name, entry_dtype(t.entry, dtype), shape))
    return specs


def iter_mcore_shards(
    get_hf_tensor: Callable[[str], torch.Tensor], arch: ModelArch, layout: ParallelLayout, pp_rank: int,
    ep_rank: int = 0,
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """Yield (stage-local mcore name, [shard for TP rank 0..tp-1]) for stage `pp_rank`; an expert's shards are
    per expert-TP rank (0..etp-1), of the experts of `ep_rank`.

    `get_hf_tensor(hf_name)` is called lazily, one parameter at a time, so the caller holds at most
    one parameter's HF tensors and shards at once.
    """
    for name, _, shards in _iter_shards(get_hf_tensor, arch, layout, pp_rank, ep_rank):
        yield name, shards


def iter_rank_shards(
    get_hf_tensor: Callable[[str], torch.Tensor], arch: ModelArch, layout: ParallelLayout, *, pp_rank: int,
    tp_rank: int, ep_rank: int = 0, etp_rank: int = 0, chunk: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (stage-local mcore name, this rank's shard) for the rank at (pp, tp, ep, expert-tp) ranks, of its model
    chunk `chunk` (--num-layers-per-virtual-pipeline-stage)."""
    for name, entry, shards in _iter_shards(get_hf_tensor, arch, layout, pp_rank, ep_rank, chunk):
        yield name, shards[etp_rank if entry.per_expert else tp_rank]


def _iter_shards(get_hf_tensor: Callable[[str], torch.Tensor], arch: ModelArch, layout: ParallelLayout,
                 pp_rank: int, ep_rank: int, chunk: int = 0) -> Iterator[tuple[str, MappingEntry, list[torch.Tensor]]]:
    for t in stage_tensors(arch, layout, pp_rank, ep_rank, chunk=chunk):
        hf = [get_hf_tensor(name) for name in t.hf_names]
        for name, tensor, shape in zip(t.hf_names, hf, hf_shapes(t.entry, arch), strict=True):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"HF tensor {name} has shape {list(tensor.shape)}, config.json implies {list(shape)}"
                )
        tp = layout.expert_tp if t.entry.per_expert else layout.tp
        yield t.mcore_name, t.entry, hf_to_mcore_tensor(t.entry.kind, hf, arch, tp)

