"""The registry of weight-sync transports: how rank 0 pushes a version to its SGLang servers (--weight-sync-mode).

Each transport is one module of this folder holding one ServerPush subclass (weight_sync/server_push.py),
registered beside it with `@register_transport("name")` (the repository's `dotted_path.Registry`, as the losses and
reward functions register; verl's checkpoint_engine registry is the model). The folder is the list: every module in
it is imported on the registry's first read, so a new transport is one file here plus its test, and
`tests/unit/weight_sync/test_weight_sync_transports.py` runs the same contract checks on every registered one.
--weight-sync-mode's choices are `transport_names()` (megatron_dapo/arguments.py).

The choice is made once, when the run is built: `weight_sync_mode` resolves the flag against where the servers run
(rank 0, before any server starts: rollout/build.py; also the planner and nccl_env, from the flags alone), and
weight_sync/build.py `build_weight_sync` looks the class up here and makes the run's WeightSync from it. No step
decides the path again: `update` and `recover` are the transport's own methods.

Imports run one way between this package and rollout/sglang/: weight_sync/ imports rollout/sglang/ (the engine's
servers, its HTTP protocol and the weight-sync group layout, which the transports drive), never the reverse; the
engine knows its sync only as `Recovers` (rollout/sglang/engine.py: recover a lost server, close at shutdown).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from megatron_dapo.dotted_path import Registry

if TYPE_CHECKING:
    from megatron_dapo.weight_sync.server_push import ServerPush

TRANSPORTS = Registry("--weight-sync-mode", "a ServerPush subclass taking rank 0's SGLangEngine "
                      "(weight_sync/server_push.py)", __name__)
"""--weight-sync-mode name -> ServerPush subclass, in the flag's order of choices."""
register_transport = TRANSPORTS.register


def transport_names() -> tuple[str, ...]:
    """The registered transports: --weight-sync-mode's choices."""
    return tuple(TRANSPORTS)


def transport(name: str | None) -> type[ServerPush]:
    """The class registered as `name`; ValueError naming --weight-sync-mode and the choices otherwise."""
    if name not in TRANSPORTS:
        raise ValueError(f"--weight-sync-mode must be one of {transport_names()}, got {name!r}")
    return TRANSPORTS[name]


def weight_sync_mode(*, requested: str | None, attach: bool, cuda: bool, colocate: bool,
                     trainer_gpu: str | None = None, server_gpus: str | None = None) -> str:
    """--weight-sync-mode, defaulted and checked against where the servers run.

    Default: 'distributed' (NCCL broadcast) for attached servers and for launched servers on GPUs of their
    own; 'tensor' (handles, no copy) for colocated servers and on CPU. A requested transport checks the placement
    itself (`ServerPush.check_placement`: 'tensor' on CUDA passes CUDA IPC handles of global rank 0's GPU,
    `trainer_gpu`, which launched servers must see among `server_gpus`).
    """
    if requested is None:
        return "distributed" if attach or (cuda and not colocate) else "tensor"
    transport(requested).check_placement(cuda=cuda, trainer_gpu=trainer_gpu, server_gpus=server_gpus)
    return requested


# The flag's order of choices, as it always was: these first; any other module of this folder is imported after
# them, alphabetically, on the registry's first read (dotted_path.Registry).
for _first in ("tensor", "distributed", "disk"):
    importlib.import_module(f"{__name__}.{_first}")
