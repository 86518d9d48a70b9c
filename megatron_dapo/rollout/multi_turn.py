"""Multi-turn rollouts with a code tool, token in and token out, behind the one engine interface.

`ToolRolloutEngine` wraps any `RolloutEngine` (embedded, process, SGLang) and turns each sample of a request into a
conversation: generate until a tool call ends (the template's stop strings / stop tokens), run the call's code in
the sandbox pool, append the tool's output, generate again, until an answer (eos), `max_turns` assistant turns, or
the request's response budget (`max_new_tokens`, which bounds the whole response, tool tokens included: it is the
sequence the actor trains on). What comes out is one `Sample` per conversation, as a single-turn engine's.

Token in, token out. The conversation is carried as token ids: each turn is one inner request whose `prompt_ids`
are the prompt followed by every id so far, exactly (`resumed_tokens` = their count, so a seeded sample goes on with
its own random stream); the engine's output ids are appended as they came; the tool's output is rendered by the
template and tokenized once (`template.output_ids`) and appended. Nothing is ever re-tokenized from text: the
decoded turn is read only to find the call's code. So the ids the actor trains on are the ids the engine saw and
produced, turn by turn (tests/sglang/test_multi_turn_sglang.py checks it against a real server).

The Sample of a conversation: `response_ids` = every turn's ids and every tool output's ids, in order; `loss_mask`
1 on the ids the policy generated and 0 on the tool's (kept out of the loss and of the token-level denominator);
`logprobs` the engine's on generated ids and 0.0 on the tool's (never read: masked); `token_versions` the weight
version of each generated id, a tool id carrying its call's; `tool_calls` the calls run. `finish_reason`: 'stop'
(the policy ended without a call, or called a tool at its last allowed turn: that call is not run, its
`multi_turn/capped_calls`), 'length' (the budget ran out, in a turn or in a tool's output, which is then cut to
fit), 'abort'.

Scheduling (`MultiTurnConfig.schedule`, --tool-schedule):
- **continuous** (the default): each call is handed to the pool the moment its turn comes back, and each
  conversation is resubmitted the moment its tool returns, into the running inner stream (`OpenStream.add`, checked
  each time a turn comes back; a new stream when the last one drained). Tools run while other turns generate.
  Which turns share a batch then depends on when tools finish, so the embedded engine's batches (and its low bits)
  are not reproducible run to run.
- **rounds**: every conversation waiting for the model in one inner `stream`; when it ends, that round's calls run in
  the pool at once, then the next round. Reproducible (each round's batch is fixed: the CPU tests' choice), at the
  cost of each round's straggler: a conversation whose tool is done waits for the slowest turn of its round.
At the production setting (512 prompts x 16 responses, 3 calls of 0.2 s each, 16 TP4 servers; tools/sim_multi_turn.py,
docs/BENCHMARKS.md) a step's rollout takes 1.62x the single-turn one by rounds and 0.94x continuously.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_dapo.rollout.engine import RolloutEngine, check_unique_ids
from megatron_dapo.rollout.types import FinishReason, RolloutRequest, Sample, SamplingParams
from megatron_dapo.tool_use.sandbox import SandboxLimits


class ToolTemplate(Protocol):
    """How a tool call looks in one chat format (megatron_dapo/tool_use/templates.py)."""

    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]

    def find_call(self, turn_text: str) -> str | None:
        """The code of the call that ends this turn's decoded text, or None (an answer)."""

    def output_ids(self, tokenizer: Any, output: str) -> list[int]:
        """The ids appended after a call whose result the policy reads as `output` (tokenized once)."""


class ToolOutcome(Protocol):
    """One execution's result (megatron_dapo/tool_use/sandbox.py ToolResult)."""

    error: str | None
    wall_s: float
    """Seconds the execution took (from its start in a worker, not its wait in the pool's queue)."""

    def for_policy(self, max_chars: int) -> str:
        """The text the policy reads, at most max_chars characters."""


