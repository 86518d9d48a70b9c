"""Resumable training checkpoints through megatron-core dist_checkpointing (torch_dist format).

One checkpoint = `<save>/step_<N>/` holding the model and optimizer as sharded tensors (reshardable
across TP/PP on load for the model), plus common state written by rank 0: LR scheduler, data
sampler position, step and the trainer's extra state; each rank's RNG states go in a ShardedObject.
`<save>/latest` names the newest complete step.

Crash safety: a step is written to `step_<N>.tmp/` and renamed only when every rank has finished,
then `latest` is replaced atomically. A run killed with SIGKILL mid-save leaves a `.tmp` directory
that loading ignores, so `--load` resumes from the previous complete step.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_dapo import checkpoint_procs

LATEST = "latest"
# Resharding of the distributed optimizer across DP is supported; fully_reshardable fails on CPU.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:07d}"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded_state(actor, *, is_loading: bool, rng: dict[str, Any] | None) -> dict[str, Any]:
    model_sd = actor.module.sharded_state_dict()
    rank, world = _rank_world()
    return {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                        metadata=OPTIM_METADATA),
        "rng": ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0),
    }


def save_checkpoint(save_dir: str | os.PathLike, step: int, actor, extra: dict[str, Any]) -> Path:
    """Write step `step` (all ranks call this); `extra` (rank 0's copy is kept) must be picklable."""
    rank, _ = _rank_world()
    checkpoint_procs.install_results_queue(async_save=False)
    final, tmp = step_dir(save_dir, step), Path(f"{step_dir(save_dir, step)}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = _sharded_state(actor, is_loading=False, rng=rng_state())
    state["scheduler"] = actor.scheduler.state_dict()
    state["extra"] = {"step": step, **extra}
    dist_checkpointing.save(state, str(tmp), content_metadata=OPTIM_METADATA)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = Path(save_dir) / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, Path(save_dir) / LATEST)
    _barrier()
    return final


def _materialise_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before a dp_reshardable load.

    Without TE/Apex (the CPU path) megatron-core 0.16.1's DistributedOptimizer.state_dict() reads each
    param's torch-Adam 'step' and asserts there is exactly one value, which fails on a never-stepped
    optimizer (no state at all). Megatron fills dummy state the same way before its fsdp_dtensor loads;
    the dummy values (main params included) are overwritten in place by the checkpoint's.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # the fused-Adam path keeps 'step' elsewhere; nothing to do
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not opt.optimizer.state:
            init()


def _distributed_adam_steps(optimizer, optimizer_state) -> list[float | None]:
    """Per chained optimizer: the checkpoint's torch-Adam step of a distributed optimizer (no TE/Apex), else None."""
    from megatron.core.optimizer import distrib_optimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optimizer_state] if len(opts) == 1 else [v for _, v in sorted(optimizer_state.items())]
    steps: list[float | None] = []
    for opt, state in zip(opts, states):
        if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(opt, distrib_optimizer.DistributedOptimizer):
            steps.append(None)
            continue
        values = {group["step"] for group in state["optimizer"]["param_groups"]}
        if len(values) != 1:
            raise ValueError(f"checkpoint's optimizer param groups disagree on the Adam step: {sorted(values)}")
        steps.append(float(values.pop()))
    return steps


def _restore_distributed_adam_steps(optimizer, steps: list[float | None]) -> None:
    """Give every param of a resumed distributed optimizer its own torch-Adam 'step' = the saved one.

    megatron-core 0.16.1's DistributedOptimizer.load_state_dict without TE/Apex (torch Adam, the CPU
    path) gets 'step' wrong twice: it puts one shared tensor into every param's state, then
    `load_parameter_state_from_dp_reshardable` copies the *fresh* optimizer's step (1, from the dummy
    step) into it. torch Adam then bias-corrects with step 2, 3, ... instead of N+1, N+2, ... and,
    incrementing the shared tensor in place once per param, advances it by the number of params per
    update: the ~3e-4 relative drift of the next updates after a resume. The regular optimizer
    deep-copies the saved step per param (`_restore_common_per_param_step`), as this does.
    """
    for opt, step in zip(getattr(optimizer, "chained_optimizers", [optimizer]), steps):
        if step is None:
            continue
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)


def latest_step_dir(load_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under load_dir, or None when there is none yet."""
    root = Path(load_dir)
    marker = root / LATEST
    if marker.is_file():
        candidate = root / marker.read_text().strip()
        if candidate.is_dir():
            return candidate
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    return steps[-1] if steps else None


def load_checkpoint(load_dir: str | os.PathLike, actor) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and this rank's RNG; return the extra state (with 'step').

    Returns None when load_dir holds no complete checkpoint (a fresh run with --load set).
    """
    path = latest_step_dir(load_dir)
    if path is None:
        return None
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a dist checkpoint (no metadata.json): it was not written by "
                                f"--save, or is damaged; remove it or point --load elsewhere")
    _materialise_distributed_optimizer_state(actor.optimizer)
    state = _sharded_state(actor, is_loading=True, rng=None)
    loaded = dist_checkpointing.load(state, str(path))
    actor.module.load_state_dict(loaded["model"])
    with torch.no_grad():
        # The optimizer state holds the fp32 main params: they are loaded as saved, never re-derived
        # from the (bf16) model params, which would round every update below bf16 resolution away.
        adam_steps = _distributed_adam_steps(actor.optimizer, loaded["optimizer"])
        actor.optimizer.load_state_dict(loaded["optimizer"])
        _restore_distributed_adam_steps(actor.optimizer, adam_steps)
    actor.scheduler.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    extra = dict(loaded["extra"])
    actor.steps = int(extra["step"])
    return extra
