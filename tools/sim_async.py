"""GPU-hours per 1,000 trained responses of DAPO at 32B on 128 H100s: synchronous (colocated, as verl's recipe, and
split), one step off, and fully async at K = 1, 2, 4, by discrete-event simulation (megatron_dapo/simulate/).

    .venv/bin/python tools/sim_async.py [--steps 12 --warmup 3] [--keep-rate 0.5] [--mean-length 4500]
    .venv/bin/python tools/sim_async.py --quick       # 1/8 of the batch and of the GPUs: a few seconds

What is real and what is a stand-in: the synchronous schedules run the real `collect_batch` (rounds sized by the
keep rate, decisions in submission order, the abort at the cut) and the fully async one the real
`StreamScheduler` (in-flight target, submission-order decisions, per-token staleness bound); the SGLang servers
and the actor are timed stand-ins (`ServerPool`: continuous batching, iteration time t0 + t1 x running requests;
the trainer: tokens / throughput + overhead).

Inputs (defaults; docs/BENCHMARKS.md, "Fully async at the production setting", gives the sources):
- decode: ML.ENERGY leaderboard, vLLM, Qwen3-32B BF16 on 2 x H100, ~7k-token outputs: inter-token latency
  ~15 + 0.27 x B ms at B concurrent requests (fit to B = 8..64). A TP4 server reads the weights and the KV cache
  over twice the HBM: t0 = 8 ms, t1 = 0.135 ms; at most 160 requests running (2.9x TP2's KV room; TP2 fit 64).
- prefill (the re-prefill after a retract push): not published for 32B; 25,000 tokens/s per TP4 server (65.6
  GFLOP a token at ~40% of 4 x 989 TFLOP/s).
- training: NeMo-RL v0.5's Qwen3-32B one-step-off run on H100 (32 training GPUs, 6.66 M tokens, log-probs and
  update, within its 200 s step): >= 1,040 tokens/s per GPU; 10 s per step more (optimizer, reduction).
- push: verl's delta-weight-sync table, Qwen2.5-32B on H100 with SGLang, full NCCL broadcast, offload off: 14.2 s.
- colocated switch (engine sleep / wake, weights reloaded in place): not published; 30 s a step.
- workload: DAPO (arXiv 2503.14476 Sec. 4.1): 512 prompts x 16 responses a step, at most 20,480 tokens; mean
  length 4,500 (Fig. 7 rises to ~4-5k; not tabulated), log-normal spread 0.6 across prompts and 0.5 within a
  group; prompts 300 tokens; keep rate 0.5 (not published; verl's recipe over-samples 3x, a design point of >= 1/3).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.simulate.schedules import (  # noqa: E402
    Hardware,
    Result,
    Workload,
    fully_async,
    one_step_off,
    sync_colocated,
    sync_split,
    verl_recipe,
)
from megatron_dapo.simulate.servers import ServerModel  # noqa: E402

HOST_BYTES_PER_TOKEN = 12
"""Rank 0's host bytes per token of a finished group waiting to be trained, packed as partial rollout's carried state
is (int32 id, fp32 log-prob, int32 version); Python lists of Samples cost ~6x that."""
H100_TP4 = ServerModel(t0=0.008, t1=0.000135, max_running=160, prefill_tps=25_000.0)


def hardware(args: argparse.Namespace) -> Hardware:
    return Hardware(server=H100_TP4, train_tokens_per_gpu_s=args.train_tps, push_s=args.push_s,
                    switch_s=args.switch_s, retract=not args.in_place)


def run_all(args: argparse.Namespace) -> list[Result]:
    """Every schedule; the split ones at each generation / training split, the fastest kept."""
    scale = 8 if args.quick else 1
    w = Workload(batch_groups=512 // scale, keep_rate=args.keep_rate, mean_length=args.mean_length, seed=args.seed)
    hw = hardware(args)
    gpus = 128 // scale
    step = hw.server_gpus * max(1, 4 // scale)  # 64, 80, 96 generation GPUs of 128 (8, 12 of 16 with --quick)
    splits = [(g, gpus - g) for g in range(gpus // 2, 3 * gpus // 4 + 1, step)]
    common = dict(steps=args.steps, warmup=args.warmup)
    out = [verl_recipe(w, hw, gpus=gpus, **common), sync_colocated(w, hw, gpus=gpus, **common)]

    def best(fn, **kw) -> Result:
        return min((fn(w, hw, gen_gpus=g, train_gpus=t, **common, **kw) for g, t in splits),
                   key=lambda r: r.seconds_per_step)

    out.append(best(sync_split))
    out.append(best(one_step_off))
    slack = None if args.uncapped else args.in_flight_slack
    for k in (1, 2, 4):
        out.append(best(fully_async, max_staleness=k, in_flight_slack=slack))
    return out


def table(results: list[Result]) -> str:
    """One line a schedule; GPU-hours relative to verl's recipe (the first) and to our synchronous colocated run
    (the second); host GB: the peak of finished groups' tokens held on rank 0, packed."""
    verl, ours = results[0].gpu_hours_per_1k, results[1].gpu_hours_per_1k
    lines = [f"{'schedule':<28} {'s/step':>7} {'GPU-h/1k resp':>13} {'vs verl':>8} {'vs sync coloc':>13} "
             f"{'server idle':>11}  staleness (share of tokens at 0, 1, ...)   push hold  host GB"]
    for r in results:
        idle = "-" if r.server_idle is None else f"{r.server_idle:.1%}"
        stale = " ".join(f"{d}:{v:.2f}" for d, v in r.staleness.items())
        hold = f"{r.extra['hold_s']:.0f} s" if "hold_s" in r.extra else ""
        peak = r.extra.get("peak_host_tokens")
        host = "" if peak is None else f"{peak * HOST_BYTES_PER_TOKEN / 1e9:.1f}"
        lines.append(f"{r.name:<28} {r.seconds_per_step:>7.0f} {r.gpu_hours_per_1k:>13.2f} "
                     f"{r.gpu_hours_per_1k / verl:>7.2f}x {r.gpu_hours_per_1k / ours:>12.2f}x {idle:>11}  "
                     f"{stale:<40}   {hold:>9}  {host:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the averages (the pipeline fills)")
    w, hw = Workload(), Hardware(server=H100_TP4)
    parser.add_argument("--keep-rate", type=float, default=w.keep_rate)
    parser.add_argument("--mean-length", type=float, default=w.mean_length)
    parser.add_argument("--train-tps", type=float, default=hw.train_tokens_per_gpu_s,
                        help="actor tokens per GPU-second")
    parser.add_argument("--push-s", type=float, default=hw.push_s)
    parser.add_argument("--switch-s", type=float, default=hw.switch_s)
    parser.add_argument("--in-place", action="store_true", help="pushes pause in_place (no re-prefill)")
    parser.add_argument("--in-flight-slack", type=float, default=1.25,
                        help="fully async: groups in flight at most this x the servers' capacity")
    parser.add_argument("--uncapped", action="store_true",
                        help="fully async: no cap on groups in flight (K x B / keep rate alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1/8 of the batch and of the GPUs")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    t0 = time.perf_counter()
    try:
        results = run_all(args)
    except ValueError as err:  # a workload or hardware figure out of range: name it
        parser.error(str(err))
    print(table(results))
    k2 = results[5]  # fully async K=2: its generated tokens (kept, filtered and dropped groups) per step
    trained = k2.extra["kept_tokens_per_step"] + k2.responses_per_step * Workload().prompt_tokens
    bound = hardware(args).work_bound_s(k2.extra["generated_tokens_per_step"], trained, k2.gpus)
    print(f"work bound (every GPU busy, K=2's generated tokens, {trained / 1e6:.0f} M trained): {bound:.0f} s/step, "
          f"{k2.gpus * bound / 3600 / (k2.responses_per_step / 1000):.2f} GPU-h/1k responses, "
          f"{k2.gpus * bound / 3600 / (k2.responses_per_step / 1000) / results[0].gpu_hours_per_1k:.2f}x verl's "
          f"recipe")
    for r in results:
        extra = {k: round(v, 2) for k, v in r.extra.items()}
        print(f"  {r.name}: {extra}")
    print(f"inputs: {dataclasses.asdict(hardware(args))}, keep rate {args.keep_rate}, mean length "
          f"{args.mean_length:.0f}; simulated in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
