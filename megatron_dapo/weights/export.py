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

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.distributed import comm
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.layout import hf_shapes, mcore_to_hf_tensors
from megatron_dapo.weights.load import unwrap
from megatron_dapo.weights.mapping import resolve_mcore_name

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]


def _local_params(
    chunks: Sequence[torch.nn.Module], arch: ModelArch
) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(kind, mcore name with the global layer number, param) for each exported param of this stage."""
    out = []
    for chunk in chunks:
        model = unwrap(chunk)
        # layer_number is megatron-core's 1-based global index, right under any PP / VPP split.
        to_global = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        for name, param in model.named_parameters():
            entry, layer = resolve_mcore_name(name, arch)
            if entry.tied_hf and arch.tie_word_embeddings:
                continue  # the last stage's copy of a tied embedding; stage 0 exports the original
            global_name = entry.mcore.format(layer=to_global[layer]) if layer is not None else entry.mcore
            out.append((entry.kind, global_name, param))
    return out


def _manifest(params: list[tuple[str, str, torch.nn.Parameter]], arch: ModelArch) -> Manifest:
    """HF names, shapes and dtypes this stage will produce, in order, computed from the table alone."""
    manifest: Manifest = []
    for _, name, param in params:
        entry, layer = resolve_mcore_name(name, arch)
        names = [t.format(layer=layer) for t in entry.hf] if layer is not None else list(entry.hf)
        manifest += [(n, s, param.dtype) for n, s in zip(names, hf_shapes(entry, arch))]
    return manifest


def _gather_tp(kind: str, param: torch.Tensor) -> list[torch.Tensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or kind == "replicated":
        return [param.detach()]
    return comm.all_gather(param.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())


def _stage_tensors(
    params: list[tuple[str, str, torch.nn.Parameter]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    for kind, name, param in params:
        storage = param.untyped_storage().data_ptr()
        for hf_name, tensor in mcore_to_hf_tensors(name, _gather_tp(kind, param), arch):
            # Without a TP gather (replicated kinds, TP=1) the result is a view of the live parameter;
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
    """Whether this rank takes part in its stage's TP gather for per-stage weight sync (DP/CP replica 0)."""
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
