"""Synchronous, one-step-off-policy (--async-rollout 1) and fully async (--max-staleness K) training on the
`make demo` task, side by side.

Both runs use the demo's flags (examples/run_embedded_demo.sh: tiny Qwen2 on two-digit sums, embedded engine,
DAPO, held-out avg@4 every --eval-interval steps) and the same seed; they run one after the other, so each
has the machine to itself. Printed per run: wall time (process start to exit), steps, held-out avg@4 at the
end, the first step (and the training time up to it) where avg@4 >= --target, and the rank-0 time split
(generation, training, time training waited for its batch, generation overlapped with training); then the
sync / async wall-time ratio. Two more lines read a loaded machine: the CPU seconds each run used (the
overlap changes when work runs, not how much), and each run's loop time had every step's generation and
training fully overlapped (sum of step time - min(gen, train)): for the synchronous run, what
--async-rollout 1 would give with a free core for each.

On CPU the async run puts the embedded engine in its own process (megatron_dapo/rollout/process_engine.py),
so generation and training need a core each: with fewer free cores than that the overlap cannot show.

What it buys at the production setting (Qwen2.5-32B DAPO, issue 15's paper figures): with the actor on 64
GPUs and SGLang on 64 others a step takes ~57 min, generation and training in turn (each pool idle while
the other works), against ~40 min colocated on all 128. One step off-policy keeps the split pools and
overlaps them: a step costs max(gen, train) + weight push instead of gen + train. The issue gives only the
total; any split puts max(gen, train) between 28.5 and 57 min, and generation is the larger share with
DAPO's 20k-token responses: at gen 40 + train 17 min a step drops to ~40 min (~1.4x), the colocated figure
without colocation's phase switches. The price: batches one update old (TIS corrects it, on by default).

Learning rate: both runs use --lr (default 2.5e-4, half the demo's 5e-4). At the demo's 5e-4 the tiny
policy moves so far per update (rollout-vs-actor KL k3 up to 0.1 per token) that training on batches one
update old oscillates: measured here (60 steps, seed 1234) held-out avg@4 at steps 10 / 20 / 30 / 40 / 50 / 60
was 0.64 / 0.72 / 0.66 / 0.55 / 0.52 / 0.89 with --async-rollout 1, against 0.70 / 0.94 / 0.91 / 0.96 / 0.98 /
0.98 synchronous; at 2.5e-4 the async run climbs steadily (0.59 / 0.87 / 0.96 / 0.97 / 0.97 / 0.98). One step
off-policy suits small per-step policy changes, as in DAPO's own setting (lr 1e-6).

Fully async arms (--max-staleness K, rollout/streaming.py): the demo's flags without --max-num-gen-batches and
--on-gen-exhausted (no rounds to count); the embedded engine runs in its own process as with --async-rollout 1.
Extra rows: response tokens generated, the share of trained tokens at staleness 0 / 1 / >= 2 (mean over steps)
and the stale groups dropped.

usage: python tools/bench_async.py [--steps 60] [--arms sync,async,k1,k2,k4] [--task demo|remainder]
                                   [--engine embedded|sglang] [--base-dir DIR] [--out runs/bench_async]

--task remainder runs tools/ablation.py's DAPO arm instead (data/remainder-base, responses of up to 160 tokens whose
lengths spread from ~20 to the cap: the long tail a synchronous step waits for); --engine sglang has the trainer
launch a CPU SGLang server (.venv-sglang) for the rollouts. The last row, the engine's idle share of the loop time,
is read from each run's metrics: synchronous, the time not generating; fully async, time/rollout_parked_s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    """What a --task sets apart from the flags every arm shares (`task_flags`)."""

    base: str
    """The base policy directory (model/, train.jsonl, eval.jsonl)."""
    lr: str
    """The default --lr."""
    max_response_length: int
    max_prompt_length: int
    overlong_buffer_length: int
    max_num_gen_batches: int
    global_batch_size: int


TASKS = {
    # examples/run_embedded_demo.sh's training flags, at half its --lr 5e-4 (see the docstring)
    "demo": Task(base="runs/tiny-base", lr="2.5e-4", max_response_length=40, max_prompt_length=16,
                 overlong_buffer_length=8, max_num_gen_batches=16, global_batch_size=64),
    # tools/ablation.py's DAPO arm (docs/ABLATION.md): responses of up to 160 tokens with a long tail, 16 prompts x 8,
    # 8 optimizer steps a rollout step
    "remainder": Task(base="data/remainder-base", lr="3e-4", max_response_length=160, max_prompt_length=24,
                      overlong_buffer_length=32, max_num_gen_batches=8, global_batch_size=16),
}
"""--task: its base policy, default --lr and the flags that differ."""


def task_flags(task: Task, base: Path, run: Path, steps: int, eval_interval: int, lr: str) -> list[str]:
    """The trainer flags of one arm of `task` (no checkpoints, no export: only the loop is timed), with the held-out
    avg@4 every `eval_interval` steps."""
    return [
        "--hf-checkpoint", str(base / "model"),
        "--prompt-data", str(base / "train.jsonl"), "--eval-prompt-data", str(base / "eval.jsonl"),
        "--eval-interval", str(eval_interval), "--n-samples-per-eval-prompt", "4", "--eval-max-prompts", "200",
        "--rollout-engine", "embedded", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--over-sample-factor", "1.5", "--rollout-temperature", "1.0",
        "--max-response-length", str(task.max_response_length),
        "--max-num-gen-batches", str(task.max_num_gen_batches), "--on-gen-exhausted", "partial",
        "--max-prompt-length", str(task.max_prompt_length),
        "--clip-ratio-low", "0.2", "--clip-ratio-high", "0.28", "--loss-agg-mode", "token-mean", "--dynamic-sampling",
        "--overlong-buffer-length", str(task.overlong_buffer_length), "--overlong-penalty-factor", "1.0",
        "--reward-fn", "math_dapo",
        "--lr", lr, "--lr-warmup-steps", "3", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--global-batch-size", str(task.global_batch_size), "--seed", "1234",
        "--num-steps", str(steps), "--log-dir", str(run), "--no-wandb", "--no-progress",
    ]


def sglang_flags(flags: list[str], port: int) -> list[str]:
    """`flags` with the rollouts from a CPU SGLang server the trainer launches (.venv-sglang, fp32, base port
    `port`), weights pushed as tensors."""
    python = REPO / ".venv-sglang" / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--engine sglang needs {python}: run `make sglang-env` first")
    i = flags.index("--rollout-engine")
    return flags[:i] + ["--rollout-engine", "sglang"] + flags[i + 2:] + [
        "--sglang-python", str(python), "--sglang-extra-args", "--dtype float32", "--sglang-base-port", str(port),
        "--weight-sync-mode", "tensor"]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(run: Path, wall_s: float, cpu_s: float, target: float) -> dict[str, float]:
    records = {r["step"]: r for r in read_records(run / "metrics.jsonl")}
    steps = sorted(s for s in records if s > 0)
    evals = [(s, records[s]["eval/avg@4"]) for s in sorted(records) if "eval/avg@4" in records[s]]
    loop_s = 0.0
    reached, reached_s = None, None
    for s in steps:
        loop_s += records[s].get("time/step_s", 0.0)
        if reached is None and "eval/avg@4" in records[s] and records[s]["eval/avg@4"] >= target:
            reached, reached_s = s, loop_s

    def total(key: str) -> float:
        return sum(records[s].get(key, 0.0) for s in steps)

    stale = [sum(v for k, v in records[s].items()
                 if k.startswith("rollout/staleness/") and int(k.rsplit("/", 1)[1]) >= d)
             for s in steps for d in (1, 2)]
    overlapped = sum(records[s].get("time/step_s", 0.0) - min(records[s].get("time/rollout_s", 0.0),
                                                              records[s].get("time/train_s", 0.0)) for s in steps)
    return {"wall_s": wall_s, "cpu_s": cpu_s, "overlapped_loop_s": overlapped,
            "steps": float(len(steps)), "avg@4_first": evals[0][1] if evals else float("nan"),
            "avg@4_end": evals[-1][1] if evals else float("nan"),
            "reached_step": float(reached) if reached is not None else float("nan"),
            "loop_s_to_target": reached_s if reached_s is not None else float("nan"), "loop_s": loop_s,
            "rollout_s": total("time/rollout_s"), "train_s": total("time/train_s"),
            "rollout_wait_s": total("time/rollout_wait_s"), "overlap_s": total("time/overlap_s"),
            "push_wait_s": total("time/push_wait_s"), "eval_s": total("time/eval_s"),
            "generated_tokens": total("rollout/generated_tokens") + total("stream/generated_tokens"),
            "stale_1_share": sum(stale[0::2]) / len(steps) if steps else float("nan"),
            "stale_2_share": sum(stale[1::2]) / len(steps) if steps else float("nan"),
            "stale_dropped_groups": total("rollout/stale_dropped_groups"),
            "engine_idle_share": engine_idle(records, steps, loop_s)}


def engine_idle(records: dict[int, dict], steps: list[int], loop_s: float) -> float:
    """Share of the loop time the rollout engine had no request: synchronous, every second not generating; one step
    off, the steps' time minus their generation; fully async, the time it waited parked for a push."""
    if not loop_s:
        return float("nan")
    if any("time/rollout_parked_s" in records[s] for s in steps):
        return sum(records[s].get("time/rollout_parked_s", 0.0) for s in steps) / loop_s
    return max(0.0, 1.0 - sum(records[s].get("time/rollout_s", 0.0) for s in steps) / loop_s)


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes (and theirs) so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps per run (the demo: 60)")
    p.add_argument("--eval-interval", type=int, default=10, help="held-out avg@4 every N steps")
    p.add_argument("--target", type=float, default=0.9, help="held-out avg@4 to reach")
    p.add_argument("--task", choices=sorted(TASKS), default="demo",
                   help="demo: two-digit sums, 40-token responses; remainder: tools/ablation.py's DAPO arm, "
                        "160-token responses with a long tail")
    p.add_argument("--engine", choices=("embedded", "sglang"), default="embedded",
                   help="the rollout engine: embedded (its own process when async), or a CPU SGLang server the "
                        "trainer launches (make sglang-env)")
    p.add_argument("--sglang-base-port", type=int, default=31000, help="--engine sglang: the server's base port")
    p.add_argument("--lr", default=None, help="learning rate of every run (default: demo 2.5e-4, half the demo's "
                                              "5e-4, see the docstring; remainder 3e-4, the ablation's)")
    p.add_argument("--base-dir", default=None, help="base policy (default: demo runs/tiny-base, built when missing; "
                                                    "remainder data/remainder-base)")
    p.add_argument("--out", default="runs/bench_async", help="run directories and summary.json")
    p.add_argument("--arms", default="sync,async,k1,k2,k4",
                   help="comma-separated runs: sync, async (--async-rollout 1), kN (--max-staleness N)")
    args = p.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        if arm not in ("sync", "async") and not (arm.startswith("k") and arm[1:].isdigit() and int(arm[1:]) >= 1):
            p.error(f"--arms: {arm!r} is not sync, async or kN with N >= 1")
    task = TASKS[args.task]
    base, out, lr = Path(args.base_dir or task.base), Path(args.out), args.lr or task.lr
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    if not (base / "model" / "config.json").is_file():
        if args.task != "demo":
            raise SystemExit(f"--base-dir {base}: no model/config.json (build it with tools/make_tiny_base.py "
                             f"--task {args.task} --out {base})")
        print(f"== building the tiny base policy in {base}", flush=True)
        subprocess.run([sys.executable, "tools/make_tiny_base.py", "--out", str(base)], cwd=REPO, env=env, check=True)
    results = {}
    for name in arms:
        run = out / name
        flags = task_flags(task, base, run, args.steps, args.eval_interval, lr)
        if args.engine == "sglang":
            flags = sglang_flags(flags, args.sglang_base_port)
        if name.startswith("k"):
            flags = without(flags, "--max-num-gen-batches", "--on-gen-exhausted") + ["--max-staleness", name[1:]]
        else:
            flags += ["--async-rollout", "1" if name == "async" else "0"]
        print(f"== {name}: {args.steps} steps -> {run}", flush=True)
        t0, used = time.perf_counter(), _children_cpu_s()
        subprocess.run([sys.executable, "-m", "megatron_dapo.train", *flags], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        results[name] = summarise(run, time.perf_counter() - t0, _children_cpu_s() - used, args.target)
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    rows = [("wall time (s)", "wall_s", "{:.0f}"), ("CPU time, all processes (s)", "cpu_s", "{:.0f}"),
            ("steps", "steps", "{:.0f}"),
            ("held-out avg@4, first eval", "avg@4_first", "{:.3f}"), ("held-out avg@4, end", "avg@4_end", "{:.3f}"),
            (f"first step with avg@4 >= {args.target}", "reached_step", "{:.0f}"),
            ("  loop time to it (s)", "loop_s_to_target", "{:.0f}"), ("loop time, all steps (s)", "loop_s", "{:.0f}"),
            ("  generation (s)", "rollout_s", "{:.0f}"), ("  training (s)", "train_s", "{:.0f}"),
            ("  training waited for its batch (s)", "rollout_wait_s", "{:.0f}"),
            ("  generation overlapped with training (s)", "overlap_s", "{:.0f}"),
            ("  push waited for generation (s)", "push_wait_s", "{:.0f}"), ("  evaluation (s)", "eval_s", "{:.0f}"),
            ("loop time with gen || train, from own steps (s)", "overlapped_loop_s", "{:.0f}"),
            ("response tokens generated", "generated_tokens", "{:.0f}"),
            ("trained tokens at staleness >= 1 (share)", "stale_1_share", "{:.3f}"),
            ("trained tokens at staleness >= 2 (share)", "stale_2_share", "{:.3f}"),
            ("stale groups dropped", "stale_dropped_groups", "{:.0f}"),
            ("engine idle, share of loop time", "engine_idle_share", "{:.2f}")]
    print(f"\n{'':44}" + "".join(f"{name:>10}" for name in arms))
    for label, key, fmt in rows:
        print(f"{label:44}" + "".join(f"{fmt.format(results[name][key]):>10}" for name in arms))
    if "sync" in results:
        for name in arms[1:] if arms[0] == "sync" else arms:
            if name != "sync":
                print(f"{name} / sync wall time: {results[name]['wall_s'] / results['sync']['wall_s']:.2f}x, loop "
                      f"time to avg@4 >= {args.target}: "
                      f"{results[name]['loop_s_to_target'] / results['sync']['loop_s_to_target']:.2f}x")
    print(f"task {args.task}, engine {args.engine}, --lr {lr} (cores: {os.cpu_count()}, OMP_NUM_THREADS="
          f"{env['OMP_NUM_THREADS']}, load average at the end {os.getloadavg()[0]:.1f})")


def without(flags: list[str], *names: str) -> list[str]:
    """`flags` without each `name` and the value after it."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


if __name__ == "__main__":
    main()
