"""In-process load: the embedded engine (CPU, transformers) or its child process (ProcessEngine, --async-rollout 1)
takes the whole HF model from rank 0 with `engine.update_weights(named, version=...)`.

The load stays the engine's method (RolloutEngine docstring): the engine owns the model it loads into (in this
process, or in its child behind a pipe protocol and shared-memory buckets, rollout/process_engine.py), so only it
can load. This sync feeds it the export: every rank iterates iter_hf_weights (a collective), rank 0 hands it to
its engine, the others drop it. For CPU runs and tests only (tiny models): at the production setting the engine
is SGLang (ServerPush / StagePush / ColocatedSync). Keeps no host copy: the engine holds the model itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from megatron_dapo.weight_sync.base import WeightSync, export_to


class LoadsWeights(Protocol):
    """An engine that loads full HF-named tensors itself (EmbeddedEngine, ProcessEngine)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None: ...

    def take_metrics(self) -> dict[str, float]: ...


class EngineLoad(WeightSync):
    """`engine`: rank 0's engine, None on the other ranks."""

    def __init__(self, engine: LoadsWeights | None) -> None:
        self.engine = engine

    def _push(self, actor: Any, version: int) -> dict[str, float]:
        if self.engine is None:
            export_to(actor, None)  # stay in step with the collective
            return {}
        export_to(actor, lambda named: self.engine.update_weights(named, version=version))
        return self.engine.take_metrics()
