"""The weight-sync interface: the trained policy -> the rollout engine, one implementation per run.

`build_weight_sync` (weight_sync/build.py) picks the implementation once, when the run is built, from the flags
(--rollout-engine, --weight-sync-mode, --pipeline-model-parallel-size, --colocate); Trainer.sync_weights then
calls `push(actor, version)` on every rank, every step, and never re-decides the path:

| implementation                    | when                              | rank 0's host copy at 32B (bf16)         |
|-----------------------------------|-----------------------------------|------------------------------------------|
| ServerPush (server_push.py)       | SGLang, tensor / disk, or PP = 1  | 61.03 GiB; disk: none (the shards are)   |
| StagePush (stage_push.py)         | SGLang, distributed, PP > 1       | 61.03 GiB (the whole version)            |
| ColocatedSync (colocated_push.py) | --colocate                        | none: a lost engine stops the run        |
| EngineLoad (engine_load.py)       | embedded / process engine (CPU)   | none: the engine holds its model         |

(61.03 GiB is planner.report.host_copy_bytes for Qwen2.5-32B: 32.8 B parameters x 2 bytes. ServerPush is what the
transports share; each --weight-sync-mode is one subclass of it in transports/, the registry the flag's choices
come from.)

`recover(server)` brings one server of rank 0's SGLang engine back to the current version after a loss (the
engine calls it from its recovery thread, under its weights lock); the copy it pushes from is the
implementation's own. `close()` ends what the sync holds (a broadcast group with the servers, the host copy).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable
from typing import Any


class WeightSync(abc.ABC):
    """Pushes a weight version from the actor to the rollout engine; made once per process by build_weight_sync."""

    def push(self, actor: Any, version: int) -> dict[str, float]:
        """Every rank calls this at the same point (the export inside is a collective). Returns the step's sync
        metrics (rank 0: the engine's take_metrics(), with its sync/* and recovery counters; the others: what
        their part moved) plus `time/sync_s`, this rank's wall time in the push."""
        t0 = time.perf_counter()
        metrics = self._push(actor, version)
        return metrics | {"time/sync_s": time.perf_counter() - t0}

    @abc.abstractmethod
    def _push(self, actor: Any, version: int) -> dict[str, float]:
        """The push itself; `actor` has `chunks` and `arch` (MegatronActor)."""

    def recover(self, server: int) -> None:
        """Pushes the current version to rank 0's engine's server `server`, which lost it (restarted, or back
        after a failure). Called by the engine under its weights lock, on its recovery thread."""
        raise RuntimeError(f"{type(self).__name__} cannot re-sync a lost rollout server ({server})")

    def close(self) -> None:  # noqa: B027 - most implementations hold nothing to end
        """Ends what the sync holds; idempotent. Rank 0's engine calls it at shutdown, while its servers answer."""


def drain(named: Any) -> None:
    """Iterates the rest of a collective export (iter_hf_weights) so this rank stays in step with its TP/PP peers
    (nothing if it was already consumed)."""
    for _ in named:
        pass


def export_to(actor: Any, load: Callable[[Iterable[Any]], None] | None) -> None:
    """The full-model export on every rank: iter_hf_weights (TP all-gather, PP broadcast; a collective every rank
    iterates) fed to `load`, rank 0's consumer (None on the others, which only keep in step). If `load` raises, the
    rest of the export is still iterated before the error propagates, so no TP/PP peer is left in a gather."""
    from megatron_dapo.weights.export import iter_hf_weights

    named = iter_hf_weights(actor.chunks, actor.arch)
    if load is None:
        drain(named)
        return
    try:
        load(named)
    except BaseException:
        drain(named)
        raise
