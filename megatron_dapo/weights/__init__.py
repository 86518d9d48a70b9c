"""HF <-> Megatron-core weights: reading a family's mapping table, layout functions, checkpoint I/O, weight export.

`export.iter_hf_weights` and `dist_load` need megatron-core; they are imported where used, so the
converter runs without initialising it.
"""

from megatron_dapo.weights.layout import hf_to_mcore_tensor, mcore_to_hf_tensors, merge_tp_shards
from megatron_dapo.weights.mapping import (
    MappingEntry,
    arch_mapping,
    canonical_mcore_name,
    resolve_mcore_name,
)
from megatron_dapo.weights.plan import iter_mcore_shards, iter_rank_shards, stage_tensors
from megatron_dapo.weights.safetensors_io import CheckpointError

__all__ = [
    "CheckpointError",
    "MappingEntry",
    "arch_mapping",
    "canonical_mcore_name",
    "hf_to_mcore_tensor",
    "iter_mcore_shards",
    "iter_rank_shards",
    "mcore_to_hf_tensors",
    "merge_tp_shards",
    "resolve_mcore_name",
    "stage_tensors",
]

