"""A timed stand-in for a pool of SGLang servers: continuous batching, event by event (tools/sim_async.py).

Each server decodes its running requests together, one token each per iteration; an iteration with n running
requests takes `t0 + t1 * n` seconds (weights read once per iteration, each request's KV cache read once: the
memory-bound decode regime). At most `max_running` requests run per server; the others queue in arrival order.
A request's prefill is not timed (DAPO prompts are a few hundred tokens against thousands decoded), except the
re-prefill after a weight update in retract mode (docs/ASYNC.md), which holds the server for
(prompt + generated tokens of every running request) / prefill_tps, and a request's own `prefill` tokens (a
multi-turn conversation's context resubmitted without a cached prefix, tools/sim_multi_turn.py), which hold the
server prefill / prefill_tps when it is admitted.

Exact event times, not a tick loop: all running requests of a server advance at the same rate, so each server
keeps one progress counter (tokens decoded by a request running since the start); a request admitted at progress
p with L tokens to go ends at p + L, and the next completion is the smallest such end (a heap). A pool of 32
servers and 10^5 requests simulates in seconds.

Per-token weight versions: a request records the progress at which each weight update landed while it ran, so its
response is run-length coded as ((version, tokens), ...) (rollout/stream.py's Spans).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ServerModel:
    """One server's timing (seconds, tokens)."""

    t0: float
    """Seconds per decode iteration with no request (the weights' read)."""
    t1: float
    """Seconds per decode iteration per running request (its KV cache's read, at a typical context length)."""
    max_running: int
    """Requests decoding at once (KV cache capacity); the rest queue."""
    prefill_tps: float
    """Prefill tokens per second, for the re-prefill after a weight update (retract)."""

    def __post_init__(self) -> None:
        if self.t0 < 0 or self.t1 < 0 or self.t0 + self.t1 <= 0:
            raise ValueError(f"ServerModel needs t0, t1 >= 0 and t0 + t1 > 0, got t0={self.t0}, t1={self.t1}")
        if self.max_running < 1 or self.prefill_tps <= 0:
            raise ValueError(f"ServerModel needs max_running >= 1 and prefill_tps > 0, got {self.max_running}, "
                             f"{self.prefill_tps}")

    def iteration_s(self, running: int) -> float:
        return self.t0 + self.t1 * running


@dataclass
class SimRequest:
    """One response being generated: `length` tokens after a `prompt`-token prompt."""

    rid: int
    length: int
    prompt: int
    tag: object = None
    """The driver's handle (group, sample index)."""
    start: float = -1.0
    """Server progress when admitted (-1 while queued)."""
    marks: list[tuple[int, float]] = field(default_factory=list)
    """(version, server progress) at admission and at each weight update while running."""
    done_at: float = -1.0
    """Simulated time of completion (or abort)."""
    generated: int = 0
    """Tokens generated when it ended (length unless aborted)."""
    prefill: int = 0
    """Tokens prefilled at admission, holding the whole server prefill / prefill_tps seconds (0: not timed)."""
    server: int = -1
    """Index of the server it was sent to."""

    def spans(self) -> tuple[tuple[int, int], ...]:
        """((version, tokens), ...) of the `generated` tokens; the counts sum to `generated` exactly."""
        cuts = [min(self.generated, max(0, round(at - self.start))) for _, at in self.marks[1:]] + [self.generated]
        out: list[tuple[int, int]] = []
        low = 0
        for (version, _), high in zip(self.marks, cuts, strict=True):
            n = high - low
            low = high
            if out and out[-1][0] == version:
                out[-1] = (version, out[-1][1] + n)
            elif n or not out:
                out.append((version, n))
        return tuple(out)


