"""The registry of weight-sync transports: how rank 0 pushes a version to its SGLang servers (--weight-sync-mode).

Each transport is one module of this folder holding one ServerPush subclass (weight_sync/server_push.py),
registered beside it with `@register_transport("name", order=k)` (verl's checkpoint_engine registry is the model).
The folder is the list: every module in it is imported on the first look-up, so a new transport is one file here
plus its test, and `tests/test_weight_sync_transports.py` runs the same contract checks on every registered one.
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
import pkgutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_dapo.weight_sync.server_push import ServerPush

_TRANSPORTS: dict[str, tuple[int, type[ServerPush]]] = {}
_discovered = False


def register_transport(name: str, *, order: int):
    """Class decorator: registers a ServerPush subclass as --weight-sync-mode `name` (sets its `name`); `order` is
    its place in the flag's choices. A name registered twice is refused."""

    def register(cls: type[ServerPush]) -> type[ServerPush]:
        if name in _TRANSPORTS and _TRANSPORTS[name][1] is not cls:
            raise ValueError(f"weight-sync transport {name!r} registered twice: {_TRANSPORTS[name][1].__name__} "
                             f"and {cls.__name__}")
        cls.name = name
        _TRANSPORTS[name] = (order, cls)
        return cls

    return register


def _discover() -> None:
    """Imports every module of this folder once (each registers its transport)."""
    global _discovered
    if not _discovered:
        for info in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{info.name}")
        _discovered = True


def transport_names() -> tuple[str, ...]:
    """The registered transports, in their `order`: --weight-sync-mode's choices."""
    _discover()
    return tuple(name for name, _ in sorted(_TRANSPORTS.items(), key=lambda kv: kv[1][0]))


def transport(name: str) -> type[ServerPush]:
    """The class registered as `name`; ValueError naming --weight-sync-mode and the choices otherwise."""
    _discover()
    if name not in _TRANSPORTS:
        raise ValueError(f"--weight-sync-mode must be one of {transport_names()}, got {name!r}")
    return _TRANSPORTS[name][1]


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
