"""A simulated rollout engine whose latency grows with response length, for the dynamic-sampling tests and
tools/bench_dynamic_sampling.py.

Each request's group is drawn from its own RNG (seeded by the request's sampling seed, so a seeded step
is reproducible): with probability `keep_rate` the group is informative (some responses correct, some
wrong), otherwise all correct or all wrong. Every response is truncated (length = max_new_tokens,
finish 'length') with probability `truncate_prob`, else its length is uniform in [1, max_new_tokens - 1].
All requests of a call start together and a group finishes when its longest response does, so groups
stream out in completion order and the truncated ones come last. `abort()` turns every group not yet
streamed into an aborted one (the RolloutEngine contract).

Token ids: the first response token is 1 (correct) or 0 (wrong), the rest are 2; `decode` and `reward`
below read them.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from megatron_dapo.collect import Prompt
from megatron_dapo.reward import RewardResult
from megatron_dapo.rollout.engine import RolloutEngine, check_unique_ids
from megatron_dapo.rollout.types import RolloutRequest, Sample


def decode(ids: list[int]) -> str:
    return "1" if ids and ids[0] == 1 else "0"


def reward(text: str, ground_truth: str) -> RewardResult:
    correct = text == "1"
    return RewardResult(score=1.0 if correct else -1.0, acc=correct)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_ids=[3, i % 250 + 3], ground_truth="1", index=i) for i in range(n)]


def cycling(items: Sequence[Prompt]):
    """next_prompts(k) over `items` in order, wrapping around."""
    state = {"i": 0}

    def next_prompts(k: int) -> list[Prompt]:
        out = [items[(state["i"] + j) % len(items)] for j in range(k)]
        state["i"] += k
        return out

    return next_prompts


@dataclass
class GroupRecord:
    """What the engine generated (or would have, had it not been aborted) for one request."""

    request_id: str
    informative: bool
    truncated: bool
    """At least one response hit max_new_tokens."""
    streamed: bool = False
    """Came out of stream() finished (not aborted)."""


@dataclass
class LengthLatencyEngine(RolloutEngine):
    keep_rate: float
    truncate_prob: float
    seed: int = 0
    records: dict[str, GroupRecord] = field(default_factory=dict)
    """Every request ever submitted, in submission order."""
    busy_time: float = 0.0
    """Simulated generation time of all calls so far, in units of one max_new_tokens response: each call
    lasts until the last group it streamed finished (aborted groups stop costing at the abort)."""
    _pending: list[str] = field(default_factory=list)
    _aborted: set[str] = field(default_factory=set)

    def _draw(self, req: RolloutRequest) -> tuple[list[list[int]], float]:
        """The group's responses and its finish time (longest response + a tie-breaking fraction)."""
        key = req.sampling.seed if req.sampling.seed is not None else zlib.crc32(req.request_id.encode())
        rng = random.Random(f"{self.seed}:{key}")
        g, max_len = req.n, req.sampling.max_new_tokens
        if rng.random() < self.keep_rate:
            correct = rng.randint(1, g - 1)
            accs = [True] * correct + [False] * (g - correct)
            rng.shuffle(accs)
        else:
            accs = [rng.random() < 0.5] * g
        lengths = [max_len if rng.random() < self.truncate_prob else rng.randint(1, max_len - 1) for _ in accs]
        responses = [[1 if a else 0] + [2] * (n - 1) for a, n in zip(accs, lengths)]
        self.records[req.request_id] = GroupRecord(req.request_id, informative=len(set(accs)) == 2,
                                                   truncated=max(lengths) == max_len)
        return responses, max(lengths) + rng.random()

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        check_unique_ids(requests)
        drawn = [(req, *self._draw(req)) for req in requests]
        drawn.sort(key=lambda item: item[2])  # completion order
        self._pending = [req.request_id for req, _, _ in drawn]
        start = self.busy_time
        self._aborted = set()
        for req, responses, finish in drawn:
            self._pending.remove(req.request_id)
            aborted = req.request_id in self._aborted
            if not aborted:
                self.records[req.request_id].streamed = True
                self.busy_time = max(self.busy_time, start + finish / req.sampling.max_new_tokens)
            yield [Sample(request_id=req.request_id, index=i, prompt_ids=req.prompt_ids,
                          response_ids=[] if aborted else ids, logprobs=[] if aborted else [-0.5] * len(ids),
                          finish_reason="abort" if aborted else
                          ("length" if len(ids) >= req.sampling.max_new_tokens else "stop"),
                          weight_version=0)
                   for i, ids in enumerate(responses)]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        stopped = list(self._pending) if request_ids is None else [r for r in request_ids if r in self._pending]
        self._aborted |= set(stopped)
        return stopped

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def update_weights(self, named_tensors, *, version: int) -> None: ...
    def health(self) -> bool: return True
    def shutdown(self) -> None: ...
    @property
    def weight_version(self) -> int: return 0
