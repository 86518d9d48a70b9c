"""Loading a stream of full HF-named tensors into an HF model in place (the embedded engine's weight sync).

Names are the on-disk (safetensors) HF names the export and SGLang speak: an MoE model's experts go one per
tensor (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) although transformers holds them fused in
memory; `models.hf_params.hf_parameters` gives those names as views of the fused parameters, so each copy writes
the model's own storage (no second copy of the model, no re-fusing step).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_dapo.models.hf_params import hf_parameters


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies each (HF name, full tensor) into the parameter of that name; returns how many were copied.

    Every parameter must be given exactly once (a partial sync would leave the engine on mixed weights
    without anyone noticing). With tied embeddings `lm_head.weight` is the embedding itself: it is
    accepted when equal in shape and skipped, since the embedding carries it. Tensors are cast to the
    parameter's dtype and device. An MoE model's experts are named one per tensor (on-disk names) and are
    copied into views of the fused in-memory parameters. Raises KeyError / ValueError naming the offending tensor.
    """
    params = hf_parameters(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if tied and name == "lm_head.weight" and name not in params:
            continue
        target = params.get(name)
        if target is None:
            close = [p for p in params if p.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise KeyError(f"weight sync: model has no parameter {name!r} (HF names expected; e.g. {close})")
        if name in seen:
            raise ValueError(f"weight sync: {name!r} was sent twice")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight sync: {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)} "
                "(send full, TP-gathered tensors with the vocab padding removed)"
            )
        target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"weight sync: {len(missing)} parameters were not sent, e.g. {missing[:4]}")
    return len(seen)
