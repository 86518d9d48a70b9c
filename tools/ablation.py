"""DAPO's Table 1 on a laptop: its techniques added one at a time, each arm trained with the real trainer.

    python tools/ablation.py                 # 6 arms x 3 seeds (make ablation)
    python tools/ablation.py --quick         # 6 arms x 1 seed, fewer steps (make ablation-quick)
    python tools/ablation.py --arms naive,dapo --seeds 1 --steps 2   # any subset

Every run is `python -m megatron_dapo.train` (megatron-core actor, embedded engine) on the remainder task
(megatron_dapo/data/remainder.py: "47 mod 6=" worked by repeated subtraction) from one base policy
(`data/remainder-base`, built by `tools/make_tiny_base.py --task remainder`); the arms differ only in the flags
of `ARMS`, in Table 1's order, each adding one technique to the one before. After training, the exported policy
samples the held-out problems (`megatron_dapo/rollout/remainder_eval.py`: avg@k, length tail, truncated and
sound-but-truncated shares, entropy). Outputs in --out: one directory per run (metrics.jsonl, checkpoints,
heldout.json, timing.json), `ablation.png` (curves per arm, mean and min-max over seeds), `summary.json` and
`table.md` (held-out avg@k per arm beside the paper's AIME numbers, the reading of each technique, wall time per
arm).

An interrupted ablation resumes where it stopped: a finished run is skipped, a run cut short restarts from its
last checkpoint (--save-interval) with the same seed, so it continues the same trajectory. Its metrics.jsonl then
holds that one trajectory: the records an attempt logged past the step its successor resumed from move to
metrics.aborted.jsonl (`reconcile_metrics`), and its wall time is that of one uninterrupted run (`Runner._train`).
The children (trainer, evaluation) die with the tool, SIGKILL included (PR_SET_PDEATHSIG); one tool runs on an
--out at a time, and a run whose --save lock is still held (a trainer left running) is refused before any run
starts, in one line naming its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_dapo.checkpoint.save_dir import LOCK_FILE  # noqa: E402
from megatron_dapo.data.remainder import ABLATION_MAX_RESPONSE_LENGTH  # noqa: E402

DEFAULT_BASE = REPO / "data" / "remainder-base"
OUT_LOCK = ".ablation.lock"
"""In --out: the flock one tool holds for its lifetime (the kernel drops it when the tool dies, SIGKILL included)."""
LOCK_WAIT_S = 30.0
"""How long a start waits for a run's --save lock held by a trainer that is dying (the kernel drops the flock once
the process is gone: milliseconds, seconds for one SIGKILLed in the middle of a checkpoint write)."""


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One row of DAPO's Table 1: the techniques on, and the paper's AIME 2024 avg@32 for that row (None: an arm
    outside the table, EXTRA_ARMS)."""

    key: str
    label: str
    paper_aime: int | None
    clip_high: float = 0.2
    token_level_loss: bool = False
    overlong_filter: bool = False
    soft_punishment: bool = False
    dynamic_sampling: bool = False
    kl_coef: float = 0.0
    """beta of the KL term to the base policy (--ref-load initial --kl-coef, k3): GRPO's, which DAPO removed."""