class ToolRunner(Protocol):
    """Runs many programs at once (megatron_dapo/tool_use/pool.py SandboxPool)."""

    def run_many(self, codes: Sequence[str]) -> list[Any]:
        """One ToolOutcome per code, in order."""

    def submit(self, code: str) -> Future:
        """A Future of the code's ToolOutcome."""


SCHEDULES = ("continuous", "rounds")
"""--tool-schedule's values (the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """The conversation's bounds (--max-turns, --tool-output-max-chars)."""

    max_turns: int = 4
    """Assistant turns per conversation (--max-turns): a call made at the last one is not run."""
    max_output_chars: int = 1024
    """Characters of a tool's output the policy reads (--tool-output-max-chars); the rest is cut with a marker."""
    schedule: str = "continuous"
    """--tool-schedule: 'continuous' (a conversation resubmitted as soon as its tool returns) or 'rounds'."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"MultiTurnConfig.max_turns (--max-turns) must be an int >= 1, got {self.max_turns!r}")
        if not isinstance(self.max_output_chars, int) or self.max_output_chars < 64:
            raise ValueError("MultiTurnConfig.max_output_chars (--tool-output-max-chars) must be an int >= 64 (room "
                             f"for the cut marker), got {self.max_output_chars!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"MultiTurnConfig.schedule (--tool-schedule) must be one of {SCHEDULES}, got "
                             f"{self.schedule!r}")


@dataclass(frozen=True, kw_only=True)
class ToolUseConfig:
    """Rank 0's multi-turn rollouts with a code tool (the "tool use" flags); None in a run without."""

    template: str
    """--tool-template: a name of tool_use/templates.py's registry or a dotted path."""
    turns: MultiTurnConfig
    workers: int
    """--tool-workers: programs run at once (SandboxPool)."""
    limits: SandboxLimits
    """--tool-cpu-s, --tool-timeout-s, --tool-memory-mib and the fixed limits of tool_use/sandbox.py."""

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not self.template:
            raise ValueError(f"ToolUseConfig.template (--tool-template) must be a non-empty name, got "
                             f"{self.template!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"ToolUseConfig.workers (--tool-workers) must be an int >= 1, got {self.workers!r}")


@dataclass
class _Conversation:
    """One sample being rolled out over several turns: everything after the prompt so far, id by id."""

    req: RolloutRequest
    index: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    weight_version: int = -1
    finish: FinishReason | None = None
    code: str | None = None
    """The call waiting for the tool (set at the end of a turn, cleared when its output is appended)."""
    turn_id: str | None = None
    """The inner request id of the turn in flight."""
    head: list[int] = field(default_factory=list)
    """A continuation (partial rollout): the ids of the turn the prefix was cut in, read with the first turn's to find
    its call."""

    @property
    def budget(self) -> int:
        return self.req.sampling.max_new_tokens - len(self.response)

    @property
    def context(self) -> int:
        """Tokens of the response before the next turn: a continuation's prefix and everything since."""
        return self.req.resumed_tokens + len(self.response)

    def to_sample(self) -> Sample:
        versions = self.versions if len(set(self.versions)) > 1 else []
        return Sample(request_id=self.req.request_id, index=self.index, prompt_ids=list(self.req.prompt_ids),
                      response_ids=list(self.response), logprobs=list(self.logprobs),
                      finish_reason=self.finish or "abort", weight_version=max(self.weight_version, 0),
                      token_versions=list(versions), loss_mask=list(self.mask) if 0 in self.mask else [],
                      tool_calls=self.tool_calls)


def turn_sampling(sampling: SamplingParams, template: ToolTemplate, budget: int) -> SamplingParams:
    """A turn's sampling: the request's, with `budget` new tokens at most and the template's stops added."""
    return dataclasses.replace(
        sampling, max_new_tokens=budget,
        stop=tuple(dict.fromkeys((*sampling.stop, *template.stop))),
        stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids, *template.stop_token_ids))))


