"""Timed training schedules at the production setting, driving the real scheduling code (tools/sim_async.py).

- synchronous (split pools or colocated): the real `rollout.collect.collect_batch` (rounds sized by the keep rate,
  decisions in submission order, the abort at the cut) against `SimEngine`, a RolloutEngine whose time is the
  server pool's (servers.py); then the trainer's time; then the push (split) or the switch (colocated).
- one step off (--async-rollout 1): the same batches; a step costs max(generation of the next, training of this
  one) + push, as rollout/async_rollout.py schedules it.
- fully async (max staleness K): the real `rollout.stream.StreamScheduler` in an event loop with the pool and a
  trainer: the trainer takes each batch the moment it is handed over, and every push lands while the servers
  generate (retract: each server held for the push and its running requests' re-prefill).

Time is simulated seconds; nothing sleeps. Workload and hardware figures are parameters (`Workload`, `Hardware`):
tools/sim_async.py names where each default comes from.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig, group_is_informative
from megatron_dapo.reward import RewardResult
from megatron_dapo.rollout.collect import CollectConfig, Prompt, collect_batch
from megatron_dapo.rollout.engine import RolloutEngine, check_unique_ids
from megatron_dapo.rollout.stream import StreamConfig, StreamScheduler
from megatron_dapo.rollout.streaming import IN_FLIGHT_SLACK, in_flight_cap
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams
from megatron_dapo.simulate.servers import ServerModel, ServerPool, SimRequest


@dataclass(frozen=True, kw_only=True)
class Workload:
    """DAPO's batch and the responses' lengths and outcomes (defaults: tools/sim_async.py's sources)."""

    batch_groups: int = 512
    n_samples: int = 16
    keep_rate: float = 0.5
    """Share of groups with mixed accuracies (kept by dynamic sampling)."""
    mean_length: float = 4500.0
    """Mean response length before truncation (tokens)."""
    max_length: int = 20480
    sigma_prompt: float = 0.6
    """Log-normal spread of a prompt's typical length (hard prompts run long for every sample)."""
    sigma_sample: float = 0.5
    """Log-normal spread of the samples of one prompt."""
    prompt_tokens: int = 300
    over_sample_factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.n_samples < 2:
            raise ValueError(f"Workload needs batch_groups >= 1 and n_samples >= 2 (dynamic sampling), got "
                             f"{self.batch_groups}, {self.n_samples}")
        if not 0.0 < self.keep_rate <= 1.0:
            raise ValueError(f"Workload.keep_rate must be in (0, 1], got {self.keep_rate}")
        if not 0 < self.mean_length <= self.max_length:
            raise ValueError(f"Workload.mean_length must be in (0, max_length={self.max_length}], got "
                             f"{self.mean_length}")
        if self.sigma_prompt < 0 or self.sigma_sample < 0 or self.prompt_tokens < 1:
            raise ValueError("Workload needs sigma_prompt, sigma_sample >= 0 and prompt_tokens >= 1")

    def draw(self, index: int, attempt: int = 0) -> tuple[list[int], list[bool]]:
        """Prompt `index`'s G response lengths and accuracies (a fixed draw per index and attempt)."""
        rng = random.Random(self.seed * 1_000_003 + index * 101 + attempt)
        mu = math.log(self.mean_length) - (self.sigma_prompt ** 2 + self.sigma_sample ** 2) / 2
        centre = rng.gauss(mu, self.sigma_prompt)
        lengths = [max(1, min(self.max_length, int(math.exp(rng.gauss(centre, self.sigma_sample)))))
                   for _ in range(self.n_samples)]
        if rng.random() < self.keep_rate:
            right = rng.randint(1, self.n_samples - 1)
            accs = [True] * right + [False] * (self.n_samples - right)
            rng.shuffle(accs)
        else:
            accs = [rng.random() < 0.5] * self.n_samples
        return lengths, accs


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-GPU and per-server figures (seconds, tokens, bytes)."""

    server: ServerModel
    server_gpus: int = 4
    """GPUs per SGLang server (TP)."""
    train_tokens_per_gpu_s: float = 1040.0
    """Actor throughput: prompt + response tokens per GPU-second, log-prob recompute, forward and backward."""
    step_overhead_s: float = 10.0
    """Per train step: optimizer, gradient reduction, data plane."""
    push_s: float = 14.2
    """A weight push to every server (split pools)."""
    switch_s: float = 30.0
    """Colocated: per step, the engine's sleep / wake and the weights' reload in place."""
    retract: bool = True
    """Fully async pushes: SGLang's retract pause (running requests re-prefilled on the new weights, docs/ASYNC.md);
    False: in_place (KV kept, no re-prefill; the tokens' version labels then overstate how fresh they are)."""

    def __post_init__(self) -> None:
        if self.server_gpus < 1 or self.train_tokens_per_gpu_s <= 0:
            raise ValueError(f"Hardware needs server_gpus >= 1 and train_tokens_per_gpu_s > 0, got "
                             f"{self.server_gpus}, {self.train_tokens_per_gpu_s}")
        if min(self.step_overhead_s, self.push_s, self.switch_s) < 0:
            raise ValueError("Hardware's step_overhead_s, push_s and switch_s must be >= 0")

    def train_s(self, tokens: int, gpus: int) -> float:
        return tokens / (self.train_tokens_per_gpu_s * gpus) + self.step_overhead_s

    def work_bound_s(self, generated: float, trained: float, gpus: int) -> float:
        """Seconds a step takes with every GPU busy all the time: `generated` response tokens at the servers'
        full-load decode rate, `trained` tokens at the actor's rate, on `gpus` GPUs, plus the step's overhead.
        No schedule beats it; how close one gets is what scheduling buys."""
        m = self.server
        decode_per_gpu = m.max_running / m.iteration_s(m.max_running) / self.server_gpus
        return (generated / decode_per_gpu + trained / self.train_tokens_per_gpu_s) / gpus + self.step_overhead_s


@dataclass
class Result:
    """One schedule's steady state (the steps after `warmup`)."""

    name: str
    gpus: int
    seconds_per_step: float
    responses_per_step: float
    server_idle: float | None = None
    """Share of server time not generating (None: colocated, the GPUs train in between)."""
    staleness: dict[int, float] = field(default_factory=dict)
    """Share of trained tokens at each staleness."""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_hours_per_1k(self) -> float:
        """GPU-hours per 1,000 trained responses."""
        return self.gpus * self.seconds_per_step / 3600 / (self.responses_per_step / 1000)


# ---- the synchronous schedules, through collect_batch ---------------------------------------------------------

def _decode(ids: Sequence[int]) -> str:
    return "1" if len(ids) and ids[0] == 1 else "0"


def _reward(text: str, ground_truth: str) -> RewardResult:
    return RewardResult(score=1.0 if text == "1" else -1.0, acc=text == "1")


class SimEngine(RolloutEngine):
    """A RolloutEngine on a ServerPool: `stream` runs simulated time until each group's last response ends.
    Response ids are ranges (only their length and first id are read): id 1 first for a correct response."""

    def __init__(self, pool: ServerPool, workload: Workload) -> None:
        self.pool, self.workload = pool, workload
        self._aborted = False

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        check_unique_ids(requests)
        self._aborted = False
        waiting: dict[str, list[SimRequest]] = {}
        accs: dict[str, list[bool]] = {}
        by_id = {r.request_id: r for r in requests}
        for req in requests:
            lengths, accs[req.request_id] = self.workload.draw(req.prompt_ids[0])
            waiting[req.request_id] = self.pool.submit([(n, self.workload.prompt_tokens, (req.request_id, i))
                                                        for i, n in enumerate(lengths)])
        left = {rid: len(v) for rid, v in waiting.items()}
        while waiting:
            if self._aborted:
                self.pool.abort_all()
                for rid in list(waiting):
                    yield self._samples(by_id[rid], waiting.pop(rid), accs[rid])
                return
            for sim in self.pool.advance(self.pool.next_event()):
                rid = sim.tag[0]
                left[rid] -= 1
                if left[rid] == 0:
                    yield self._samples(by_id[rid], waiting.pop(rid), accs[rid])

    def _samples(self, req: RolloutRequest, sims: list[SimRequest], accs: list[bool]) -> list[Sample]:
        out = []
        for i, (sim, acc) in enumerate(zip(sims, accs, strict=True)):
            n = sim.generated
            reason = "abort" if n < sim.length else ("length" if n >= self.workload.max_length else "stop")
            ids = range(int(acc), int(acc) + n)
            out.append(Sample(request_id=req.request_id, index=i, prompt_ids=req.prompt_ids, response_ids=ids,
                              logprobs=ids, finish_reason=reason, weight_version=self.pool.version))
        return out

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        self._aborted = True
        return []

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def health(self) -> bool: return True
    def shutdown(self) -> None: ...

    @property
    def weight_version(self) -> int:
        return self.pool.version


def _collect_config(w: Workload) -> CollectConfig:
    """DAPO's collection at `w`'s shape; the overlong buffer a fifth of the length (DAPO: 4,096 of 20,480)."""
    return CollectConfig(n_samples_per_prompt=w.n_samples, sampling=SamplingParams(max_new_tokens=w.max_length),
                         dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=w.batch_groups),
                         overlong=OverlongConfig(max_response_length=w.max_length, buffer_length=w.max_length // 5),
                         over_sample_factor=w.over_sample_factor)


@dataclass(frozen=True)
class SyncBatch:
    gen_s: float
    """Simulated seconds from the first request to the step's last group (the cut)."""
    tokens: int
    """Prompt + response tokens of the kept groups (what the trainer processes)."""
    busy_s: float
    """Seconds each server spent generating in that time, averaged over the servers."""


def sync_batches(w: Workload, hw: Hardware, servers: int, steps: int) -> list[SyncBatch]:
    """`steps` synchronous batches through collect_batch on `servers` servers."""
    pool = ServerPool(hw.server, servers)
    engine = SimEngine(pool, w)
    counter = itertools.count()

    def next_prompts(k: int) -> list[Prompt]:
        return [Prompt(prompt_ids=[i], ground_truth="1", index=i) for i in (next(counter) for _ in range(k))]

    out = []
    for step in range(1, steps + 1):
        t0, busy0 = pool.now, pool.busy_seconds()
        result = collect_batch(engine, next_prompts, _decode, _reward, _collect_config(w), step=step)
        tokens = sum(len(s.response_ids) + w.prompt_tokens for g in result.groups for s in g.samples)
        out.append(SyncBatch(pool.now - t0, tokens, (pool.busy_seconds() - busy0) / servers))
        pool.version = step
    return out


def _result(name: str, gpus: int, w: Workload, per_step: list[float], busy: float | None, **kw) -> Result:
    total = sum(per_step)
    return Result(name=name, gpus=gpus, seconds_per_step=total / len(per_step),
                  responses_per_step=w.batch_groups * w.n_samples,
                  server_idle=None if busy is None else 1 - busy / total, **kw)


def sync_split(w: Workload, hw: Hardware, *, gen_gpus: int, train_gpus: int, steps: int, warmup: int) -> Result:
    """Generation on `gen_gpus`, then the push, then training on `train_gpus`: each pool idle in turn."""
    batches = sync_batches(w, hw, gen_gpus // hw.server_gpus, steps)[warmup:]
    per_step = [b.gen_s + hw.push_s + hw.train_s(b.tokens, train_gpus) for b in batches]
    return _result(f"sync split {gen_gpus}+{train_gpus}", gen_gpus + train_gpus, w, per_step,
                   sum(b.busy_s for b in batches), staleness={0: 1.0},
                   extra={"gen_s": sum(b.gen_s for b in batches) / len(batches)})


def sync_colocated(w: Workload, hw: Hardware, *, gpus: int, steps: int, warmup: int) -> Result:
    """verl's recipe: every GPU generates, then every GPU trains, with the engine's sleep / wake in between."""
    batches = sync_batches(w, hw, gpus // hw.server_gpus, steps)[warmup:]
    per_step = [b.gen_s + hw.switch_s + hw.train_s(b.tokens, gpus) for b in batches]
    return _result(f"sync colocated {gpus}", gpus, w, per_step, None, staleness={0: 1.0},
                   extra={"gen_s": sum(b.gen_s for b in batches) / len(batches)})


def verl_recipe(w: Workload, hw: Hardware, *, gpus: int, steps: int, warmup: int, gen_factor: int = 3) -> Result:
    """verl's DAPO recipe (recipe/dapo, run_dapo_qwen2.5_32b.sh): colocated; each generation batch is
    gen_factor x B prompts (gen_prompt_bsz = 3 x train_prompt_bsz), waited for to its last response; batches are
    generated until B informative groups are kept, the first B trained, the rest discarded."""
    pool = ServerPool(hw.server, gpus // hw.server_gpus)
    engine = SimEngine(pool, w)
    counter = itertools.count()
    per_step, gen_total = [], 0.0
    for step in range(1, steps + 1):
        t0, kept, tokens, rounds = pool.now, 0, 0, 0
        while kept < w.batch_groups:
            rounds += 1
            reqs = [RolloutRequest(prompt_ids=[i], n=w.n_samples, request_id=f"s{step}-r{rounds}-p{i}",
                                   sampling=SamplingParams(max_new_tokens=w.max_length))
                    for i in (next(counter) for _ in range(gen_factor * w.batch_groups))]
            for group in engine.generate(reqs):
                accs = [_decode(s.response_ids) == "1" for s in group]
                if kept < w.batch_groups and group_is_informative(accs):
                    kept += 1
                    tokens += sum(len(s.response_ids) + w.prompt_tokens for s in group)
        pool.version = step
        if step > warmup:
            gen_total += pool.now - t0
            per_step.append(pool.now - t0 + hw.switch_s + hw.train_s(tokens, gpus))
    return _result(f"verl recipe colocated {gpus}", gpus, w, per_step, None, staleness={0: 1.0},
                   extra={"gen_s": gen_total / len(per_step)})


def one_step_off(w: Workload, hw: Hardware, *, gen_gpus: int, train_gpus: int, steps: int, warmup: int) -> Result:
    """--async-rollout 1: step k costs max(generation of batch k+1, training of batch k) + push."""
    batches = sync_batches(w, hw, gen_gpus // hw.server_gpus, steps + 1)
    per_step = [max(batches[k + 1].gen_s, hw.train_s(batches[k].tokens, train_gpus)) + hw.push_s
                for k in range(warmup, steps)]
    return _result(f"one-step-off {gen_gpus}+{train_gpus}", gen_gpus + train_gpus, w, per_step,
                   sum(batches[k + 1].busy_s for k in range(warmup, steps)), staleness={1: 1.0})


# ---- fully async, through StreamScheduler ---------------------------------------------------------------------

@dataclass
class _Flight:
    index: int
    seq: int
    accs: list[bool]
    sims: list[SimRequest | None]
    spans: list[tuple[tuple[int, int], ...] | None]
    left: int


def fully_async(w: Workload, hw: Hardware, *, gen_gpus: int, train_gpus: int, max_staleness: int, steps: int,
                warmup: int, stale_policy: str = "drop", in_flight_slack: float | None = IN_FLIGHT_SLACK) -> Result:
    """The StreamScheduler with `gen_gpus / server_gpus` servers and a trainer on `train_gpus`: the trainer takes
    each batch the moment it is handed over (when free), trains, then pushes while the servers generate.
    `in_flight_slack`: groups in flight capped at slack x the servers' capacity (servers x max_running / G);
    None: no cap (the K x B / keep-rate target alone)."""
    if not 0 <= warmup < steps:
        raise ValueError(f"need 0 <= warmup < steps, got warmup={warmup}, steps={steps}")
    pool = ServerPool(hw.server, gen_gpus // hw.server_gpus)
    cap = None if in_flight_slack is None else \
        in_flight_cap(len(pool.servers) * hw.server.max_running, w.n_samples, in_flight_slack)
    sched = StreamScheduler(StreamConfig(batch_groups=w.batch_groups, max_staleness=max_staleness,
                                         n_samples=w.n_samples, over_sample_factor=w.over_sample_factor,
                                         stale_policy=stale_policy, max_in_flight=cap))
    counter = itertools.count()
    flights: dict[int, _Flight] = {}
    tokens_of: dict[int, int] = {}  # prompt index -> prompt + response tokens of its finished group
    attempts: dict[int, int] = {}
    state, until, idle_since = "idle", math.inf, 0.0  # the trainer: idle, training or pushing (until)
    step_ends: list[float] = [0.0]
    busy_at: list[float] = [0.0]
    hist: dict[int, int] = {}
    holds: list[float] = []
    counts: dict[str, float] = {}
    trainer_wait = 0.0
    held = peak_held = 0  # tokens of finished groups on the host, not yet trained (or decided away)

    def submit(seq: int, index: int, samples: Sequence[int]) -> None:
        lengths, accs = w.draw(index, attempts.get(index, 0))
        flight = flights.get(index) or _Flight(index=index, seq=seq, accs=accs, sims=[None] * w.n_samples,
                                               spans=[None] * w.n_samples, left=0)
        flight.seq = seq
        for i in samples:
            flight.accs[i] = accs[i]
        sims = pool.submit([(lengths[i], w.prompt_tokens, (index, i)) for i in samples])
        for i, sim in zip(samples, sims, strict=True):
            flight.sims[i], flight.spans[i] = sim, None
        flight.left = len(samples)
        flights[index] = flight

    while len(step_ends) <= steps:
        for _ in range(sched.want()):
            index = next(counter)
            submit(sched.submit(index, pool.version), index, range(w.n_samples))
        for regen in sched.take_regenerations():  # the group's flight was kept: its other samples stay
            attempts[regen.key] = attempts.get(regen.key, 0) + 1
            submit(regen.seq, regen.key, regen.samples)
        if state == "idle" and (batch := sched.pop_batch()) is not None:
            if len(step_ends) > warmup:
                trainer_wait += pool.now - idle_since
            for d, n in batch.staleness_tokens.items():
                hist[d] = hist.get(d, 0) + n
            batch_tokens = sum(tokens_of.pop(k) for k in batch.keys)
            held -= batch_tokens  # to the trainer
            state, until = "training", pool.now + hw.train_s(batch_tokens, train_gpus)
        t = min(pool.next_event(), until)
        if t == math.inf:
            raise RuntimeError("simulation stalled: nothing in flight and the trainer idle")
        for sim in pool.advance(t):
            index, i = sim.tag
            flight = flights[index]
            flight.spans[i] = sim.spans()
            flight.left -= 1
            if flight.left == 0:
                held -= tokens_of.get(index, 0)  # a regenerated group: its earlier samples are counted again
                tokens_of[index] = sum(s.generated + w.prompt_tokens for s in flight.sims)
                held += tokens_of[index]
                peak_held = max(peak_held, held)
                sched.complete(flight.seq, flight.spans, flight.accs)
                for key, outcome in sched.take_decisions():
                    if outcome != "regenerate":
                        del flights[key]  # regenerate keeps it: its other samples stay
                    if outcome in ("filtered", "dropped"):
                        held -= tokens_of.pop(key)
        if pool.now >= until:
            if state == "training":
                holds.append(pool.update_weights(pool.version + 1, hw.push_s, retract=hw.retract))
                state, until = "pushing", pool.now + hw.push_s  # the trainer sends the push
            else:
                step_ends.append(pool.now)
                busy_at.append(pool.busy_seconds())
                state, until, idle_since = "idle", math.inf, pool.now
                for key, value in sched.take_counts().items():
                    counts[key] = counts.get(key, 0.0) + value
    measured = steps - warmup
    span = step_ends[-1] - step_ends[warmup]
    busy = (busy_at[-1] - busy_at[warmup]) / len(pool.servers)
    total = sum(hist.values())
    return Result(name=f"fully async K={max_staleness} {gen_gpus}+{train_gpus}", gpus=gen_gpus + train_gpus,
                  seconds_per_step=span / measured, responses_per_step=w.batch_groups * w.n_samples,
                  server_idle=1 - busy / span, staleness={d: n / total for d, n in sorted(hist.items())},
                  extra={"hold_s": sum(holds) / len(holds), "trainer_wait_s": trainer_wait / measured,
                         "peak_host_tokens": float(peak_held),
                         "stale_dropped_groups": counts.get("rollout/stale_dropped_groups", 0.0) / steps,
                         "generated_per_kept_token": counts.get("stream/generated_tokens", 0.0)
                         / max(1.0, counts.get("rollout/kept_tokens", 0.0)),
                         "generated_tokens_per_step": counts.get("stream/generated_tokens", 0.0) / steps,
                         "kept_tokens_per_step": counts.get("rollout/kept_tokens", 0.0) / steps})