ARMS: tuple[Arm, ...] = (
    Arm(key="naive", label="naive GRPO", paper_aime=30),
    Arm(key="filter", label="+ overlong filtering", paper_aime=36, overlong_filter=True),
    Arm(key="clip_higher", label="+ clip-higher", paper_aime=38, overlong_filter=True, clip_high=0.28),
    Arm(key="soft_punish", label="+ soft overlong punishment", paper_aime=41, overlong_filter=True,
        clip_high=0.28, soft_punishment=True),
    Arm(key="token_loss", label="+ token-level loss", paper_aime=42, overlong_filter=True, clip_high=0.28,
        soft_punishment=True, token_level_loss=True),
    Arm(key="dapo", label="+ dynamic sampling (DAPO)", paper_aime=50, overlong_filter=True, clip_high=0.28,
        soft_punishment=True, token_level_loss=True, dynamic_sampling=True),
)
EXTRA_ARMS: tuple[Arm, ...] = (
    Arm(key="grpo_kl", label="naive GRPO + KL to the base (beta 0.001, k3)", paper_aime=None, kl_coef=0.001),
)
"""Arms outside Table 1, run only when named in --arms: GRPO's KL term (DeepSeekMath Eq. 3, its beta 0.04 is for a
reward model; 0.001 is verl's GRPO default), which DAPO removes (its Sec. 2.3), on top of the naive arm."""
ALL_ARMS = ARMS + EXTRA_ARMS
ARM_BY_KEY = {a.key: a for a in ALL_ARMS}


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What every arm shares: the rollout, the optimizer, the length limits."""

    steps: int = 40
    rollout_batch_size: int = 16
    n_samples: int = 8
    global_batch_size: int = 16
    """Responses per optimizer step: 128 per rollout step in 8 mini-batches, so 7 of 8 updates are off-policy
    and the clip acts (DAPO: 16 updates a rollout step)."""
    lr: float = 3e-4
    max_response_length: int = ABLATION_MAX_RESPONSE_LENGTH
    overlong_buffer: int = 32
    """L_cache of the soft punishment: the last 32 of 160 tokens (DAPO: 4096 of 20480)."""
    save_interval: int = 10
    eval_prompts: int = 200
    eval_k: int = 4


def arm_flags(arm: Arm, schedule: Schedule) -> list[str]:
    """The trainer flags that make `arm` what it is (the rest of the command is the same for every arm)."""
    flags = ["--clip-ratio-low", "0.2", "--clip-ratio-high", str(arm.clip_high),
             "--loss-agg-mode", "token-mean" if arm.token_level_loss else "seq-mean-token-mean"]
    flags += ["--overlong-filter"] if arm.overlong_filter else []
    flags += ["--overlong-buffer-length", str(schedule.overlong_buffer if arm.soft_punishment else 0),
              "--overlong-penalty-factor", "1.0"]
    if arm.dynamic_sampling:
        flags += ["--dynamic-sampling", "--over-sample-factor", "1.5", "--max-num-gen-batches", "8",
                  "--on-gen-exhausted", "partial"]
    else:
        flags += ["--no-dynamic-sampling"]
    if arm.kl_coef:
        flags += ["--ref-load", "initial", "--kl-coef", str(arm.kl_coef), "--kl-estimator", "k3"]
    return flags


def train_command(arm: Arm, seed: int, run_dir: Path, base: Path, schedule: Schedule) -> list[str]:
    """The whole `python -m megatron_dapo.train` command line of one run; --load = --save resumes it."""
    ckpt = run_dir / "ckpt"
    return [
        sys.executable, "-m", "megatron_dapo.train",
        "--hf-checkpoint", str(base / "model"), "--prompt-data", str(base / "train.jsonl"),
        "--rollout-engine", "embedded", "--rollout-batch-size", str(schedule.rollout_batch_size),
        "--n-samples-per-prompt", str(schedule.n_samples), "--rollout-temperature", "1.0",
        "--max-response-length", str(schedule.max_response_length), "--max-prompt-length", "24",
        "--reward-fn", "math_dapo", *arm_flags(arm, schedule),
        "--lr", str(schedule.lr), "--lr-warmup-steps", "3", "--weight-decay", "0.0", "--clip-grad", "1.0",
        "--global-batch-size", str(schedule.global_batch_size), "--seed", str(seed),
        "--num-steps", str(schedule.steps), "--log-dir", str(run_dir),
        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(schedule.save_interval),
        "--export-hf", str(run_dir / "hf"), "--no-wandb",
    ]


class RunFailed(Exception):
    """A run that cannot go on: the ablation stops every run and prints this as one `error:` line."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


_PR_SET_PDEATHSIG = 1


def _die_with_parent(prctl, parent_pid: int) -> None:
    """preexec_fn of every child: SIGKILL it when the thread that started it dies (the tool SIGKILLed included).

    The kernel signals when the forking *thread* exits: children start on the pool thread that then waits for
    them, so it outlives them. `prctl` is resolved before the fork (nothing is loaded in the child of a threaded
    parent); a parent that died before the prctl took effect ends the child at once."""
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(113)
    if os.getppid() != parent_pid:
        os._exit(114)


