"""One step's rollout of multi-turn tool-use conversations at the production setting, by discrete-event simulation
(megatron_dapo/simulate/servers.py): single-turn, rounds (rollout/multi_turn.py today) and per-conversation
continuation, each with the resubmitted context's prefix cached (hit) or re-prefilled (miss).

    .venv/bin/python tools/sim_multi_turn.py [--tool-s 0.2 --calls 3 --workers 128 --seed 0]
    .venv/bin/python tools/sim_multi_turn.py --quick      # 1/8 of the batch and of the servers: a few seconds

The full step takes ~25 s of one core: 5 schedules, each with its tool-free twin, and the continuous worker search.
docs/BENCHMARKS.md, "Multi-turn rollouts (simulated)", gives the numbers and what they mean for the round scheduler.

The schedules (one step, 512 prompts x 16 = 8,192 conversations, no dynamic sampling):
- single: each response one request of its whole length, no tools (the baseline).
- rounds: rollout/multi_turn.py's `_rounds`: every conversation waiting for the model is submitted at once; when the
  round's last turn ends, the round's calls run in the tool pool together (`run_many`), then the next round starts.
  A conversation whose tool is done waits for the slowest turn of its round.
- continuous: each conversation's next turn is submitted the moment its call returns (`OpenStream.add`); calls
  queue on the pool as their turns end.

The workload: response lengths as `Workload.draw` (log-normal, mean 4,500, at most 20,480; the same draw in every
schedule); each response's generated tokens split into --calls + 1 turns at uniform random cut points (seeded per
conversation; a response shorter than that has fewer calls); each call appends --tool-tokens tokens to the context
(not generated: they do not count in the response's drawn length) and takes --tool-s seconds on one of --workers
workers (FIFO, one core each).

What is modelled: continuous batching per server (t0 + t1 x running requests an iteration, at most 160 running,
the rest FIFO; tools/sim_async.py's H100 TP4 figures); a conversation stays on the server its first turn went to
(a cache-aware router: its prefix is there); a cache miss re-prefills the whole context (prompt + every turn and tool
output so far) when the turn is admitted, holding that server prefill / 25,000 tokens/s while every request on it
waits (SGLang prefills a new batch between decode iterations; chunked prefill would mix the two, which this does not
model); a hit prefills nothing (the ~50 new tool tokens are not timed, nor is any prompt's first prefill).
What is not: KV capacity in tokens (a hit assumes the radix cache still holds the prefix of a conversation that
waits for its tool or in the queue; a TP4 server at 32B holds ~0.8 M tokens, against 512 conversations a server of
up to 20k tokens each, so the truth lies between the hit and miss rows, nearer hit the sooner a turn is resumed),
the per-request iteration cost growing with context, SGLang's longest-prefix-first scheduling (a continued turn
queues behind fresh ones here), tool latency spread, a call's failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.simulate.schedules import Workload  # noqa: E402
from megatron_dapo.simulate.servers import ServerModel, ServerPool  # noqa: E402

H100_TP4 = ServerModel(t0=0.008, t1=0.000135, max_running=160, prefill_tps=25_000.0)
"""tools/sim_async.py's server: Qwen-32B on 4 x H100 (its docstring gives the sources)."""
SERVERS = 16
"""sim_async.py's synchronous split run at its best split: 64 generation GPUs of 128 (docs/BENCHMARKS.md)."""
GPUS_PER_NODE = 8
CORES_PER_NODE = 16
SCHEDULES = ("single", "rounds", "continuous")


@dataclass(frozen=True, kw_only=True)
class Tools:
    """The tool calls' shape and cost."""

    calls: int = 3
    """Calls per conversation (--calls): --calls + 1 turns."""
    tool_tokens: int = 50
    """Tokens a call's output appends to the context (--tool-tokens)."""
    tool_s: float = 0.2
    """Seconds one call runs on one worker (--tool-s)."""
    workers: int = CORES_PER_NODE * SERVERS * 4 // GPUS_PER_NODE
    """Calls run at once, over every rollout node (--workers)."""

    def __post_init__(self) -> None:
        if self.calls < 0 or self.tool_tokens < 0 or self.tool_s < 0 or self.workers < 1:
            raise ValueError(f"Tools needs --calls, --tool-tokens, --tool-s >= 0 and --workers >= 1, got "
                             f"{self.calls}, {self.tool_tokens}, {self.tool_s}, {self.workers}")


