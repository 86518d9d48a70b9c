"""Dynamic sampling, the loop before and after issue 10 (items 3 and 4), side by side on a simulated engine
whose latency grows with response length (tests/sim_engine.py: a group finishes when its longest response
does, so groups holding a truncated response finish last).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_dynamic_sampling.py [--steps 40 --batch 512 --n 16]

old: groups decided in completion order, each round asks ceil(over-sample x groups still needed).
new: megatron_dapo.rollout.collect.collect_batch: decided in submission order, rounds sized by the keep rate
     measured so far in the step (BatchFiller.round_size).

Table 1 (bias): keep rate 0.9, over-sample 1.3; the share of groups holding a truncated response among all
requested groups (as the engine drew them, aborted or not), the finished ones, the eligible (informative)
ones, and the kept ones. Unbiased: kept == eligible.
Table 2 (budget): rounds per step at keep rates 0.1-0.9 with --max-num-gen-batches 10; steps that ran out
of rounds (GenerationBudgetExhausted under --on-gen-exhausted error) and finished groups per kept group.
time/step: simulated generation time per step in units of one max-length response (all requests of a
round start together; a round lasts until the last group it used finishes).
Takes about 4 minutes at the defaults on one CPU core.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.algorithm import (  # noqa: E402
    BatchFiller,
    DynamicSamplingConfig,
    GenerationBudgetExhausted,
    OverlongConfig,
)
from megatron_dapo.rollout.collect import CollectConfig, collect_batch, score_group, seeded  # noqa: E402
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams  # noqa: E402
from tests.sim_engine import LengthLatencyEngine, cycling, decode, prompts, reward  # noqa: E402

MAX_LEN = 32


def legacy_collect(engine, next_prompts, config: CollectConfig, *, step: int) -> tuple[list[str], int]:
    """The loop as it was: completion order, rounds of ceil(factor x needed). -> (kept request ids, rounds)."""
    filler = BatchFiller(config.dynamic_sampling)
    while not filler.full and filler.start_round():
        want = math.ceil(config.over_sample_factor * filler.needed)
        tag = f"s{step}-r{filler.stats.rounds}"
        batch = {f"{tag}-{i}-p{p.index}": p for i, p in enumerate(next_prompts(want))}
        requests = [RolloutRequest(prompt_ids=p.prompt_ids, n=config.n_samples_per_prompt, request_id=rid,
                                   sampling=seeded(config.sampling, config.seed, rid)) for rid, p in batch.items()]
        for samples in engine.stream(requests):
            if any(s.finish_reason == "abort" for s in samples):
                continue
            group = score_group(batch[samples[0].request_id], samples, decode, reward, config.overlong)
            filler.offer(group, group.accs)
            if filler.full:
                engine.abort()
    return [g.samples[0].request_id for g in filler.batch()], filler.stats.rounds


def new_collect(engine, next_prompts, config: CollectConfig, *, step: int) -> tuple[list[str], int]:
    result = collect_batch(engine, next_prompts, decode, reward, config, step=step)
    return [g.samples[0].request_id for g in result.groups], int(result.metrics["dynamic_sampling/rounds"])


def run(policy, *, keep_rate: float, truncate_prob: float, args) -> dict[str, float]:
    """`args.steps` steps of one policy; truncated shares, rounds and generated/kept."""
    config = CollectConfig(
        n_samples_per_prompt=args.n, sampling=SamplingParams(max_new_tokens=MAX_LEN),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=args.batch,
                                               max_num_gen_batches=args.max_num_gen_batches),
        overlong=OverlongConfig(max_response_length=MAX_LEN, buffer_length=MAX_LEN // 4),
        over_sample_factor=args.over_sample_factor, seed=args.seed)
    engine = LengthLatencyEngine(keep_rate=keep_rate, truncate_prob=truncate_prob, seed=args.seed)
    next_prompts = cycling(prompts(17_000))
    kept, rounds, exhausted = [], [], 0
    for step in range(1, args.steps + 1):
        try:
            ids, n_rounds = policy(engine, next_prompts, config, step=step)
        except GenerationBudgetExhausted:
            exhausted += 1
            rounds.append(args.max_num_gen_batches)
            continue
        kept += ids
        rounds.append(n_rounds)
    records = engine.records
    finished = [r for r in records.values() if r.streamed]
    eligible = [r for r in records.values() if r.informative]

    def share(rs) -> float:
        return sum(r.truncated for r in rs) / len(rs) if rs else float("nan")

    return {"requested": share(list(records.values())), "finished": share(finished), "eligible": share(eligible),
            "kept": share([records[k] for k in kept]), "rounds_mean": statistics.fmean(rounds),
            "rounds_max": max(rounds), "exhausted": exhausted, "time_per_step": engine.busy_time / args.steps,
            "finished_per_kept": len(finished) / len(kept) if kept else float("nan")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=512, help="--rollout-batch-size")
    ap.add_argument("--n", type=int, default=16, help="--n-samples-per-prompt")
    ap.add_argument("--over-sample-factor", type=float, default=1.3)
    ap.add_argument("--max-num-gen-batches", type=int, default=10)
    ap.add_argument("--truncate-prob", type=float, default=0.02,
                    help="per response; 0.02 at G=16 puts a truncated response in 27.6%% of groups")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    policies = {"old": legacy_collect, "new": new_collect}

    print(f"1. truncated-group share, keep rate 0.9, over-sample {args.over_sample_factor}, batch {args.batch}, "
          f"G={args.n}, {args.steps} steps")
    print(f"{'policy':8s}{'requested':>10s}{'finished':>10s}{'eligible':>10s}{'kept':>8s}{'kept/eligible':>15s}"
          f"{'time/step':>11s}")
    for name, policy in policies.items():
        r = run(policy, keep_rate=0.9, truncate_prob=args.truncate_prob, args=args)
        print(f"{name:8s}{r['requested']:10.3f}{r['finished']:10.3f}{r['eligible']:10.3f}{r['kept']:8.3f}"
              f"{r['kept'] / r['eligible']:15.2f}{r['time_per_step']:11.2f}")

    print(f"\n2. rounds per step, --max-num-gen-batches {args.max_num_gen_batches}, over-sample "
          f"{args.over_sample_factor}, batch {args.batch}, {args.steps} steps")
    print(f"{'keep':>5s}  {'policy':6s}{'rounds mean':>12s}{'max':>5s}{'exhausted':>11s}{'finished/kept':>15s}"
          f"{'time/step':>11s}")
    for keep in (0.1, 0.3, 0.5, 0.7, 0.9):
        for name, policy in policies.items():
            r = run(policy, keep_rate=keep, truncate_prob=args.truncate_prob, args=args)
            print(f"{keep:5.1f}  {name:6s}{r['rounds_mean']:12.2f}{r['rounds_max']:5d}"
                  f"{r['exhausted']:>7d}/{args.steps:<3d}{r['finished_per_kept']:15.2f}{r['time_per_step']:11.2f}")


if __name__ == "__main__":
    main()