def _holder(fd: int) -> str:
    """Who a lock file names: "pid P on host H (started T)", or that it names nobody."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
        return f"pid {int(info['pid'])} on host {info['host']} (started {info.get('started', '?')})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid"


def save_lock_holder(ckpt: Path, wait_s: float = 0.0, poll_s: float = 0.2) -> str | None:
    """Who holds the trainer's --save lock of `ckpt` (megatron_dapo/checkpoint/save_dir.py), re-checked every
    `poll_s` for up to `wait_s` while held; None once it is free (or there is no lock file)."""
    path = ckpt / LOCK_FILE
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None  # free: closing the descriptor drops it again
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return _holder(fd)
        finally:
            os.close(fd)
        time.sleep(poll_s)


def lock_out_dir(out: Path) -> int:
    """Take --out's flock (`OUT_LOCK`) for this tool's lifetime, or RunFailed naming the tool that holds it."""
    fd = os.open(out / OUT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunFailed(f"--out {out} is in use by another tools/ablation.py: {holder}; wait for it to end or "
                        f"stop it, or pass another --out", status=2) from None
    except OSError as err:  # a file system without flock: the trainers' own --save locks still hold
        print(f"warning: --out {out}: no flock here ({err.strerror}): nothing stops a second tools/ablation.py "
              f"on it", file=sys.stderr)
        return fd
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _parse_lines(data: bytes) -> tuple[list[tuple[bytes, dict]], list[bytes]]:
    """The complete json lines of a metrics.jsonl as (line, record), and the lines that are not records (a last
    line a killed trainer left half written, without its newline)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the data ends with a newline
    records, bad = [], [tail] if tail.strip() else []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append((line, record))
        else:
            bad.append(line)
    return records, bad


def reconcile_metrics(path: Path) -> list[dict]:
    """Make `path` (a run's metrics.jsonl) one trajectory and return its records, steps ascending.

    A resumed attempt logs from the step after its checkpoint again, so each record supersedes every earlier
    record of its step or a later one: those came from an attempt cut short after that checkpoint. They, and any
    line that is no record, are appended to metrics.aborted.jsonl beside it (kept apart, not lost); the file is
    rewritten (atomically) only when something moved. Cost: one read and at most one write of the file."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    records, bad = _parse_lines(data)
    kept: list[int] = []  # indices into records, steps strictly ascending
    superseded: list[int] = []
    for i, (_, record) in enumerate(records):
        while kept and records[kept[-1]][1]["step"] >= record["step"]:
            superseded.append(kept.pop())
        kept.append(i)
    dropped = [records[i][0] for i in sorted(superseded)] + bad
    if dropped:
        with open(path.with_name("metrics.aborted.jsonl"), "ab") as f:
            f.write(b"".join(line + b"\n" for line in dropped))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(records[i][0] + b"\n" for i in kept))
        tmp.replace(path)
    return [records[i][1] for i in kept]


def step_seconds(records: list[dict]) -> float:
    """The trainer's own time of these steps (`time/step_s`: rollout, training, weight sync, a save), summed."""
    return sum(float(r.get("time/step_s", 0.0)) for r in records)


@dataclass
class Job:
    """One run: an arm at a seed, in its own directory."""

    arm: Arm
    seed: int
    run_dir: Path