def split_turns(workload: Workload, calls: int, seed: int) -> list[list[int]]:
    """Each conversation's turn lengths (generated tokens), group by group; each list sums to the drawn length."""
    out = []
    for g in range(workload.batch_groups):
        lengths, _ = workload.draw(g)
        for i, total in enumerate(lengths):
            rng = random.Random(seed * 1_000_003 + g * 101 + i)
            cuts = sorted(rng.sample(range(1, total), min(calls, total - 1)))
            out.append([b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)])
    return out


@dataclass
class Outcome:
    """One simulated step."""

    seconds: float
    generated: int
    """Tokens generated (must equal the drawn lengths' sum)."""
    calls: int
    peak_calls: int
    """Most calls running at once."""
    prefill_tokens: int
    """Tokens re-prefilled on cache misses."""
    round_calls: list[int] = field(default_factory=list)
    """rounds: the calls of each round (they run together)."""
    conv_done: list[float] = field(default_factory=list)
    """Each conversation's end time."""


def _peak(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, e in intervals if e > s] + [(e, -1) for s, e in intervals if e > s])
    peak = now = 0
    for _, d in events:  # ends sort before starts at the same time (-1 < 1)
        now += d
        peak = max(peak, now)
    return peak


def simulate(turns: list[list[int]], schedule: str, tools: Tools, *, model: ServerModel = H100_TP4,
             servers: int = SERVERS, cache_hit: bool = True, prompt_tokens: int = 300) -> Outcome:
    """One step's rollout of `turns` (each conversation's turn lengths) under `schedule`, from an idle pool at 0.

    Cost at the production setting: 8,192 conversations x 4 turns, ~33k completions and ~25k tool events, each a
    pass over the 16 servers: a few seconds of one core."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    pool = ServerPool(model, servers)
    n = len(turns)
    done_at = [0.0] * n
    if schedule == "single":
        for c, ts in enumerate(turns):
            pool.submit([(sum(ts), prompt_tokens, c)])
        while (t := pool.next_event()) < math.inf:
            for req in pool.advance(t):
                done_at[req.tag] = req.done_at
        return Outcome(pool.now, pool.generated_tokens, 0, 0, 0, conv_done=done_at)

    home = [-1] * n  # the server each conversation's first turn went to
    context = [prompt_tokens] * n  # tokens before its next turn
    prefilled = 0

    def submit(c: int, k: int) -> None:
        nonlocal prefilled
        miss = context[c] if k and not cache_hit else 0
        prefilled += miss
        (req,) = pool.submit([(turns[c][k], prompt_tokens, (c, k))], server=None if k == 0 else home[c],
                             prefill=miss)
        home[c] = req.server

    def end_turn(c: int, k: int) -> bool:
        """True if a call follows."""
        context[c] += turns[c][k]
        if k + 1 < len(turns[c]):
            context[c] += tools.tool_tokens
            return True
        done_at[c] = pool.now
        return False

    free = [0.0] * tools.workers  # each worker's free time: a heap (FIFO, equal durations)
    intervals: list[tuple[float, float]] = []

    def run_call(at: float) -> float:
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + tools.tool_s)
        intervals.append((start, start + tools.tool_s))
        return start + tools.tool_s

    round_calls: list[int] = []
    if schedule == "rounds":
        waiting = list(range(n))
        k = 0
        while waiting:
            for c in waiting:
                submit(c, k)
            calling = []
            while (t := pool.next_event()) < math.inf:
                for req in pool.advance(t):
                    c, _ = req.tag
                    if end_turn(c, k):
                        calling.append(c)
            # the round's calls run at once, all arriving at the round's end (run_many)
            end = max((run_call(pool.now) for _ in calling), default=pool.now)
            round_calls.append(len(calling))
            pool.advance(end)
            waiting, k = sorted(calling), k + 1
    else:
        for c in range(n):
            submit(c, 0)
        returning: list[tuple[float, int, int]] = []  # (time the call returns, conversation, next turn)
        while True:
            t = min(pool.next_event(), returning[0][0] if returning else math.inf)
            if t == math.inf:
                break
            for req in pool.advance(t):
                c, k = req.tag
                if end_turn(c, k):
                    heapq.heappush(returning, (run_call(req.done_at), c, k + 1))
            while returning and returning[0][0] <= pool.now:
                _, c, k = heapq.heappop(returning)
                submit(c, k)
    return Outcome(max(done_at), pool.generated_tokens, len(intervals), _peak(intervals), prefilled,
                   round_calls=round_calls, conv_done=done_at)


def rounds_tool_s(round_calls: list[int], workers: int, tool_s: float) -> float:
    """The rounds schedule's seconds in tools: each round's calls run together after its last turn, in
    ceil(calls / workers) waves, and nothing generates meanwhile. Generation's own time does not depend on it (each
    round starts from idle servers), so a step takes generation + this, exactly."""
    return sum(math.ceil(m / workers) * tool_s for m in round_calls)


def rounds_workers_needed(round_calls: list[int], gen_s: float, tool_s: float, share: float) -> int | None:
    """Fewest workers that keep the rounds schedule's tool time at most `share` of its step (None: not even one
    worker per call does, the rounds' latency alone exceeds it): tool <= share x (gen + tool)."""
    limit = share / (1 - share) * gen_s
    most = max(round_calls, default=0)
    if rounds_tool_s(round_calls, max(most, 1), tool_s) > limit:
        return None
    low, high = 1, max(most, 1)  # the smallest w with rounds_tool_s(w) <= limit: it falls as w grows
    while low < high:
        mid = (low + high) // 2
        if rounds_tool_s(round_calls, mid, tool_s) <= limit:
            high = mid
        else:
            low = mid + 1
    return low