class ToolRolloutEngine(RolloutEngine):
    """Multi-turn conversations with a code tool over `inner` (see the module docstring). `tokenizer` decodes a turn
    to find its call and encodes the tool's output (the same the engine's ids mean); `tools` runs the calls."""

    def __init__(self, inner: RolloutEngine, *, template: ToolTemplate, tokenizer: Any, tools: ToolRunner,
                 config: MultiTurnConfig) -> None:
        self.inner, self.template, self.tokenizer, self.tools, self.config = inner, template, tokenizer, tools, config
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._abort_all = False
        self._live: dict[str, list[_Conversation]] = {}
        self._counts: dict[str, float] = {}

    # ---- the engine interface, delegated ------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def capacity(self) -> int | None:
        return self.inner.capacity

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def health(self) -> bool:
        return self.inner.health()

    def shutdown(self) -> None:
        """Stops the inner engine and the tool pool (what a pool still runs is killed). Idempotent."""
        try:
            self.inner.shutdown()
        finally:
            close = getattr(self.tools, "close", None)
            if close is not None:
                close()

    @property
    def base(self) -> RolloutEngine:
        return self.inner.base

    @property
    def tool_use(self) -> bool:
        return True

    def take_metrics(self) -> dict[str, float]:
        """multi_turn/* since the last call: turns, tool_calls, tool_errors, tool_tokens, tool_exec_s (the executions'
        seconds, summed: worker-seconds), round_tool_s (rounds: the seconds generation waited for the calls),
        capped_calls. Only this wrapper's: the inner engine's counters are its weight sync's,
        which holds the inner engine (`base`). The rollout and the evaluation each take them (rollout/collect.py,
        rollout/evaluation.py)."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Stops the given requests' conversations (None: all): the turn in flight is aborted in the inner engine,
        no call waiting for the tool is run, and each comes out with finish 'abort' holding what it has so far."""
        with self._lock:
            ids = list(self._live) if request_ids is None else [r for r in request_ids if r in self._live]
            if request_ids is None:
                self._abort_all = True
            self._aborted.update(ids)
            turns = [c.turn_id for rid in ids for c in self._live[rid] if c.turn_id is not None and c.finish is None]
        if turns:
            self.inner.abort(turns)
        return ids

    # ---- the conversations ---------------------------------------------------------------------------
    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + value

    def _is_aborted(self, conv: _Conversation) -> bool:
        with self._lock:
            return self._abort_all or conv.req.request_id in self._aborted

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        """Yields each request's group of n conversations once all n have ended (completion order)."""
        check_unique_ids(requests)
        convs = {r.request_id: [self._conversation(r, r.first_index + i) for i in range(r.n)] for r in requests}
        with self._lock:
            overlap = set(convs) & set(self._live)
            if overlap:
                raise ValueError(f"request ids {sorted(overlap)[:5]} are already in flight")
            self._live.update(convs)
        try:
            yield from (self._rounds(convs) if self.config.schedule == "rounds" else self._continuous(convs))
        finally:
            with self._lock:
                for rid in convs:
                    self._live.pop(rid, None)
                    self._aborted.discard(rid)
                if not self._live:
                    self._abort_all = False

    def _conversation(self, req: RolloutRequest, index: int) -> _Conversation:
        """Sample `index` of `req` as a conversation. A continuation (req.resumed_tokens > 0: partial rollout) starts
        where its prefix was cut: its calls so far counted from req.resumed_mask; a prefix that ends with a call the
        tool never answered (cut between the turn and the tool) gets that call run first; one cut inside a turn
        keeps that turn's ids (`head`) so the call it may end with is found whole. The Sample then holds the
        continuation only, as a single-turn engine's (partial_rollout.extend joins them)."""
        conv = _Conversation(req, index)
        k = req.resumed_tokens
        if not k:
            return conv
        prefix, mask = list(req.prompt_ids[-k:]), list(req.resumed_mask) or [1] * k
        conv.turns = sum(1 for a, b in zip(mask, mask[1:], strict=False) if a == 1 and b == 0)
        if mask[-1] == 0:  # cut right after a tool's output: the next turn is a new one
            return conv
        start = k - next((j for j, m in enumerate(reversed(mask)) if m == 0), k)
        head = prefix[start:]
        code = self.template.find_call(self.tokenizer.decode(head))
        if code is None:
            conv.head = head
        elif conv.turns + 1 >= self.config.max_turns:
            conv.turns += 1
            conv.finish = "stop"  # the last allowed turn's call: not run, as uncut
            self._count("multi_turn/capped_calls", 1)
        else:
            conv.turns += 1
            conv.code = code
        return conv

    @staticmethod
    def _emitter(convs: dict[str, list[_Conversation]]):
        """A function yielding each request's group of samples once, as soon as all its conversations have ended."""
        emitted: set[str] = set()

        def done_groups() -> Iterator[list[Sample]]:
            for rid, group in convs.items():
                if rid not in emitted and all(c.finish is not None for c in group):
                    emitted.add(rid)
                    yield [c.to_sample() for c in group]
        return done_groups

    def _start_turns(self, convs: Sequence[_Conversation], turns: dict[str, _Conversation]) -> list[RolloutRequest]:
        """The next turn's request of each conversation (registered in `turns` by its inner request id)."""
        for conv in convs:
            conv.turn_id = f"{conv.req.request_id}#{conv.index}.t{conv.turns}"
            turns[conv.turn_id] = conv
        self._count("multi_turn/turns", len(convs))
        return [self._turn_request(c) for c in convs]

    def _continuous(self, convs: dict[str, list[_Conversation]]) -> Iterator[list[Sample]]:
        """Each call to the pool as its turn ends, each conversation back to the engine as its tool returns."""
        done_groups = self._emitter(convs)
        turns: dict[str, _Conversation] = {}
        returned: queue.SimpleQueue[tuple[_Conversation, Future]] = queue.SimpleQueue()
        in_tools = 0
        ready = [c for group in convs.values() for c in group if c.finish is None and c.code is None]

        def launch(conv: _Conversation) -> None:
            """The conversation's call to the pool; its return queued for the loop."""
            nonlocal in_tools
            in_tools += 1
            future = self.tools.submit(conv.code)
            future.add_done_callback(lambda f, c=conv: returned.put((c, f)))

        for conv in (c for group in convs.values() for c in group if c.code is not None):
            launch(conv)  # continuations cut between a call and its output

        def settle(conv: _Conversation, future: Future) -> None:
            """A returned call: its output appended, or the conversation ended when aborted meanwhile."""
            conv.code = None
            if self._is_aborted(conv):
                conv.finish = "abort"
                future.cancel()
                return
            self._append_output(conv, future.result())
            if conv.finish is None:
                ready.append(conv)

        def drain(block: bool) -> None:
            nonlocal in_tools
            while in_tools:
                try:
                    conv, future = returned.get(block=block)
                except queue.Empty:
                    return
                in_tools -= 1
                settle(conv, future)
                block = False

        while True:
            for conv in ready:
                if self._is_aborted(conv):
                    conv.finish = "abort"
            ready[:] = [c for c in ready if c.finish is None]
            yield from done_groups()
            if not ready:
                if not in_tools:
                    return
                drain(block=True)
                continue
            stream = self.inner.open_stream(self._start_turns(ready, turns))
            ready.clear()
            for group in stream:
                (sample,) = group
                conv = turns.pop(sample.request_id)
                conv.turn_id = None
                self._end_turn(conv, sample)
                if conv.code is not None:
                    if self._is_aborted(conv):
                        conv.finish, conv.code = "abort", None
                    else:
                        launch(conv)
                yield from done_groups()
                drain(block=False)
                if ready and stream.accepts_additions:
                    stream.add(self._start_turns([c for c in ready if not self._is_aborted(c)], turns))
                    for conv in ready:
                        if self._is_aborted(conv):
                            conv.finish = "abort"
                    ready.clear()
                    yield from done_groups()

    def _rounds(self, convs: dict[str, list[_Conversation]]) -> Iterator[list[Sample]]:
        """Every waiting conversation's turn in one stream, then the round's calls at once, round after round."""
        done_groups = self._emitter(convs)
        self._run_calls([c for group in convs.values() for c in group if c.code is not None])  # cut before the tool
        while True:
            waiting = [c for group in convs.values() for c in group if c.finish is None]
            for conv in waiting:
                if self._is_aborted(conv):
                    conv.finish = "abort"
            yield from done_groups()
            waiting = [c for c in waiting if c.finish is None]
            if not waiting:
                return
            turns: dict[str, _Conversation] = {}
            requests = self._start_turns(waiting, turns)
            for group in self.inner.stream(requests):
                (sample,) = group
                conv = turns[sample.request_id]
                conv.turn_id = None
                self._end_turn(conv, sample)
                yield from done_groups()
            self._run_calls([c for c in waiting if c.code is not None])

    def _turn_request(self, conv: _Conversation) -> RolloutRequest:
        return RolloutRequest(prompt_ids=list(conv.req.prompt_ids) + conv.response, n=1,
                              sampling=turn_sampling(conv.req.sampling, self.template, conv.budget),
                              request_id=conv.turn_id, first_index=conv.index, resumed_tokens=conv.context)

    def _end_turn(self, conv: _Conversation, sample: Sample) -> None:
        """Appends a turn's ids as the engine gave them and decides what follows: a call for the tool, or the end."""
        if conv.weight_version < 0:
            conv.weight_version = sample.weight_version
        conv.response += sample.response_ids
        conv.logprobs += sample.logprobs
        conv.mask += [1] * len(sample.response_ids)
        conv.versions += sample.versions()
        conv.turns += 1
        if sample.finish_reason != "stop":
            conv.finish = sample.finish_reason
            return
        code = self.template.find_call(self.tokenizer.decode(conv.head + sample.response_ids))
        conv.head = []
        if code is None:
            conv.finish = "stop"
        elif self._is_aborted(conv):
            conv.finish = "abort"  # the call is not run
        elif conv.turns >= self.config.max_turns:
            conv.finish = "stop"
            self._count("multi_turn/capped_calls", 1)
        else:
            conv.code = code

    def _run_calls(self, calling: list[_Conversation]) -> None:
        """Runs the round's calls in the pool at once and appends each output's ids (cut to the budget)."""
        calling = [c for c in calling if not self._is_aborted(c)]
        if not calling:
            return
        t0 = time.perf_counter()
        results = self.tools.run_many([c.code for c in calling])
        self._count("multi_turn/round_tool_s", time.perf_counter() - t0)  # generation waits for this
        for conv, result in zip(calling, results, strict=True):
            conv.code = None
            self._append_output(conv, result)

    def _append_output(self, conv: _Conversation, result: Any) -> None:
        """A call's output, as the policy reads it, appended as the tool's ids (cut to the budget: then 'length')."""
        conv.tool_calls += 1
        self._count("multi_turn/tool_calls", 1)
        self._count("multi_turn/tool_errors", result.error is not None)
        self._count("multi_turn/tool_exec_s", result.wall_s)
        # without print()'s last newline: the templates close the output on a line of their own
        text = result.for_policy(self.config.max_output_chars).removesuffix("\n")
        ids = self.template.output_ids(self.tokenizer, text)
        room = conv.budget
        if len(ids) >= room:
            ids = ids[:room]
            conv.finish = "length"
        self._count("multi_turn/tool_tokens", len(ids))
        version = conv.versions[-1] if conv.versions else conv.weight_version
        conv.response += ids
        conv.logprobs += [0.0] * len(ids)
        conv.mask += [0] * len(ids)
        conv.versions += [version] * len(ids)
