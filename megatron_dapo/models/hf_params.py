"""A transformers model's parameters under their on-disk (safetensors) HF names.

transformers >= 5 holds an MoE layer's experts fused in memory: `mlp.experts.gate_up_proj` [E, 2 I, H] (expert e's
gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], and converts the per-expert names of a
checkpoint (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) on load. The mapping tables, the converter
and weight sync speak the on-disk names (what SGLang takes too); `hf_parameters` gives an in-memory model's
tensors under those names, as views, so a weight copy into one expert writes the fused parameter in place.
"""

from __future__ import annotations

import torch

FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def hf_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{on-disk HF name: parameter or view of it} for every parameter of `model` (dense ones as they are)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith(FUSED_EXPERTS[0]):
            prefix = name[: -len("gate_up_proj")]
            half = param.shape[1] // 2
            for e in range(param.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = param[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = param[e, half:]
        elif name.endswith(FUSED_EXPERTS[1]):
            prefix = name[: -len("down_proj")]
            for e in range(param.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = param[e]
        else:
            out[name] = param
    return out


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`hf_parameters` detached: the tensors a saved checkpoint of `model` holds, by name."""
    return {name: t.detach() for name, t in hf_parameters(model).items()}
