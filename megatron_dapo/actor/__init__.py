"""The Megatron-core actor: parallel state, log-prob forward, DAPO train step.

`MegatronActor`, `init_parallel` and `destroy_parallel` import megatron-core when first used (`init_parallel`
installs the CPU shims first); `actor.config` alone does not, so the flag parser can read its choices.
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_dapo.actor.config import ActorConfig, TrainSample

_LAZY = {"MegatronActor": "megatron_dapo.actor.actor",
         "destroy_parallel": "megatron_dapo.actor.dist_init", "init_parallel": "megatron_dapo.actor.dist_init"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ActorConfig", "MegatronActor", "TrainSample", "destroy_parallel", "init_parallel"]