class _Server:
    def __init__(self, model: ServerModel) -> None:
        self.model = model
        self.progress = 0.0
        self.running: dict[int, SimRequest] = {}
        self.ends: list[tuple[float, int]] = []  # (progress at end, rid) of each running request: a heap
        self.queue: deque[SimRequest] = deque()
        self.held_until = 0.0  # paused (re-prefill, push) until this time
        self.busy_s = 0.0  # seconds spent decoding or re-prefilling

    @property
    def load(self) -> int:
        return len(self.running) + len(self.queue)

    def rate(self) -> float:
        """Tokens per second per running request."""
        return 1.0 / self.model.iteration_s(len(self.running)) if self.running else 0.0

    def next_end(self, now: float) -> float:
        """Time of this server's next completion (inf when idle)."""
        if not self.ends:
            return float("inf")
        start = max(now, self.held_until)
        return start + (self.ends[0][0] - self.progress) / self.rate()

    def advance(self, now: float, to: float) -> None:
        if self.running:
            start = max(now, self.held_until)
            if to > start:
                self.progress += (to - start) * self.rate()
                self.busy_s += to - start

    def admit(self, version: int, now: float) -> None:
        while self.queue and len(self.running) < self.model.max_running:
            req = self.queue.popleft()
            if req.prefill:  # every running request waits while it is prefilled (no chunked prefill)
                hold = req.prefill / self.model.prefill_tps
                self.held_until = max(self.held_until, now) + hold
                self.busy_s += hold
            req.start = self.progress
            req.marks = [(version, self.progress)]
            self.running[req.rid] = req
            heapq.heappush(self.ends, (self.progress + req.length, req.rid))


class ServerPool:
    """`servers` identical servers behind a least-loaded router. The driver submits, advances time to the next
    event and collects completions; `update_weights` holds every server for the push plus its re-prefill."""

    def __init__(self, model: ServerModel, servers: int) -> None:
        if servers < 1:
            raise ValueError(f"ServerPool needs >= 1 server, got {servers}")
        self.model = model
        self.servers = [_Server(model) for _ in range(servers)]
        self.now = 0.0
        self.version = 0
        self._ids = itertools.count()
        self.generated_tokens = 0

    def submit(self, requests: list[tuple[int, int, object]], *, server: int | None = None,
               prefill: int = 0) -> list[SimRequest]:
        """One group: (length, prompt tokens, tag) per response, all to `server` or else the least-loaded one
        (SGLang's router sends an n-sample request to one server); each prefills `prefill` tokens when admitted."""
        index = min(range(len(self.servers)), key=lambda i: self.servers[i].load) if server is None else server
        out = [SimRequest(rid=next(self._ids), length=max(0, length), prompt=prompt, tag=tag, prefill=prefill,
                          server=index) for length, prompt, tag in requests]
        self.servers[index].queue.extend(out)
        self.servers[index].admit(self.version, self.now)
        return out

    def next_event(self) -> float:
        return min(s.next_end(self.now) for s in self.servers)

    def advance(self, to: float) -> list[SimRequest]:
        """Runs every server until time `to`; returns the requests that finished by then, by finishing time."""
        if to < self.now:
            raise ValueError(f"time runs forward: {to} < {self.now}")
        done: list[SimRequest] = []
        while True:
            t = min(self.next_event(), to)
            for s in self.servers:
                s.advance(self.now, t)
            self.now = t
            for s in self.servers:
                while s.ends and s.ends[0][0] <= s.progress + 1e-6:
                    _, rid = heapq.heappop(s.ends)
                    req = s.running.pop(rid)
                    req.done_at, req.generated = self.now, req.length
                    self.generated_tokens += req.length
                    done.append(req)
                s.admit(self.version, self.now)
            if t >= to:
                return done

    def abort_all(self) -> list[SimRequest]:
        """Ends every running and queued request now, with the tokens it generated."""
        out = []
        for s in self.servers:
            for req in s.running.values():
                req.done_at = self.now
                req.generated = int(round(s.progress - req.start))
                self.generated_tokens += req.generated
                out.append(req)
            for req in s.queue:
                req.done_at, req.start, req.generated = self.now, 0.0, 0
                req.marks = [(self.version, 0.0)]
                out.append(req)
            s.running, s.ends, s.queue = {}, [], deque()
        return out

    def update_weights(self, version: int, push_s: float, retract: bool = True) -> float:
        """A weight update landing now: every server is held `push_s` plus, in retract mode, the re-prefill of
        its running requests; their later tokens carry `version`. Returns the longest hold (seconds)."""
        longest = 0.0
        self.version = version
        for s in self.servers:
            hold = push_s
            if retract and s.running:
                context = sum(r.prompt + (s.progress - r.start) for r in s.running.values())
                hold += context / self.model.prefill_tps
                s.busy_s += context / self.model.prefill_tps
            s.held_until = max(s.held_until, self.now) + hold
            for r in s.running.values():
                r.marks.append((version, s.progress))
            longest = max(longest, hold)
        return longest

    def busy_seconds(self) -> float:
        """Server-seconds spent decoding or re-prefilling since time 0, summed over the servers."""
        return sum(s.busy_s for s in self.servers)
