"""The one interface every rollout engine (embedded CPU, SGLang servers) implements."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence

from megatron_dapo.rollout.types import RolloutRequest, Sample


def check_unique_ids(requests: Sequence[RolloutRequest]) -> None:
    """Raises if two requests share a request_id (abort and result matching would be ambiguous)."""
    seen: set[str] = set()
    for req in requests:
        if req.request_id in seen:
            raise ValueError(f"duplicate request_id {req.request_id!r}: request ids must be unique in a call")
        seen.add(req.request_id)


class OpenStream(Iterator[list[Sample]]):
    """A stream that may take more requests while it runs (`RolloutEngine.open_stream`): iterate it for each
    request's group as it completes, call `add` between two groups. It ends once every request, the added ones
    included, came out. `add` None: the engine cannot admit requests into a running stream."""

    def __init__(self, groups: Iterator[list[Sample]],
                 add: Callable[[Sequence[RolloutRequest]], None] | None = None) -> None:
        self._groups, self._add = groups, add

    def __next__(self) -> list[Sample]:
        return next(self._groups)

    @property
    def accepts_additions(self) -> bool:
        return self._add is not None

    def add(self, requests: Sequence[RolloutRequest]) -> None:
        """Submit `requests` to the running stream (their ids unique among all the stream's requests)."""
        if self._add is None:
            raise RuntimeError("this engine admits no request into a running stream (OpenStream.accepts_additions "
                               "is False): submit them in the next stream")
        check_unique_ids(requests)
        if requests:
            self._add(requests)


class RolloutEngine(abc.ABC):
    """Generates groups of samples from token ids; new weights reach it through megatron_dapo/weight_sync/.

    Contract shared by all engines:
    - `stream` yields one list of n Samples (ordered by index) per request as soon as the whole group is
      done; every request comes out exactly once, aborted ones with finish_reason 'abort'.
    - `abort` may be called from inside the loop over `stream` (dynamic sampling has filled its batch).
    - `weight_version` is the version of the weights the engine serves (set by the weight sync). An engine that
      holds its model in this process or a child of it (embedded, process) loads new weights itself:
      `update_weights(named_tensors, version=...)`, called by weight_sync/engine_load.py; a server engine
      (SGLang) exposes its servers to the sync instead (weight_sync/server_push.py).
    """

    @abc.abstractmethod
    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        """Yields each request's group of n samples as it completes (completion order, not input order)."""

    def open_stream(self, requests: Sequence[RolloutRequest]) -> OpenStream:
        """`stream(requests)`, taking more requests while it runs where the engine can (`OpenStream.add`: the
        embedded, process and SGLang engines start them in the slots that finished requests freed). This default
        cannot: its `accepts_additions` is False."""
        return OpenStream(iter(self.stream(requests)))

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        """Blocking: one list of n samples per request, in the order of `requests`."""
        check_unique_ids(requests)
        by_id = {group[0].request_id: group for group in self.stream(requests)}
        missing = [r.request_id for r in requests if r.request_id not in by_id]
        if missing:
            raise RuntimeError(f"{type(self).__name__} lost requests {missing[:5]} (of {len(missing)})")
        return [by_id[r.request_id] for r in requests]

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Stops the given requests (None = all in flight or queued); returns the ids that were stopped.

        Their groups still come out of `stream`, with finish_reason 'abort' on unfinished samples."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Holds generation (in-flight requests are kept) so weights can be swapped safely."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continues generation after `pause`."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve requests now."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases the model / stops the servers. Idempotent."""

    def take_metrics(self) -> dict[str, float]:
        """Counters since the last call (e.g. servers restarted, requests retried), for the step's metrics.
        Engines with nothing to count return {}."""
        return {}

    @property
    def capacity(self) -> int | None:
        """Samples the engine generates at once (more wait in its queue); None when it does not say. The fully async
        rollout caps its groups in flight near it (--max-in-flight-groups)."""
        return None

    @property
    def tool_use(self) -> bool:
        """True when samples are multi-turn conversations with a tool (rollout/multi_turn.py): their tool_* metrics
        are reported."""
        return False

    @property
    def base(self) -> RolloutEngine:
        """The engine that holds the model: itself, or the one a wrapper runs on (rollout/multi_turn.py's
        ToolRolloutEngine). The weight sync and the colocated phases drive it."""
        return self

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the last successful weight update (0 for the initial weights)."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
