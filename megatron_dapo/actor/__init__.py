"""The Megatron-core actor: parallel state, log-prob forward, DAPO train step.

Importing this package imports megatron-core; `init_parallel` installs the CPU shims first.
"""

from megatron_dapo.actor.actor import METRIC_KEYS, MegatronActor
from megatron_dapo.actor.config import ActorConfig, TrainSample
from megatron_dapo.actor.dist_init import destroy_parallel, init_parallel

__all__ = ["METRIC_KEYS", "ActorConfig", "MegatronActor", "TrainSample", "destroy_parallel", "init_parallel"]