class Runner:
    """Runs each job's trainer and evaluation as child processes; stop() ends them all by pid (SIGINT / SIGTERM)."""

    def __init__(self, base: Path, schedule: Schedule) -> None:
        self.base, self.schedule = base, schedule
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.stopping = False
        self._preexec = functools.partial(_die_with_parent, ctypes.CDLL(None, use_errno=True).prctl, os.getpid())

    def _child(self, cmd: list[str], log_path: Path) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
               "PYTHONPATH": str(REPO)}
        with open(log_path, "a") as log:
            with self._lock:
                if self.stopping:
                    return -signal.SIGTERM
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        preexec_fn=self._preexec)
                self._procs.add(proc)
            try:
                return proc.wait()
            finally:
                with self._lock:
                    self._procs.discard(proc)

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            procs = list(self._procs)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self, job: Job) -> bool:
        """Train (or resume) one run, then sample its exported policy on the held-out problems; whether the run is
        done (False: stop() ended it, or it was never started because of a stop). RunFailed when either child
        fails (not when stop() ended it), after stopping every other child: the pool thread would otherwise go
        straight on to the next job."""
        try:
            return self._run(job)
        except RunFailed:
            self.stop()
            raise

    def _run(self, job: Job) -> bool:
        heldout = job.run_dir / "heldout.json"
        if heldout.is_file():
            return True
        if self.stopping:
            return False
        job.run_dir.mkdir(parents=True, exist_ok=True)
        timing_path = job.run_dir / "timing.json"
        timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {"train_s": 0.0, "attempts": 0}
        if not (job.run_dir / "train.done").is_file():
            if not self._train(job, timing, timing_path):
                return False
            (job.run_dir / "train.done").touch()
        t0 = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "heldout", "--model", str(job.run_dir / "hf"),
               "--base", str(self.base), "--out", str(heldout), "--seed", str(job.seed),
               "--num-prompts", str(self.schedule.eval_prompts), "--k", str(self.schedule.eval_k),
               "--max-response-length", str(self.schedule.max_response_length)]
        rc = self._child(cmd, job.run_dir / "heldout.log")
        if rc != 0:
            if self.stopping:
                return False
            raise RunFailed(f"{job.arm.key} seed {job.seed}: the held-out evaluation exited {rc}"
                            f"{_last_line(job.run_dir / 'heldout.log')}; see {job.run_dir / 'heldout.log'}")
        timing["heldout_s"] = time.perf_counter() - t0
        timing_path.write_text(json.dumps(timing))
        return True

    def _train(self, job: Job, timing: dict, timing_path: Path) -> bool:
        """One training attempt of `job` (a start, or a resume from its last checkpoint); whether it finished.

        Refused (RunFailed, nothing started) while the run's --save lock is held. The attempt is counted in
        timing.json before it starts (a tool SIGKILLed during it cannot count it later); afterwards metrics.jsonl
        is reconciled to one trajectory, and a finished attempt sets `train_s` to the wall time of one
        uninterrupted run: this attempt's (start-up, its steps, export) plus the trainer's own step times of the
        steps kept from earlier attempts. `spent_s` adds up what the attempts this tool saw end really took."""
        ckpt = job.run_dir / "ckpt"
        holder = save_lock_holder(ckpt)
        if holder is not None:
            raise RunFailed(_lock_message(job, holder), status=2)
        metrics = job.run_dir / "metrics.jsonl"
        earlier = reconcile_metrics(metrics)  # also drops a half-written last line, so new lines start cleanly
        offset = metrics.stat().st_size if metrics.is_file() else 0
        timing["attempts"] += 1
        timing_path.write_text(json.dumps(timing))
        t0 = time.perf_counter()
        rc = self._child(train_command(job.arm, job.seed, job.run_dir, self.base, self.schedule),
                         job.run_dir / "train.log")
        seconds = time.perf_counter() - t0
        new = _records_after(metrics, offset)
        reconcile_metrics(metrics)
        timing["spent_s"] = timing.get("spent_s", 0.0) + seconds
        if rc == 0:
            resumed_at = new[0]["step"] if new else None  # nothing logged: it resumed at the last step
            timing["train_s"] = seconds + step_seconds([r for r in earlier
                                                        if resumed_at is None or r["step"] < resumed_at])
        timing_path.write_text(json.dumps(timing))
        if rc == 0:
            return True
        if self.stopping:
            return False
        raise RunFailed(f"{job.arm.key} seed {job.seed}: the trainer exited {rc}{_last_line(job.run_dir / 'train.log')}"
                        f"; see {job.run_dir / 'train.log'}")


def _records_after(path: Path, offset: int) -> list[dict]:
    """The records of `path` past byte `offset` (what one attempt appended)."""
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        return [record for _, record in _parse_lines(f.read())[0]]


def _last_line(log: Path) -> str:
    """": <the log's last non-empty line>" (300 characters at most), or "" for an empty or missing log."""
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return f": {lines[-1][:300]}"
    return ""


def _lock_message(job: Job, holder: str) -> str:
    return (f"{job.arm.key} seed {job.seed}: {job.run_dir / 'ckpt'} (its --save) is locked by {holder}, a trainer "
            f"still running on it (another tools/ablation.py, or one left by a tool killed before it stopped its "
            f"children); wait for it to end or stop it, then run this again")


def check_save_locks(jobs: list[Job], wait_s: float = LOCK_WAIT_S) -> None:
    """Before any run starts: every unfinished job's --save lock is free, waiting up to `wait_s` in all for
    trainers that are dying; else RunFailed (status 2) naming the first holder."""
    deadline = time.monotonic() + wait_s
    for job in jobs:
        if (job.run_dir / "train.done").is_file():
            continue
        holder = save_lock_holder(job.run_dir / "ckpt", wait_s=max(0.0, deadline - time.monotonic()))
        if holder is not None:
            raise RunFailed(_lock_message(job, holder), status=2)


def heldout_main(argv: list[str]) -> None:
    """`ablation.py heldout`: one policy's remainder_sample_stats on the held-out problems, written as JSON."""
    ap = argparse.ArgumentParser(prog="ablation.py heldout")
    ap.add_argument("--model", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--num-prompts", type=int, required=True)
    ap.add_argument("--k", type=int, required=True)
    ap.add_argument("--max-response-length", type=int, required=True)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.embedded import EmbeddedEngine
    from megatron_dapo.rollout.remainder_eval import remainder_sample_stats

    records = load_heldout(Path(args.base), args.num_prompts)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with EmbeddedEngine(args.model, arch=ModelArch.from_hf(args.model), tokenizer=tokenizer, seed=args.seed,
                        max_batch_size=256) as engine:
        stats = remainder_sample_stats(engine, tokenizer, records, k=args.k,
                                       max_new_tokens=args.max_response_length, seed=args.seed)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(stats, indent=1))
    tmp.replace(args.out)


