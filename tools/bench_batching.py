"""Micro-batch planning on a realistic DAPO length distribution: the old planner (strided mb[rank::dp]
split, every micro-batch built up front with a dense mask) side by side with the new one (token-cost
DP partition, equal micro-batch counts, lazy building, no mask on TransformerEngine) and the packed one
(the same partition, rows packed into [1, T] micro-batches under the budget in real tokens:
--pack-sequences).

    .venv/bin/python tools/bench_batching.py [--dp 4 --seed 0 --truncated 0.04 0.10 0.25]

Lengths: prompts lognormal (median 180 tokens, at most --max-prompt-length); responses lognormal with
sigma 1, its median chosen so that --truncated of them hit --max-response-length (DAPO's 32B runs see
4-25%). One step = --rollout-batch-size x --n-samples-per-prompt responses in mini-batches of
--global-batch-size; each mini-batch is split over --dp ranks and planned under --max-tokens-per-micro-batch.

Printed per truncation rate, old vs new vs packed:
  waste      padded tokens that are not real tokens / padded tokens (goal <= 2%; packed: only the pad of
             each [1, T] row to a multiple of --tp, which sequence parallelism needs);
  imbalance  slowest DP rank / mean, in compute cost L (1 + c L) per padded row (packed: per real row, as
             THD attention runs row by row, plus the pad tokens) (c: attention term of Qwen2.5-32B), mean
             and worst over the step's mini-batches (goal <= 1.03);
  spread     max - min micro-batches per DP rank in a mini-batch, worst over the step (goal 0);
  host MiB   a DP rank's host bytes for the old-log-prob pass over its whole step: old = every
             micro-batch's tensors + [1, 1, s, s] bool mask at once; new = the largest single micro-batch;
             packed = the largest [1, T] row plus its [n, L] loss-side tensors and unpack index.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.actor.batching import (  # noqa: E402
    attention_cost_coefficient,
    packed_length,
    partition_for_dp,
    plan_micro_batches,
)

QWEN_32B = dict(hidden_size=5120, ffn_hidden_size=27648, num_heads=40, num_kv_heads=8, head_dim=128)
TENSOR_BYTES_PER_TOKEN = 5 * 8 + 4  # tokens, positions, targets, old log-probs (fp32 as 4), masks; ~ int64 x5
PACKED_ROW_BYTES = 3 * 8  # packed [1, T]: tokens, positions, targets (int64)
LOSS_SIDE_BYTES = 1 + 4 + 4 + 8  # packed [n, L]: response mask, loss mask, old log-probs, unpack index


def sample_lengths(n: int, *, truncated: float, max_response: int, max_prompt: int, seed: int) -> list[int]:
    """Prompt + response lengths: lognormal bodies, a `truncated` fraction at max_response."""
    rng = random.Random(seed)
    sigma = 1.0
    mu = math.log(max_response) - sigma * statistics.NormalDist().inv_cdf(1 - truncated)
    out = []
    for _ in range(n):
        prompt = min(max_prompt, max(16, int(rng.lognormvariate(math.log(180), 0.6))))
        response = min(max_response, max(1, int(rng.lognormvariate(mu, sigma))))
        out.append(prompt + response)
    return out


def cost(lengths: Sequence[int], groups: Sequence[Sequence[int]], coef: float) -> float:
    return sum(len(g) * max(lengths[i] for i in g) * (1 + coef * max(lengths[i] for i in g)) for g in groups)


def padded(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def packed_cost(lengths: Sequence[int], groups: Sequence[Sequence[int]], coef: float, tp: int) -> float:
    """THD attention is per row: sum of L (1 + c L) over real rows, plus the pad tokens (GEMM cost only)."""
    return sum(sum(lengths[i] * (1 + coef * lengths[i]) for i in g)
               + packed_length([lengths[i] for i in g], tp) - sum(lengths[i] for i in g) for g in groups)


def packed_tokens(lengths: Sequence[int], groups: Sequence[Sequence[int]], tp: int) -> int:
    return sum(packed_length([lengths[i] for i in g], tp) for g in groups)


def old_plan(lengths: list[int], dp: int, budget: int) -> list[list[list[int]]]:
    """Per rank: strided rows, greedy micro-batches (indices into `lengths`)."""
    plans = []
    for r in range(dp):
        rows = list(range(r, len(lengths), dp))
        groups = plan_micro_batches([lengths[i] for i in rows], max_tokens=budget, micro_batch_size=1)
        plans.append([[rows[j] for j in g] for g in groups])
    return plans


def new_plan(lengths: list[int], dp: int, budget: int, coef: float) -> list[list[list[int]]]:
    """Per rank: token-cost partition, greedy micro-batches, then every rank at the largest count."""
    parts = partition_for_dp(lengths, dp, attn_coef=coef)
    local = [[lengths[i] for i in p] for p in parts]
    count = max(len(plan_micro_batches(x, max_tokens=budget, micro_batch_size=1)) for x in local)
    return [[[p[j] for j in g] for g in plan_micro_batches(x, max_tokens=budget, micro_batch_size=1,
                                                           num_micro_batches=count)]
            for p, x in zip(parts, local, strict=True)]


def packed_plan(lengths: list[int], dp: int, budget: int, coef: float) -> list[list[list[int]]]:
    """Per rank: token-cost partition, first-fit-decreasing packed micro-batches, equal counts."""
    parts = partition_for_dp(lengths, dp, attn_coef=coef)
    local = [[lengths[i] for i in p] for p in parts]
    plan = dict(max_tokens=budget, micro_batch_size=1, packed=True)
    count = max(len(plan_micro_batches(x, **plan)) for x in local)
    return [[[p[j] for j in g] for g in plan_micro_batches(x, **plan, num_micro_batches=count)]
            for p, x in zip(parts, local, strict=True)]


def packed_host_bytes(lengths: Sequence[int], groups: Sequence[Sequence[int]], tp: int) -> float:
    return max(packed_length([lengths[i] for i in g], tp) * PACKED_ROW_BYTES
               + len(g) * max(lengths[i] for i in g) * LOSS_SIDE_BYTES for g in groups)


def host_bytes(lengths: Sequence[int], groups: Sequence[Sequence[int]], *, mask: bool, at_once: bool) -> float:
    per = [len(g) * max(lengths[i] for i in g) * TENSOR_BYTES_PER_TOKEN
           + (max(lengths[i] for i in g) ** 2 if mask else 0) for g in groups]
    return sum(per) if at_once else max(per)


def evaluate(lengths: list[int], args: argparse.Namespace, coef: float, planner: str) -> dict[str, float]:
    gbs = args.global_batch_size
    waste_pad = waste_real = 0
    imbalance, spread = [], []
    rank_groups: list[list[list[int]]] = [[] for _ in range(args.dp)]  # the step's groups per rank
    for start in range(0, len(lengths), gbs):
        mb = lengths[start:start + gbs]
        if planner == "packed":
            plans = packed_plan(mb, args.dp, args.budget, coef)
            loads = [packed_cost(mb, groups, coef, args.tp) for groups in plans]
        else:
            plans = old_plan(mb, args.dp, args.budget) if planner == "old" else new_plan(mb, args.dp, args.budget,
                                                                                          coef)
            loads = [cost(mb, groups, coef) for groups in plans]
        imbalance.append(max(loads) / (sum(loads) / len(loads)))
        counts = [len(groups) for groups in plans]
        spread.append(max(counts) - min(counts))
        for r, groups in enumerate(plans):
            waste_pad += packed_tokens(mb, groups, args.tp) if planner == "packed" else padded(mb, groups)
            rank_groups[r] += [[start + i for i in g] for g in groups]
        waste_real += sum(mb)
    if planner == "packed":
        host = max(packed_host_bytes(lengths, g, args.tp) for g in rank_groups)
    else:
        host = max(host_bytes(lengths, g, mask=planner == "old", at_once=planner == "old") for g in rank_groups)
    return {"waste": 1 - waste_real / waste_pad, "imbalance_mean": statistics.mean(imbalance),
            "imbalance_max": max(imbalance), "spread": max(spread),
            "micro_batches": statistics.mean(len(g) for g in rank_groups), "host_mib": host / 2**20}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--tp", type=int, default=8, help="packed rows are padded to a multiple of this (SP)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truncated", type=float, nargs="+", default=[0.04, 0.10, 0.25])
    p.add_argument("--rollout-batch-size", type=int, default=512)
    p.add_argument("--n-samples-per-prompt", type=int, default=16)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--max-tokens-per-micro-batch", dest="budget", type=int, default=24576)
    p.add_argument("--max-response-length", type=int, default=20480)
    p.add_argument("--max-prompt-length", type=int, default=2048)
    args = p.parse_args(argv)
    coef = attention_cost_coefficient(**QWEN_32B)
    n = args.rollout_batch_size * args.n_samples_per_prompt
    print(f"{n} responses per step, mini-batches of {args.global_batch_size}, DP {args.dp}, budget "
          f"{args.budget} tokens; cost per row L (1 + {coef:.3g} L)")
    print(f"{'truncated':>9} {'planner':>7} {'waste':>7} {'imbal mean':>10} {'imbal max':>9} {'spread':>6} "
          f"{'mb/rank':>8} {'host MiB':>10}")
    for frac in args.truncated:
        lengths = sample_lengths(n, truncated=frac, max_response=args.max_response_length,
                                 max_prompt=args.max_prompt_length, seed=args.seed)
        rows = {name: evaluate(lengths, args, coef, name) for name in ("old", "new", "packed")}
        for name, r in rows.items():
            print(f"{frac:>9.0%} {name:>7} {r['waste']:>7.2%} {r['imbalance_mean']:>10.4f} "
                  f"{r['imbalance_max']:>9.4f} {r['spread']:>6d} {r['micro_batches']:>8.1f} "
                  f"{r['host_mib']:>10.1f}")
        old, new = rows["old"], rows["new"]
        print(f"{'':>9} {'new/old':>7} {new['waste'] / old['waste']:>7.2f} "
              f"{(new['imbalance_max'] - 1) / max(old['imbalance_max'] - 1, 1e-12):>10.2f}x excess "
              f"{'':>9} {'':>6} {'':>8} {new['host_mib'] / old['host_mib']:>10.2e}")
        pk = rows["packed"]
        print(f"{'':>9} {'pk/new':>7} {pk['waste'] / new['waste']:>7.3f} "
              f"{(pk['imbalance_max'] - 1) / max(new['imbalance_max'] - 1, 1e-12):>10.2f}x excess "
              f"{'':>9} {'':>6} {pk['micro_batches'] / new['micro_batches']:>8.2f} "
              f"{pk['host_mib'] / new['host_mib']:>10.2f}")


if __name__ == "__main__":
    main()
