"""Fully asynchronous rollout: the scheduling rules, as a pure state machine (max staleness K, issue 41).

`StreamScheduler` holds no engine, thread or clock: a driver tells it what was submitted and what finished,
asks it how many groups to submit and takes the batches it hands over. The threaded manager and the
discrete-event simulation (tools/sim_async.py) drive the same object, so the simulation runs the real rules.

Rules (docs/ASYNC.md):
- **Versions.** Weight version v is what the actor holds after v train steps; the engine serves the version
  pushed last. Batches are trained in the order they are handed over, the n-th (from 0) at actor version
  `first_train_version + n`. A token generated at version u and trained at version t has staleness t - u.
- **Submission.** `want()` keeps ceil(factor x (K x B - ready) / r) groups in flight: K batches' worth of
  kept groups ahead of the trainer, `ready` the kept groups handed over but not taken plus those of the batch
  being built, r the keep rate measured so far (floored at KEEP_RATE_FLOOR; 1 before any decision). Dynamic
  sampling's over-sampling is this rate: there are no rounds.
- **Decisions in submission order.** A finished group is decided once every group submitted before it is
  decided (as collect.py does per step): the kept groups are the first informative ones of the prompt order,
  whatever the engines' timing, and a seeded run's batches do not depend on timing. A slow group holds back
  the decisions behind it, never the engines (they keep generating up to the in-flight target).
- **The per-token staleness bound.** At its decision a group's train version t is known (the batch being built).
  Versions never decrease along a response, so a sample's stale tokens (version < t - K) are a prefix of it.
  A group with one is, by `stale_policy`: `drop` (counted; its tokens discarded), or `regenerate` (its samples
  with a stale token are generated again from position 0 on current weights, the others kept; the group goes to
  the end of the submission order with a new position).

Units: token counts; versions are ints >= 0. A sample is given as spans, ((version, tokens), ...) in generation
order (Sample.token_versions run-length coded): 16 x 20k-token responses cost a few tuples, not 320k ints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.algorithm.dynamic_sampling import KEEP_RATE_FLOOR, group_is_informative

STALE_POLICIES: tuple[str, ...] = ("drop", "regenerate")
"""StreamConfig.stale_policy choices."""
STATE_VERSION = 1
"""Layout version of `StreamScheduler.state_dict()`."""

Spans = tuple[tuple[int, int], ...]
"""One response's token versions, run-length coded: ((version, tokens), ...) in generation order."""


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    batch_groups: int
    """B: kept groups per training batch (--rollout-batch-size)."""
    max_staleness: int
    """K: the most weight versions a trained token may lag the actor that trains it."""
    n_samples: int
    """G: responses per prompt (--n-samples-per-prompt)."""
    dynamic_sampling: bool = True
    """Keep only groups whose accuracies are mixed (--dynamic-sampling)."""
    over_sample_factor: float = 1.0
    """Multiplies the in-flight target (--over-sample-factor)."""
    stale_policy: str = "drop"
    """What happens to a group with a token staler than K at its decision (STALE_POLICIES)."""
    first_train_version: int = 0
    """Actor version the first handed-over batch is trained at: 0 in a fresh run, k after a resume at step k."""
    max_in_flight: int | None = None
    """Cap on the groups in flight (None: none). Past the servers' capacity (servers x running requests per server
    / G) a submitted group only queues, and grows staler before its first token: the driver sets this from the
    servers it has (docs/BENCHMARKS.md, "Fully async at the production setting", measures the difference)."""

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"--rollout-batch-size must be >= 1, got {self.batch_groups}")
        if self.max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 (weight versions a trained token may lag the actor), "
                             f"got {self.max_staleness}")
        if self.n_samples < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {self.n_samples}")
        if self.dynamic_sampling and self.n_samples < 2:
            raise ValueError("dynamic sampling needs --n-samples-per-prompt >= 2 (a group of one is never "
                             "informative); pass --no-dynamic-sampling or raise G")
        if self.over_sample_factor < 1.0:
            raise ValueError(f"--over-sample-factor must be >= 1, got {self.over_sample_factor}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.first_train_version < 0:
            raise ValueError(f"first_train_version must be >= 0, got {self.first_train_version}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 group (or None), got {self.max_in_flight}")


def check_spans(spans: Sequence[Sequence[int]], where: str) -> Spans:
    """`spans` as a Spans tuple; raises naming `where` when a count is negative or a version decreases."""
    out, last = [], -1
    for version, tokens in spans:
        version, tokens = int(version), int(tokens)
        if tokens < 0 or version < 0:
            raise ValueError(f"{where}: span ({version}, {tokens}) has a negative version or token count")
        if version < last:
            raise ValueError(f"{where}: versions decrease along the response ({last} then {version})")
        last = version
        out.append((version, tokens))
    return tuple(out)


def spans_of(versions: Sequence[int]) -> Spans:
    """Run-length coding of per-token versions: [3, 3, 4] -> ((3, 2), (4, 1))."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((int(v), 1))
    return tuple(out)


def oldest(spans: Spans) -> int | None:
    """Version of a response's first token (the oldest: versions never decrease); None for an empty one."""
    return next((v for v, n in spans if n), None)


def tokens(spans: Spans) -> int:
    return sum(n for _, n in spans)


@dataclass
class HandedBatch:
    """A batch of B kept groups, in submission order, for the trainer."""

    index: int
    """0 for the first batch this scheduler (or the run it resumed) handed over."""
    train_version: int
    keys: list[Any]
    """The driver's key of each kept group."""
    staleness_tokens: dict[int, int]
    """Staleness d -> tokens of this batch trained at staleness d (0 <= d <= K)."""

    def metrics(self) -> dict[str, float]:
        """rollout/staleness/<d>: share of the batch's tokens at staleness d; rollout/max_staleness."""
        total = sum(self.staleness_tokens.values())
        out = {f"rollout/staleness/{d}": (n / total if total else 0.0)
               for d, n in sorted(self.staleness_tokens.items())}
        out["rollout/max_staleness"] = float(max((d for d, n in self.staleness_tokens.items() if n), default=0))
        return out


@dataclass
class _Group:
    key: Any
    submit_version: int
    samples: list[Spans] | None = None
    accs: list[bool] | None = None
    kept_samples: dict[int, Spans] = field(default_factory=dict)
    """regenerate: the samples kept from an earlier try (index -> spans); the rest are generated again."""


@dataclass(frozen=True)
class Regenerate:
    """The driver submits `samples` of the group `key` again from position 0, on current weights, as `seq`, and
    reports the whole group (kept and new samples) with complete(seq, ...)."""

    seq: int
    key: Any
    samples: tuple[int, ...]


class StreamScheduler:
    """The fully async rollout's rules over submission sequence numbers (module docstring). Not thread-safe:
    the driver serialises calls."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self._groups: dict[int, _Group] = {}
        """seq -> group submitted and not decided yet (in flight or finished behind an undecided one)."""
        self._next_seq = 0
        self._next_decision = 0
        self._building: list[Any] = []
        self._building_hist: dict[int, int] = {}
        self._batches: list[HandedBatch] = []
        """Handed over, not taken."""
        self._handed = 0
        self._in_flight = 0
        self._regenerate: list[Regenerate] = []
        self._decisions: list[tuple[Any, str]] = []
        self.decided = 0
        self.kept = 0
        self.counts: dict[str, float] = dict.fromkeys(_COUNTS, 0.0)

    # ---- submission ---------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Groups submitted whose results have not come back."""
        return self._in_flight

    @property
    def handed(self) -> int:
        """Batches handed over so far (taken or not) by this scheduler, or the run it resumed."""
        return self._handed

    @property
    def ready(self) -> int:
        """Kept groups ahead of the trainer: handed over and not taken, plus the batch being built."""
        return len(self._batches) * self.config.batch_groups + len(self._building)

    @property
    def keep_rate(self) -> float:
        return self.kept / self.decided if self.decided else 1.0

    def want(self) -> int:
        """New groups to submit now: the in-flight target ceil(factor x (K x B - ready) / rate), at most
        max_in_flight, minus the groups in flight (regenerations count as in flight)."""
        c = self.config
        need = max(0, c.max_staleness * c.batch_groups - self.ready)
        rate = max(self.keep_rate, KEEP_RATE_FLOOR)
        target = math.ceil(c.over_sample_factor * need / rate)
        if c.max_in_flight is not None:
            target = min(target, c.max_in_flight)
        return max(0, target - self.in_flight)

    def submit(self, key: Any, version: int) -> int:
        """A new group `key` was submitted while the engine served `version`; returns its sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        self._groups[seq] = _Group(key=key, submit_version=int(version))
        self._in_flight += 1
        self.counts["stream/submitted_groups"] += 1
        return seq

    def take_decisions(self) -> list[tuple[Any, str]]:
        """(key, outcome) of every group decided since the last call, in decision order: 'kept' (its batch is or
        will be handed over), 'filtered' (dynamic sampling), 'dropped' (stale), 'regenerate' (some samples sent
        again: `take_regenerations`). The driver frees a filtered or dropped group's samples."""
        out, self._decisions = self._decisions, []
        return out

    def take_regenerations(self) -> list[Regenerate]:
        """The regenerate policy's resubmissions since the last call (already counted in flight)."""
        out, self._regenerate = self._regenerate, []
        return out

    # ---- results -----------------------------------------------------------------------------------------

    def complete(self, seq: int, samples: Sequence[Sequence[Sequence[int]]], accs: Sequence[bool]) -> None:
        """Group `seq` finished: each sample's spans ((version, tokens), ...) and its verifier accuracy. Decides
        every group now decidable in submission order; may hand over batches and queue regenerations."""
        group = self._groups.get(seq)
        if group is None or group.samples is not None:
            raise ValueError(f"group {seq} is not in flight (never submitted, already finished, or decided)")
        if len(samples) != self.config.n_samples or len(accs) != self.config.n_samples:
            raise ValueError(f"group {seq}: {len(samples)} samples and {len(accs)} accuracies, expected G = "
                             f"{self.config.n_samples} of each")
        group.samples = [check_spans(s, f"group {seq} sample {i}") for i, s in enumerate(samples)]
        group.accs = [bool(a) for a in accs]
        self._in_flight -= 1
        self.counts["stream/generated_tokens"] += sum(tokens(s) for i, s in enumerate(group.samples)
                                                       if i not in group.kept_samples)
        while self._next_decision in self._groups and self._groups[self._next_decision].samples is not None:
            self._decide(self._next_decision, self._groups.pop(self._next_decision))
            self._next_decision += 1

    def _decide(self, seq: int, group: _Group) -> None:
        c = self.config
        assert group.samples is not None and group.accs is not None
        train_version = c.first_train_version + self._handed
        bound = train_version - c.max_staleness  # the oldest version a trained token may have
        stale = [i for i, s in enumerate(group.samples) if (o := oldest(s)) is not None and o < bound]
        group_tokens = sum(tokens(s) for s in group.samples)
        if stale:
            if c.stale_policy == "drop":
                self.counts["rollout/stale_dropped_groups"] += 1
                self.counts["rollout/discarded_tokens"] += group_tokens
                self._decisions.append((group.key, "dropped"))
                return
            new_seq = self._next_seq
            self._next_seq += 1
            kept = {i: s for i, s in enumerate(group.samples) if i not in stale}
            self._groups[new_seq] = _Group(key=group.key, submit_version=group.submit_version, kept_samples=kept)
            self._in_flight += 1
            self._regenerate.append(Regenerate(seq=new_seq, key=group.key, samples=tuple(stale)))
            self.counts["rollout/regenerated_groups"] += 1
            self.counts["rollout/regenerated_tokens"] += sum(tokens(group.samples[i]) for i in stale)
            self._decisions.append((group.key, "regenerate"))
            return
        self.decided += 1
        if c.dynamic_sampling and not group_is_informative(group.accs):
            self.counts["rollout/filtered_groups"] += 1
            self.counts["rollout/filtered_tokens"] += group_tokens
            self._decisions.append((group.key, "filtered"))
            return
        self.kept += 1
        self._decisions.append((group.key, "kept"))
        self.counts["rollout/kept_tokens"] += group_tokens
        self._building.append(group.key)
        for s in group.samples:
            for version, n in s:
                d = train_version - version
                if d < 0:
                    raise RuntimeError(f"group {seq}: a token of version {version} in the batch trained at version "
                                       f"{train_version}: the engine ran ahead of the actor")
                self._building_hist[d] = self._building_hist.get(d, 0) + n
        if len(self._building) == c.batch_groups:
            self._batches.append(HandedBatch(index=self._handed, train_version=train_version, keys=self._building,
                                             staleness_tokens=self._building_hist))
            self._handed += 1
            self._building, self._building_hist = [], {}

    # ---- the trainer's side --------------------------------------------------------------------------------

    def pop_batch(self) -> HandedBatch | None:
        """The next batch for the trainer, in hand-over order; None when none is ready."""
        return self._batches.pop(0) if self._batches else None

    def take_counts(self) -> dict[str, float]:
        """Counters since the last call: submitted groups, generated / kept / filtered / discarded / regenerated
        tokens, stale-dropped and regenerated groups."""
        out, self.counts = self.counts, dict.fromkeys(_COUNTS, 0.0)
        return out

    # ---- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (keys must be ints or strings): restores the same decisions, batches and counters."""
        def group_state(seq: int, g: _Group) -> dict[str, Any]:
            return {"seq": seq, "key": g.key, "submit_version": g.submit_version,
                    "samples": None if g.samples is None else [list(map(list, s)) for s in g.samples],
                    "accs": g.accs, "kept_samples": {str(i): list(map(list, s)) for i, s in g.kept_samples.items()}}

        return {
            "version": STATE_VERSION, "next_seq": self._next_seq, "next_decision": self._next_decision,
            "handed": self._handed, "decided": self.decided, "kept": self.kept,
            "groups": [group_state(seq, g) for seq, g in sorted(self._groups.items())],
            "building": list(self._building), "building_hist": {str(d): n for d, n in self._building_hist.items()},
            "batches": [{"index": b.index, "train_version": b.train_version, "keys": list(b.keys),
                         "staleness_tokens": {str(d): n for d, n in b.staleness_tokens.items()}}
                        for b in self._batches],
            "regenerate": [{"seq": r.seq, "key": r.key, "samples": list(r.samples)} for r in self._regenerate],
            "decisions": [[key, outcome] for key, outcome in self._decisions],
            "counts": dict(self.counts),
        }

    def load_state_dict(self, data: dict[str, Any]) -> None:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"stream scheduler state has layout version {data.get('version')!r}, this code reads "
                             f"{STATE_VERSION}")
        self._next_seq, self._next_decision = int(data["next_seq"]), int(data["next_decision"])
        self._handed, self.decided, self.kept = int(data["handed"]), int(data["decided"]), int(data["kept"])
        self._groups = {}
        for g in data["groups"]:
            samples = None if g["samples"] is None else [check_spans(s, f"group {g['seq']}") for s in g["samples"]]
            self._groups[int(g["seq"])] = _Group(
                key=g["key"], submit_version=int(g["submit_version"]), samples=samples, accs=g["accs"],
                kept_samples={int(i): check_spans(s, f"group {g['seq']}") for i, s in g["kept_samples"].items()})
        self._building = list(data["building"])
        self._building_hist = {int(d): int(n) for d, n in data["building_hist"].items()}
        self._batches = [HandedBatch(index=int(b["index"]), train_version=int(b["train_version"]), keys=list(b["keys"]),
                                     staleness_tokens={int(d): int(n) for d, n in b["staleness_tokens"].items()})
                         for b in data["batches"]]
        self._regenerate = [Regenerate(seq=int(r["seq"]), key=r["key"], samples=tuple(r["samples"]))
                            for r in data["regenerate"]]
        self._in_flight = sum(1 for g in self._groups.values() if g.samples is None)
        self._decisions = [(key, str(outcome)) for key, outcome in data["decisions"]]
        self.counts = dict.fromkeys(_COUNTS, 0.0) | {k: float(v) for k, v in data.get("counts", {}).items()}


_COUNTS = ("stream/submitted_groups", "stream/generated_tokens", "rollout/kept_tokens", "rollout/filtered_tokens",
           "rollout/filtered_groups", "rollout/discarded_tokens", "rollout/stale_dropped_groups",
           "rollout/regenerated_groups", "rollout/regenerated_tokens")