def load_heldout(base: Path, n: int):
    """The first `n` held-out problems of the base's eval.jsonl (the trainer's loader), with their a and b."""
    import dataclasses

    from megatron_dapo.data import load_prompts
    from megatron_dapo.data.remainder import parse_prompt

    records = []
    for r in load_prompts(base / "eval.jsonl", limit=n):
        a, b = parse_prompt(r.messages[-1]["content"])
        records.append(dataclasses.replace(r, extra={**r.extra, "a": a, "b": b}))
    if not records:
        raise SystemExit(f"{base / 'eval.jsonl'} holds no problems")
    return records


# ---- reading the runs -------------------------------------------------------------------------------------

CURVES = (  # (panel title, the metrics.jsonl keys summed, cumulative)
    ("accuracy (rollout, temperature 1)", ("rollout/accuracy",), False),
    ("entropy (nats/token)", ("train/entropy",), False),
    ("response length (mean, tokens)", ("rollout/response_len_mean",), False),
    ("clip fraction (low + high)", ("train/clipfrac_low", "train/clipfrac_high"), False),
    ("truncated share", ("rollout/clip_ratio",), False),
    ("responses generated (cumulative)", ("rollout/responses",), True),
)
SMOOTH = 5
"""Steps in the running mean the per-step curves are drawn with (128 responses a step are a noisy sample)."""


def read_run(run_dir: Path) -> dict:
    """One finished run: its per-step metrics, held-out stats and timing."""
    from megatron_dapo.trainer.metrics_log import read_metrics

    return {"steps": read_metrics(run_dir / "metrics.jsonl"),
            "heldout": json.loads((run_dir / "heldout.json").read_text()),
            "timing": json.loads((run_dir / "timing.json").read_text())}


def curve(records: list[dict], keys: tuple[str, ...]) -> list[float]:
    """The per-step series of the sum of `keys` (a step lacking one of them counts it as 0)."""
    return [sum(float(r.get(k, 0.0)) for k in keys) for r in records]


