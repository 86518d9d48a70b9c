"""TransformerEngine `_extra_state` at load: what TE asks for, and tolerating a checkpoint that lacks it.

Every TE module (the fused norm+linears, the row/column linears, and on a TE build the final RMSNorm that
megatron-core's TransformerBlock picks as `LayerNormImpl`) adds a `<module>._extra_state` entry to its state
dict: FP8 scaling metadata, empty in bf16. megatron-core turns each into a ShardedObject, and
dist_checkpointing.load fails on a requested key the checkpoint does not hold. Two checkpoints lack some:
converter output written before the final norm's entry existed, and a training checkpoint saved from the local
spec (which has no final-norm extra state) resumed under TE. Megatron-LM users meet the same and load with the
absent extra states left empty; so does `load_tolerating_absent_extra_state`, for bf16 only: an absent FP8
state is not invented, it is left empty and TE recomputes its scales from the first steps (TE's own behaviour
for a fresh module).

Cost: reading the `.metadata` file once (a few MB at Qwen2.5-32B TP8 x PP2) on every rank; no tensor data. Both
reads, the index and the load, go through checkpoint/safe_read.py, which unpickles no class a checkpoint does not
hold; a loaded `_extra_state` holding bytes (FP8 state, which TE unpickles) is refused there too.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

EXTRA_STATE_SUFFIX = "._extra_state"
Path = tuple[Any, ...]


def stored_keys(iter_dir: str | os.PathLike[str]) -> set[str]:
    """The storage keys a torch_dist checkpoint holds (tensor keys and ShardedObjects' unique keys), from its
    `.metadata` read without unpickling anything but torch's index classes (safe_read.read_metadata)."""
    from megatron_dapo.checkpoint import safe_read

    return set(safe_read.read_metadata(iter_dir).state_dict_metadata)


def drop_absent_extra_state(sharded: MutableMapping[Any, Any], stored: set[str]) -> list[Path]:
    """Remove, in place, every requested `_extra_state` ShardedObject whose key `stored` lacks.

    Returns the paths (nested dict keys) removed, for `fill_absent_extra_state` after the load. Anything else
    absent stays requested, so dist_checkpointing still names it when it is missing.
    """
    from megatron.core.dist_checkpointing import ShardedObject

    removed: list[Path] = []

    def walk(node: MutableMapping[Any, Any], prefix: Path) -> None:
        for key in list(node):
            value = node[key]
            if isinstance(value, MutableMapping):
                walk(value, (*prefix, key))
            elif (isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE_SUFFIX)
                  and value.unique_key not in stored):
                del node[key]
                removed.append((*prefix, key))

    walk(sharded, ())
    return removed


def fill_absent_extra_state(loaded: MutableMapping[Any, Any], removed: list[Path]) -> None:
    """Put None (no FP8 metadata: what TE's and megatron-core's set_extra_state accept) at each removed path."""
    for path in removed:
        node = loaded
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = None


def load_tolerating_absent_extra_state(sharded: MutableMapping[Any, Any], iter_dir: str | os.PathLike[str],
                                       stored: set[str] | None = None, **load_kwargs: Any) -> dict[str, Any]:
    """dist_checkpointing.load of `sharded` from `iter_dir` (through safe_read.load: no pickle read unrestricted),
    with absent `_extra_state` entries loaded as None and stored ones refused unless empty
    (safe_read.check_extra_states).
    `stored`: the checkpoint's keys when the caller has read them already (`stored_keys`)."""
    from megatron_dapo.checkpoint import safe_read

    removed = drop_absent_extra_state(sharded, stored_keys(iter_dir) if stored is None else stored)
    loaded = safe_read.load(sharded, iter_dir, **load_kwargs)
    safe_read.check_extra_states(loaded, iter_dir)
    fill_absent_extra_state(loaded, removed)
    return loaded
