"""HF <-> Megatron-core weights: the mapping table, layout functions, checkpoint I/O, weight export.

`load_mcore_checkpoint` and `export.iter_hf_weights` need megatron-core; they are imported lazily
so the converter runs without initialising it.
"""

from megatron_dapo.weights.layout import hf_to_mcore_tensor, mcore_to_hf_tensors, merge_tp_shards
from megatron_dapo.weights.mapping import (
    QWEN2_MAPPING,
    MappingEntry,
    canonical_mcore_name,
    resolve_mcore_name,
)
from megatron_dapo.weights.plan import iter_mcore_shards, stage_tensors
from megatron_dapo.weights.safetensors_io import CheckpointError

__all__ = [
    "QWEN2_MAPPING",
    "CheckpointError",
    "MappingEntry",
    "canonical_mcore_name",
    "hf_to_mcore_tensor",
    "iter_mcore_shards",
    "load_mcore_checkpoint",
    "mcore_to_hf_tensors",
    "merge_tp_shards",
    "resolve_mcore_name",
    "stage_tensors",
]


def __getattr__(name: str):
    if name == "load_mcore_checkpoint":
        from megatron_dapo.weights.load import load_mcore_checkpoint

        return load_mcore_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