def running_mean(values: list[float], window: int) -> list[float]:
    """values[i] averaged with up to window - 1 values before it."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def late_mean(values: list[float]) -> float:
    """Mean over the second half of a run: where the arms have separated, less noisy than the last step."""
    tail = values[len(values) // 2:] or values
    return statistics.fmean(tail)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def steps_to(accuracy: list[float], target: float, window: int = 3) -> int | None:
    """First step (1-based) at which the running mean of `window` steps of accuracy reaches `target`."""
    return next((i + 1 for i, m in enumerate(running_mean(accuracy, window)) if m >= target), None)


def steps_or_after(accuracy: list[float], target: float) -> float:
    """steps_to(accuracy, target), or one step past the run (len + 1) when it never gets there."""
    step = steps_to(accuracy, target)
    return float(step if step is not None else len(accuracy) + 1)


def run_readings(run: dict) -> dict[str, float]:
    """The per-run numbers the techniques are read by (see READINGS)."""
    steps = run["steps"]
    acc = curve(steps, ("rollout/accuracy",))
    lengths = curve(steps, ("rollout/response_len_mean",))
    out = {
        "entropy_late": late_mean(curve(steps, ("train/entropy",))),
        "clipfrac_high_late": late_mean(curve(steps, ("train/clipfrac_high",))),
        "clipfrac_low_late": late_mean(curve(steps, ("train/clipfrac_low",))),
        "len_mean_late": late_mean(lengths),
        "len_max_late": late_mean(curve(steps, ("rollout/response_len_max",))),
        "truncated_late": late_mean(curve(steps, ("rollout/clip_ratio",))),
        "acc_late": late_mean(acc),
        "generated": sum(curve(steps, ("rollout/responses",))),
        "wall_s": run["timing"]["train_s"] + run["timing"].get("heldout_s", 0.0),
    }
    for key, value in run["heldout"].items():
        out[f"heldout_{key}"] = value
    return out


@dataclass(frozen=True)
class Reading:
    """How one technique is read: the arm before and with it, and the metric the paper says it moves."""

    technique: str
    before: str
    after: str
    metric: str
    expected: str
    """'up' or 'down': the direction DAPO reports."""
    paper: str


READINGS = (
    Reading("overlong filtering", "naive", "filter", "heldout_sound_truncated", "down",
            "a truncated response scores -1 even when its reasoning was sound: reward noise (Sec. 3.4)"),
    Reading("overlong filtering", "naive", "filter", "heldout_avg", "up",
            "masking truncated samples steadies training and lifts accuracy (Fig. 5): AIME 30 -> 36"),
    Reading("clip-higher", "filter", "clip_higher", "entropy_late", "up",
            "symmetric clipping collapses entropy; eps_high 0.28 keeps it (Fig. 2)"),
    Reading("clip-higher", "filter", "clip_higher", "heldout_avg", "up", "AIME 36 -> 38"),
    Reading("soft overlong punishment", "clip_higher", "soft_punish", "truncated_late", "down",
            "a graded penalty in the last L_cache tokens steers length before the cut (Sec. 3.4)"),
    Reading("soft overlong punishment", "clip_higher", "soft_punish", "heldout_avg", "up", "AIME 38 -> 41"),
    Reading("token-level loss", "soft_punish", "token_loss", "len_mean_late", "down",
            "sample-level loss lets long responses grow unhealthily (Fig. 4)"),
    Reading("token-level loss", "soft_punish", "token_loss", "len_max_late", "down",
            "and their tail: the longest response of each step"),
    Reading("token-level loss", "soft_punish", "token_loss", "heldout_repeat", "down",
            "the repeating pattern is what a long low-quality response is made of here"),
    Reading("dynamic sampling", "token_loss", "dapo", "steps_to_target", "down",
            "zero-advantage groups removed: the same accuracy in fewer steps (Fig. 6)"),
    Reading("dynamic sampling", "token_loss", "dapo", "generated_to_target", "up",
            "at the cost of more samples generated per step"),
    Reading("dynamic sampling", "token_loss", "dapo", "steps_to_fixed", "down",
            "steps to a 0.5 rollout accuracy (3-step running mean; never reached counts as steps + 1)"),
    Reading("dynamic sampling", "token_loss", "dapo", "heldout_avg", "up", "AIME 42 -> 50"),
    Reading("KL to the base (GRPO's)", "naive", "grpo_kl", "heldout_avg", "down",
            "the policy must move far from the base on long CoT, so DAPO removes the term that holds it back "
            "(Sec. 2.3)"),
)


FIXED_TARGET = 0.5
"""A second accuracy to count steps to (rollout accuracy, 3-step running mean): twice the base's."""


def summarize(runs: dict[str, list[dict]], schedule: Schedule) -> dict:
    """Per arm: mean +- std over seeds of every reading, held-out avg@k, wall time; per technique: the delta."""
    k = schedule.eval_k
    arms = {}
    for key, seed_runs in runs.items():
        per_seed = [run_readings(r) for r in seed_runs]
        for r in per_seed:
            r["heldout_avg"] = r[f"heldout_avg@{k}"]
        arms[key] = {"seeds": len(per_seed),
                     "metrics": {m: mean_std([r[m] for r in per_seed]) for m in per_seed[0]},
                     "per_seed": per_seed}
    # dynamic sampling: steps and generated responses to the accuracy the arm without it settles at (the mean over
    # its seeds of the second half's rollout accuracy); a run that never gets there counts as steps + 1
    if "token_loss" in runs and "dapo" in runs:
        target = statistics.fmean(late_mean(curve(r["steps"], ("rollout/accuracy",))) for r in runs["token_loss"])
        for key in ("token_loss", "dapo"):
            reached, generated, fixed = [], [], []
            for r in runs[key]:
                acc = curve(r["steps"], ("rollout/accuracy",))
                reached.append(steps_or_after(acc, target))
                made = curve(r["steps"], ("rollout/responses",))
                generated.append(float(sum(made[:int(reached[-1])])))
                fixed.append(steps_or_after(acc, FIXED_TARGET))
            arms[key]["metrics"]["steps_to_target"] = mean_std(reached)
            arms[key]["metrics"]["generated_to_target"] = mean_std(generated)
            arms[key]["metrics"]["steps_to_fixed"] = mean_std(fixed)
            arms[key]["reached_fixed"] = sum(f <= len(r["steps"]) for f, r in zip(fixed, runs[key], strict=True))
        arms["dapo"]["target_accuracy"] = target
    readings = []
    for rd in READINGS:
        if rd.before not in arms or rd.after not in arms or rd.metric not in arms[rd.after]["metrics"]:
            continue
        (b, bs), (a, as_) = arms[rd.before]["metrics"][rd.metric], arms[rd.after]["metrics"][rd.metric]
        delta = a - b
        spread = (bs ** 2 + as_ ** 2) ** 0.5
        moved = "up" if delta > 0 else "down" if delta < 0 else "flat"
        readings.append({"technique": rd.technique, "metric": rd.metric, "before": b, "before_std": bs,
                         "after": a, "after_std": as_, "delta": delta, "spread": spread,
                         "expected": rd.expected, "direction_reproduces": moved == rd.expected,
                         "beyond_spread": abs(delta) > spread, "paper": rd.paper})
    return {"arms": arms, "readings": readings, "schedule": schedule.__dict__}


