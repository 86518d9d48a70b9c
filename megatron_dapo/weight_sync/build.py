"""build_weight_sync: the run's one WeightSync, chosen once when the run is built (weight_sync/base.py).

The choice (`sync_kind`) is a pure function of four facts: --colocate, the engine kind (--rollout-engine:
embedded, which includes the process engine, or sglang), the transport (the resolved --weight-sync-mode, a name of
the registry weight_sync/transports/), and the pipeline size. Every rank knows the flags and PP; the engine kind
and the resolved mode are rank 0's (the mode depends on rank 0's GPU and the servers': transports.weight_sync_mode,
resolved by rollout/build.py), so rank 0 sends them to the others once, here (one ~100-byte object over the
trainer's gloo wait group). The transport's class is looked up here, once; no step decides the path again.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_dapo.weight_sync.base import WeightSync
from megatron_dapo.weight_sync.transports import transport as transport_class

SYNC_KINDS = ("server", "stage", "colocated", "engine_load")


def sync_kind(*, engine: str, mode: str | None, pp: int, colocate: bool) -> str:
    """Which implementation a run uses: "colocated" (ColocatedSync) under --colocate; "engine_load" (EngineLoad)
    for the embedded / process engine; for SGLang "stage" (StagePush) at PP > 1 for a transport that sends per
    stage (distributed), else "server" (the transport's ServerPush: tensor, disk, or distributed at PP = 1)."""
    if colocate:
        return "colocated"
    if engine == "embedded":
        return "engine_load"
    if engine != "sglang":
        raise ValueError(f"--rollout-engine must be embedded or sglang, got {engine!r}")
    if mode is None:  # every rank gets here alike (rank 0's facts are shared first): none waits for the others
        raise ValueError("an SGLang engine's weight sync needs its transport: build_weight_sync(transport=...), "
                         "rank 0's resolved --weight-sync-mode (rollout/build.py weight_sync_mode)")
    return "stage" if transport_class(mode).per_stage and pp > 1 else "server"


def engine_kind(engine: Any) -> str:
    """"sglang" for rank 0's SGLangEngine, "embedded" for an engine that loads weights itself."""
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    return "sglang" if isinstance(engine, SGLangEngine) else "embedded"


def build_weight_sync(engine: Any, *, transport: str | None = None, wait_group: dist.ProcessGroup | None,
                      colocated: Any = None, lock_timeout_s: float = 3600.0) -> WeightSync:
    """The WeightSync of this rank; a collective over every rank when `wait_group` is given (world > 1).

    `engine`: rank 0's rollout engine (None elsewhere); `transport`: rank 0's resolved --weight-sync-mode (for an
    SGLang engine; ignored on the other ranks, which get rank 0's); `wait_group`: the trainer's gloo group with the
    --rollout-timeout (None in a world of one); `colocated`: under --colocate, this rank's ColocatedPusher
    (weight_sync/colocated_push.py; every rank has one, so nothing is exchanged). `lock_timeout_s`: StagePush's
    wait for the servers' lock."""
    from megatron_dapo.distributed import comm

    if colocated is not None:
        from megatron_dapo.weight_sync.colocated_push import ColocatedSync

        return ColocatedSync(colocated, engine)
    rank0 = wait_group is None or dist.get_rank() == 0
    facts = None
    if rank0:
        kind = engine_kind(engine)
        facts = (kind, transport if kind == "sglang" else None)
    if wait_group is not None:
        facts = comm.broadcast_object(facts, 0, wait_group)
    kind = sync_kind(engine=facts[0], mode=facts[1], pp=_pipeline_size(), colocate=False)
    if kind == "engine_load":
        from megatron_dapo.weight_sync.engine_load import EngineLoad

        return EngineLoad(engine)
    cls = transport_class(facts[1])
    full = cls(engine) if rank0 else None
    if kind == "server":
        return full or cls(None)
    from megatron_dapo.weight_sync.stage_push import StagePush

    return StagePush(full, wait_group, lock_timeout_s=lock_timeout_s)


def _pipeline_size() -> int:
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()
