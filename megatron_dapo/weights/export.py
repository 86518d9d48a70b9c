"""Export a live, TP/PP-sharded megatron-core model as full HF tensors: the send half of weight sync.

`iter_hf_weights` is a collective generator: every rank of the model-parallel group must iterate it
to the end, in step. Per parameter, the owning stage all-gathers the TP shards over the TP group and
merges them with the mapping table; then, when PP > 1, the tensor is broadcast over the PP group from
its stage. So every rank (each TP and PP rank of every DP replica) yields the same full HF model,
stage 0's tensors first. A consumer that sends from one rank only (e.g. global rank 0 to SGLang) just
drops the other ranks' tensors. Peak extra memory is one full parameter (plus its TP shards).

`iter_stage_hf_weights` is the per-stage half used by distributed weight sync at PP > 1
(megatron_dapo/weight_sync/stage_sync.py): only this stage's tensors, TP-gathered over the stage's TP group, no
PP broadcast. Only the ranks of data-parallel replica 0 iterate it (one TP group per stage); the stage's
(DP 0, TP 0) rank sends what it yields. At 32B (65 GB bf16, TP8 x PP2) each stage source yields ~32.5 GB,
where `iter_hf_weights` moves 65 GB to every one of the 128 ranks (32.5 GB of it over PP).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.distributed import comm
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.layout import hf_shapes, merge_tp_shards
from megatron_dapo.weights.load import mapped_tensors, unwrap
from megatron_dapo.weights.mapping import MappingEntry, fill, resolve_mcore_name

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class _Param:
    entry: MappingEntry
    name: str
    """mcore name with the global layer number (and this rank's expert-parallel-local expert number)."""
    layer: int | None
    expert: int | None
    param: torch.Tensor
    """The parameter, or a buffer the table maps (an MoE router's expert_bias)."""


def _local_params(chunks: Sequence[torch.nn.Module], arch: ModelArch) -> list[_Param]:
    """Each exported tensor of this stage, with its global layer."""
    out = []
    for chunk in chunks:
        model = unwrap(chunk)
        # layer_number is megatron-core's 1-based global index, right under any PP / VPP split.
        to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        for name, param in mapped_tensors(model, arch):
            entry, layer, expert = resolve_mcore_name(name, arch)
            if entry.tied_hf and arch.tie_word_embeddings:
                continue  # the last stage's copy of a tied embedding; stage 0 exports the original
            layer = None if layer is None else to_global[layer]
            out.append(_Param(entry, fill(entry.mcore, layer, expert), layer, expert, param))
    return out


def _hf_names(p: _Param, arch: ModelArch) -> list[str]:
    """The HF names `p` becomes, in yield order: an expert's per HF tensor, then per expert-parallel rank (the
    experts the EP all-gather brings: local expert j of rank r is global expert r * E / EP + j)."""
    if not p.entry.per_expert:
        return [fill(t, p.layer) for t in p.entry.hf]
    ep = parallel_state.get_expert_model_parallel_world_size()
    local = arch.num_experts // ep
    return [fill(t, p.layer, r * local + p.expert) for t in p.entry.hf for r in range(ep)]


def _manifest(params: list[_Param], arch: ModelArch) -> Manifest:
    """HF names, shapes and dtypes this stage will produce, in order, computed from the table alone."""
    manifest: Manifest = []
    for p in params:
        shapes = hf_shapes(p.entry, arch)
        copies = len(_hf_names(p, arch)) // len(shapes)
        manifest += [(n, s, p.param.dtype)
                     for n, s in zip(_hf_names(p, arch), (s for s in shapes for _ in range(copies)), strict=True)]
    return manifest


def _gather_tp(p: _Param) -> list[torch.Tensor]:
    """The TP shards of `p` (an expert's: its expert-TP shards), all-gathered over that group."""
    if p.entry.per_expert:
        tp, group = (parallel_state.get_expert_tensor_parallel_world_size(),
                     parallel_state.get_expert_tensor_parallel_group)
    else:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group
    if tp == 1 or p.entry.kind == "replicated":
        return [p.param.detach()]
    return comm.all_gather(p.param.detach().contiguous(), group=group())


def _stage_tensors(params: list[_Param], arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    ep = parallel_state.get_expert_model_parallel_world_size()
    for p in params:
        storage = p.param.untyped_storage().data_ptr()
        tensors = merge_tp_shards(p.entry.kind, _gather_tp(p), arch)
        if p.entry.per_expert and ep > 1:  # every EP rank's expert of this local number, in EP-rank order
            group = parallel_state.get_expert_model_parallel_group()
            tensors = [t for own in tensors for t in comm.all_gather(own.contiguous(), group=group)]
        for hf_name, tensor in zip(_hf_names(p, arch), tensors, strict=True):
            # Without a gather (replicated kinds, TP=1, EP=1) the result is a view of the live parameter;
            # later optimizer steps must not change what was exported.
            yield hf_name, tensor.clone() if tensor.untyped_storage().data_ptr() == storage else tensor


def iter_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every model-parallel rank (see module doc).

    Tensors are on the parameters' device and dtype; tied models yield no lm_head.weight (HF and
    SGLang tie it to model.embed_tokens.weight themselves).
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    params = _local_params(chunks, arch)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        yield from _stage_tensors(params, arch)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    group_ranks = dist.get_process_group_ranks(group)
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    device = next(p for c in chunks for p in c.parameters()).device
    for stage in range(pp):
        src = group_ranks[stage]
        manifest: Manifest = comm.broadcast_object(_manifest(params, arch) if stage == my_stage else None, src,
                                                   group)
        if stage == my_stage:
            produced = _stage_tensors(params, arch)
            for expected_name, _, _ in manifest:
                name, tensor = next(produced)
                if name != expected_name:
                    raise RuntimeError(f"export order broke: produced {name}, manifest says {expected_name}")
                yield name, comm.broadcast(tensor.contiguous(), src, group)
        else:
            for name, shape, dtype in manifest:
                yield name, comm.broadcast(torch.empty(shape, dtype=dtype, device=device), src, group)


def iter_stage_hf_weights(
    model_chunks: torch.nn.Module | Sequence[torch.nn.Module], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) of this pipeline stage's parameters only (TP-gathered; no PP traffic).

    A collective over the tensor-parallel group: every TP rank of the stage must iterate it to the end, in
    step. Same names, order and values as the stage's part of `iter_hf_weights`; the stages together yield
    the whole model (a tied embedding once, from stage 0)."""
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    yield from _stage_tensors(_local_params(chunks, arch), arch)


def is_stage_source() -> bool:
    """Whether this rank sends its stage in per-stage weight sync: data-parallel (with CP) rank 0, TP rank 0."""
    return (parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def gathers_stage() -> bool:
    """Whether this rank takes part in its stage's gathers for per-stage weight sync: the TP gather of DP/CP
    replica 0; under expert parallelism every rank, since an expert-parallel group spans data-parallel ranks."""
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return True
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