def table_markdown(summary: dict, schedule: Schedule) -> str:
    """The held-out table (beside the paper's numbers) and the readings, as markdown."""
    k = schedule.eval_k
    lines = [f"| arm | paper AIME avg@32 | held-out avg@{k} | entropy (held-out) | length p90 | truncated | "
             "sound but truncated | repeats | wall s / run |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in ALL_ARMS:
        if arm.key not in summary["arms"]:
            continue
        m = summary["arms"][arm.key]["metrics"]

        def cell(name: str, fmt: str = ".3f", metrics: dict = m) -> str:
            mean, std = metrics[name]
            return f"{mean:{fmt}} +- {std:{fmt}}"
        paper = arm.paper_aime if arm.paper_aime is not None else "-"
        lines.append(f"| {arm.label} | {paper} | {cell(f'heldout_avg@{k}')} | {cell('heldout_entropy')} | "
                     f"{cell('heldout_len_p90', '.1f')} | {cell('heldout_truncated')} | "
                     f"{cell('heldout_sound_truncated')} | {cell('heldout_repeat')} | {cell('wall_s', '.0f')} |")
    lines += ["", "| technique | metric (arm before -> with it) | before | with it | delta | seed spread | "
              "expected | reproduces in direction |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["readings"]:
        if r["spread"] == 0.0:
            spread_note = " (one seed: no spread)"
        else:
            spread_note = "" if r["beyond_spread"] else " (within spread)"
        verdict = ("yes" if r["direction_reproduces"] else "no") + spread_note
        lines.append(f"| {r['technique']} | {r['metric']} | {r['before']:.4f} +- {r['before_std']:.4f} | "
                     f"{r['after']:.4f} +- {r['after_std']:.4f} | {r['delta']:+.4f} | {r['spread']:.4f} | "
                     f"{r['expected']} | {verdict} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    """One PNG: a panel per curve, one line per arm (mean over seeds) with its min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, (name, keys, cumulative) in zip(axes.flat, CURVES, strict=True):
        for arm in ALL_ARMS:
            if arm.key not in runs:
                continue
            series = [curve(r["steps"], keys) for r in runs[arm.key]]
            series = [list(accumulate(s)) if cumulative else running_mean(s, SMOOTH) for s in series]
            n = min(map(len, series))
            xs = list(range(1, n + 1))
            columns = list(zip(*(s[:n] for s in series), strict=True))
            mean = [statistics.fmean(c) for c in columns]
            line, = ax.plot(xs, mean, label=arm.label, linewidth=1.4)
            if len(series) > 1:
                ax.fill_between(xs, [min(c) for c in columns], [max(c) for c in columns],
                                color=line.get_color(), alpha=0.12)
        ax.set_title(name if cumulative else f"{name}, {SMOOTH}-step running mean")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


# ---- entry point ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed and 20 steps (unless --seeds / --steps say "
                                                         "otherwise): the whole table in ~5 min")
    ap.add_argument("--arms", default=",".join(a.key for a in ARMS),
                    help=f"comma-separated, from {', '.join(a.key for a in ALL_ARMS)} (default: Table 1's; "
                         f"{', '.join(a.key for a in EXTRA_ARMS)} when named)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 1 2 3 (--quick: 1)")
    ap.add_argument("--steps", type=int, default=None, help="rollout steps per run (default 40, --quick 20)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one core each")
    ap.add_argument("--base", default=str(DEFAULT_BASE), help="the base policy directory (model/, train.jsonl, "
                                                              "eval.jsonl)")
    ap.add_argument("--out", default=None, help="default runs/ablation (--quick: runs/ablation-quick)")
    ap.add_argument("--eval-prompts", type=int, default=200, help="held-out problems sampled per run")
    ap.add_argument("--lr", type=float, default=Schedule.lr, help="the trainer's --lr, every arm")
    ap.add_argument("--global-batch-size", type=int, default=Schedule.global_batch_size,
                    help="responses per optimizer step, every arm (128 per rollout step)")
    ap.add_argument("--lock-wait-s", type=float, default=LOCK_WAIT_S,
                    help="how long a start waits for a run's --save lock still held by a trainer that is dying "
                         "(a tool killed an instant ago) before it refuses, naming the holder")
    args = ap.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARM_BY_KEY]
    if unknown:
        ap.error(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARM_BY_KEY)}")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    if args.seeds is None:
        args.seeds = [1] if args.quick else [1, 2, 3]
    if args.steps is None:
        args.steps = 20 if args.quick else 40
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if not args.lock_wait_s >= 0:
        ap.error(f"--lock-wait-s must be >= 0 seconds, got {args.lock_wait_s}")
    if args.out is None:
        args.out = str(REPO / "runs" / ("ablation-quick" if args.quick else "ablation"))
    base = Path(args.base)
    for name in ("model/config.json", "train.jsonl", "eval.jsonl"):
        if not (base / name).is_file():
            ap.error(f"--base {base}: no {name}; build one with "
                     f"`python tools/make_tiny_base.py --task remainder --out {base}`")
    return args


