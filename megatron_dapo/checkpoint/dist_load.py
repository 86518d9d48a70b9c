"""Start a run from a torch_dist checkpoint's model weights: converter output or another run's checkpoint.

`train.py --load DIR` calls this when DIR has Megatron-LM's `latest_checkpointed_iteration.txt` (what
`checkpoint_convert hf-to-mcore` writes), or is its `release/` directory: the model loads at the run's
TP/PP/EP/expert-TP (megatron-core reshards; an MoE checkpoint holds every expert on a global axis), and the
run starts at iteration 0 with a fresh optimizer. Resuming a run (model + optimizer + step) is
`megatron_dapo.checkpoint.training.load_checkpoint`'s job.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch

from megatron_dapo.checkpoint.ckpt_config import check_global_shapes, check_same_arch, request_stored_keys
from megatron_dapo.checkpoint.dist_ckpt import DCP_METADATA, TRACKER_FILE, DistCheckpointReader
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.extra_state import load_tolerating_absent_extra_state, stored_keys


def is_megatron_lm_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is Megatron-LM-layout converter output, not a training --save dir: its root (with
    latest_checkpointed_iteration.txt) or one of its iteration directories (`release/`, `iter_NNNNNNN/`)."""
    root = Path(path)
    if (root / TRACKER_FILE).is_file():
        return True
    return re.fullmatch(r"release|iter_\d{7}", root.name) is not None and (root / DCP_METADATA).is_file()


def initial_checkpoint(load: str | None, mcore_checkpoint: str | None) -> str | None:
    """The torch_dist checkpoint a run starts its weights from, or None (start from --hf-checkpoint).

    That is --load when it is converter output (Megatron-LM layout), not a training run to resume.
    --mcore-checkpoint is its deprecated spelling; a --load given too wins (it resumes or starts there).
    """
    if mcore_checkpoint:
        warnings.warn("--mcore-checkpoint is deprecated: pass hf-to-mcore output as --load (it loads at any "
                      "TP/PP)", FutureWarning, stacklevel=2)
        if not load:
            return mcore_checkpoint
    return load if load and is_megatron_lm_checkpoint(load) else None


def check_checkpoint_config(path: str | os.PathLike[str], arch: ModelArch, *, flag: str = "--load") -> Path:
    """Compare a checkpoint's stored HF config and tensor shapes with `arch`, reading no tensor data.

    Returns the iteration directory. Raises CheckpointError naming both values of each mismatch.
    """
    with DistCheckpointReader(path, flag=flag) as reader:
        stored = reader.common.get("hf_config")
        if stored is not None:
            check_same_arch(ModelArch.from_hf(stored), arch, stored_from=f"{flag} {path}",
                            requested_from="--hf-checkpoint config.json")
        check_global_shapes({k: reader.shape(k) for k in reader.tensors}, arch, source=f"{flag} {path}",
                            against="--hf-checkpoint config.json")
        return reader.dir


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike[str], arch: ModelArch,
                       *, flag: str = "--load") -> Path:
    """Load the model tensors of a torch_dist checkpoint into this rank's model (all ranks call it).

    `model` is this rank's chunk (possibly DDP-wrapped): its `sharded_state_dict()` names the global
    slices this rank needs, and dist_checkpointing reads only those. Optimizer state in the checkpoint
    is ignored; callers refresh the optimizer's main params afterwards (`optimizer.reload_model_params`).
    A TE `_extra_state` the checkpoint lacks loads as None (weights/extra_state.py); a tensor stored under the other
    layer implementation's key (an MoE layer's pre-MLP norm: `ckpt_config.request_stored_keys`) is read from there.
    Cost at Qwen2.5-32B TP8 x PP2: each rank reads its 1/16 of 64 GB (4 GB); no rank waits on another
    except the final barrier inside dist_checkpointing.load. At Qwen3-30B-A3B EP8 (TP1, PP1): a rank reads its 16 of
    the 128 experts of each layer (58 GB of experts / 8 = 7.2 GB) plus the replicated rest (3.1 GB).
    """
    iter_dir = check_checkpoint_config(path, arch, flag=flag)
    sharded = model.sharded_state_dict()
    keys = list(sharded)
    stored = stored_keys(iter_dir)
    request_stored_keys(sharded, arch, stored)  # a TE model reads a local-spec save's keys, and the reverse
    loaded = load_tolerating_absent_extra_state(sharded, iter_dir, stored)  # every pickle through safe_read.py
    model.load_state_dict({k: loaded[k] for k in keys})
    return iter_dir
