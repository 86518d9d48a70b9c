"""The Megatron-core actor: parallel state, log-prob forward, DAPO train step."""

from megatron_dapo.actor.dist_init import destroy_parallel, init_parallel

__all__ = ["init_parallel", "destroy_parallel"]