def run_all(runner: Runner, jobs: list[Job], at_once: int, t0: float) -> None:
    """Every job, `at_once` at a time, each announced when done. The first failure (RunFailed) or interrupt
    stops every running child and starts no other job, then propagates."""
    pool = ThreadPoolExecutor(at_once)
    futures = {pool.submit(runner.run, job): job for job in jobs}
    pending = set(futures)
    try:
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.result():  # a run a stop ended, or never started, is not announced
                    job = futures[future]
                    print(f"   {job.arm.key} seed {job.seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    except BaseException:
        for future in pending:  # the jobs not yet started never start
            future.cancel()
        runner.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["heldout"]:
        heldout_main(argv[1:])
        return 0
    args = parse_args(argv)
    schedule = Schedule(steps=args.steps, eval_prompts=args.eval_prompts, lr=args.lr,
                        global_batch_size=args.global_batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"steps": args.steps, "base": str(Path(args.base).resolve()), "eval_prompts": args.eval_prompts,
                "lr": args.lr, "global_batch_size": args.global_batch_size}
    arms = [ARM_BY_KEY[k] for k in args.arms.split(",")]
    # seed-major order: an interrupted ablation has whole seeds done, every arm compared on the same ones
    jobs = [Job(arm=arm, seed=seed, run_dir=out / f"{arm.key}-seed{seed}") for seed in args.seeds for arm in arms]
    try:
        lock_out_dir(out)  # held until this process exits
        settings_path = out / "settings.json"
        if settings_path.is_file() and json.loads(settings_path.read_text()) != settings:
            raise SystemExit(f"{out} holds runs made with {settings_path.read_text().strip()}; these flags ask for "
                             f"{json.dumps(settings)}: pass another --out (or remove {out})")
        settings_path.write_text(json.dumps(settings))
        check_save_locks(jobs, args.lock_wait_s)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return err.status
    runner = Runner(Path(args.base), schedule)

    def on_signal(signum, _frame):
        runner.stop()
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.perf_counter()
    print(f"== {len(jobs)} runs ({len(arms)} arms x {len(args.seeds)} seeds, {args.steps} steps), "
          f"{args.jobs} at a time, in {out}", flush=True)
    try:
        run_all(runner, jobs, args.jobs, t0)
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        print(f"interrupted: run the same command again to resume from {out}", file=sys.stderr)
        return 130
    runs = {arm.key: [read_run(out / f"{arm.key}-seed{seed}") for seed in args.seeds] for arm in arms}
    summary = summarize(runs, schedule)
    summary["invocation_wall_s"] = time.perf_counter() - t0
    summary["run_wall_s_sum"] = sum(r["timing"]["train_s"] + r["timing"].get("heldout_s", 0.0)
                                    for seed_runs in runs.values() for r in seed_runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = table_markdown(summary, schedule)
    (out / "table.md").write_text(table)
    plot(runs, out / "ablation.png", f"DAPO ablation on the remainder task: {len(args.seeds)} seed(s), "
                                     f"{args.steps} steps per arm")
    print(table)
    print(f"wrote {out / 'ablation.png'}, {out / 'table.md'}, {out / 'summary.json'} "
          f"({summary['invocation_wall_s']:.0f} s this invocation; the runs took {summary['run_wall_s_sum']:.0f} s "
          f"one after another, {args.jobs} at a time here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