def continuous_workers_needed(turns: list[list[int]], tools: Tools, gen_s: float, share: float, *,
                              model: ServerModel = H100_TP4, servers: int, cache_hit: bool,
                              prompt_tokens: int = 300) -> int | None:
    """Fewest workers that keep the continuous schedule's step within `share` of it above `gen_s` (the same with
    tools taking no time): (step - gen) <= share x step. Tools overlap generation here, so only their latency on a
    conversation's path and their queueing count; searched (doubling, then bisection), one simulation a try. None:
    not even one worker per call does (the calls' latency on the longest conversations alone exceeds it)."""
    def ok(w: int) -> bool:
        t = simulate(turns, "continuous", dataclasses.replace(tools, workers=w), model=model, servers=servers,
                     cache_hit=cache_hit, prompt_tokens=prompt_tokens).seconds
        return t - gen_s <= share * t

    if not ok(max(1, sum(len(t) - 1 for t in turns))):
        return None
    low, high = 1, 1
    while not ok(high):
        low, high = high + 1, high * 2
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


@dataclass
class Row:
    name: str
    outcome: Outcome
    gen_s: float
    """The same schedule with tools taking no time."""
    need_workers: int | None


def run_all(args: argparse.Namespace) -> tuple[list[Row], int, int, int]:
    """Every schedule at both prefill assumptions, each also with tools taking no time; (rows, servers, nodes,
    workers)."""
    scale = 8 if args.quick else 1
    workload = Workload(batch_groups=512 // scale, mean_length=args.mean_length, seed=args.seed)
    servers = SERVERS // scale if args.servers is None else args.servers
    nodes = math.ceil(servers * 4 / GPUS_PER_NODE)
    tools = Tools(calls=args.calls, tool_tokens=args.tool_tokens, tool_s=args.tool_s,
                  workers=CORES_PER_NODE * nodes if args.workers is None else args.workers)
    turns = split_turns(workload, tools.calls, args.seed)
    kw = dict(servers=servers, prompt_tokens=workload.prompt_tokens)
    rows = [Row("single-turn (no tools)", simulate(turns, "single", tools, **kw), 0.0, None)]
    rows[0].gen_s = rows[0].outcome.seconds
    no_tool = dataclasses.replace(tools, tool_s=0.0)
    for schedule in ("rounds", "continuous"):
        for hit in (True, False):
            out = simulate(turns, schedule, tools, cache_hit=hit, **kw)
            gen = simulate(turns, schedule, no_tool, cache_hit=hit, **kw).seconds
            if schedule == "rounds":
                need = rounds_workers_needed(out.round_calls, gen, tools.tool_s, args.tool_share)
            else:
                need = continuous_workers_needed(turns, tools, gen, args.tool_share, cache_hit=hit, **kw)
            rows.append(Row(f"{schedule}, cache {'hit' if hit else 'miss'}", out, gen, need))
    total = sum(map(sum, turns))
    for r in rows:
        if r.outcome.generated != total:
            raise AssertionError(f"{r.name}: {r.outcome.generated} tokens generated, {total} drawn")
    return rows, servers, nodes, tools.workers


def table(rows: list[Row], nodes: int, tool_s: float, share: float) -> str:
    """One line a schedule: seconds a step and its ratio to single-turn; what tools add (the step minus the same
    schedule with tools taking no time); calls a step, the most running at once, their CPU-seconds (one core a
    call); tokens re-prefilled; the cores per rollout node (workers / nodes, rounded up) that keep what tools add
    within `share` of the step (rounds: exact, from each round's calls; continuous: searched by simulation)."""
    base = rows[0].outcome.seconds
    lines = [f"{'schedule':<24} {'s/step':>7} {'vs single':>9} {'tools add':>9} {'calls':>6} {'peak calls':>10} "
             f"{'tool CPU-s':>10} {'prefill M tok':>13} {f'cores/node for tools <= {share:.0%}':>28}"]
    for r in rows:
        o = r.outcome
        need = "-" if r.name.startswith("single") else (
            "unreachable" if r.need_workers is None else f"{math.ceil(r.need_workers / nodes)}")
        lines.append(f"{r.name:<24} {o.seconds:>7.0f} {o.seconds / base:>8.2f}x {o.seconds - r.gen_s:>8.1f}s "
                     f"{o.calls:>6} {o.peak_calls:>10} {o.calls * tool_s:>10.0f} {o.prefill_tokens / 1e6:>13.1f} "
                     f"{need:>28}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool-s", type=float, default=Tools.tool_s, help="seconds a call runs on one worker")
    parser.add_argument("--calls", type=int, default=Tools.calls, help="tool calls per conversation")
    parser.add_argument("--tool-tokens", type=int, default=Tools.tool_tokens, help="tokens a call's output appends")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"calls run at once over all rollout nodes (default: {CORES_PER_NODE} a node of "
                             f"{GPUS_PER_NODE} GPUs)")
    parser.add_argument("--servers", type=int, default=None,
                        help=f"TP4 SGLang servers (default: {SERVERS}, {SERVERS // 8} with --quick)")
    parser.add_argument("--mean-length", type=float, default=Workload.mean_length)
    parser.add_argument("--tool-share", type=float, default=0.05,
                        help="the share of the step tools may add, for the cores-per-node column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1/8 of the batch and of the servers")
    args = parser.parse_args(argv)
    if not 0 < args.tool_share < 1:
        parser.error(f"--tool-share must be in (0, 1), got {args.tool_share}")
    if args.servers is not None and args.servers < 1:
        parser.error(f"--servers must be >= 1, got {args.servers}")
    t0 = time.perf_counter()
    try:
        rows, servers, nodes, workers = run_all(args)
    except ValueError as err:
        parser.error(str(err))
    print(table(rows, nodes, args.tool_s, args.tool_share))
    print(f"{len(rows[0].outcome.conv_done)} conversations, {servers} TP4 servers on {nodes} nodes, {workers} tool "
          f"workers, {args.calls} calls of {args.tool_s} s and {args.tool_tokens} tokens; simulated in "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
