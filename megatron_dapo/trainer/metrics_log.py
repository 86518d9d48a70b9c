"""Per-step metrics to a jsonl file, to wandb (offline unless a key and project are given), and a bar."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from megatron_dapo.checkpoint.state import CommonState, Holder


class MetricsLogger:
    """Writes one json line per step to `<log_dir>/metrics.jsonl`; mirrors to wandb when available.

    wandb runs offline by default (files under <log_dir>/wandb); it goes online only when both
    WANDB_API_KEY is set and a project is given. A missing wandb package is reported once, not fatal.
    `config` goes to wandb as is: pass run_record.run_record(args), which holds no secret; `private_argv`
    (run_record.argv_has_secret) keeps a command line that holds one out of wandb's files.
    """

    def __init__(self, log_dir: str | os.PathLike, *, total_steps: int, wandb_project: str | None = None,
                 run_name: str | None = None, config: dict[str, Any] | None = None,
                 use_wandb: bool = True, progress: bool = True, private_argv: bool = False) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / "metrics.jsonl"
        # append: a resumed run continues the same file
        self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        self._wandb = None
        if use_wandb:
            self._wandb = _start_wandb(self.log_dir, wandb_project, run_name, config, private_argv)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="dapo", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{v:.3g}" for k, v in metrics.items()
                     if k in ("rollout/accuracy", "eval/avg@4", "train/pg_loss", "train/entropy")}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.n = step
            self._bar.refresh()

    def logged(self, step: int) -> bool:
        """Whether metrics.jsonl holds a record of step `step` (reads the file: one line per step so far)."""
        return any(int(r["step"]) == step for r in read_metrics(self.path))

    def log_record(self, name: str, record: dict[str, Any]) -> None:
        """Append a free-form json record to `<log_dir>/<name>.jsonl` (not sent to wandb)."""
        with open(self.log_dir / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


@dataclass
class SavedRecord:
    """Rank 0: the metrics record of the step a checkpoint holds, as far as it was known when the checkpoint was
    written, so a run killed between a save and that step's log line does not lose the line.

    A step's record is logged at the end of the step, after its save (and, --colocate, after the push and evaluation
    that follow the save); a SIGKILL in between left the resumed run's metrics.jsonl without that step, forever (the
    resume starts after it). The save now carries the record (`hold`, Trainer.save), and the resumed run writes it
    when metrics.jsonl lacks it (`recover`). It holds every rollout and training metric; what is measured after
    the save is absent (time/step_s, and --colocate the push and evaluation metrics). A few hundred floats, rank 0's
    copy alone (RANK0_ONLY); a checkpoint written before this existed has none (optional)."""

    checkpoint_state: ClassVar[CommonState] = CommonState(key="metrics", holder=Holder.RANK0_ONLY, optional=True)
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def hold(self, step: int, metrics: dict[str, float] | None) -> None:
        """The record of step `step` so far, for the save of that step; None: the step's record is logged already
        (a stop at a step boundary), so the checkpoint carries none."""
        self.step, self.metrics = (step, {k: float(v) for k, v in metrics.items()}) if metrics else (None, {})

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "metrics": dict(self.metrics)} if self.step is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.metrics = int(state["step"]), {k: float(v) for k, v in state["metrics"].items()}

    def recover(self, logger: MetricsLogger, resumed_at: int) -> bool:
        """Log the held record of step `resumed_at` when metrics.jsonl lacks it (the run was killed after the save,
        before the log); whether it did."""
        if self.step != resumed_at or logger.logged(resumed_at):
            return False
        logger.log(resumed_at, self.metrics)
        return True


def _start_wandb(log_dir: Path, project: str | None, run_name: str | None, config: dict[str, Any] | None,
                 private_argv: bool):
    """An offline (or, with WANDB_API_KEY and a project, online) wandb run. `private_argv`: the command line
    holds a secret, so wandb's run metadata (which records sys.argv, host and program) is not written."""
    try:
        import wandb
    except ImportError:
        print("[megatron-dapo] wandb is not installed: metrics go to metrics.jsonl only")
        return None
    online = bool(os.environ.get("WANDB_API_KEY")) and bool(project)
    return wandb.init(project=project or "megatron-dapo", name=run_name, config=config or {},
                      dir=str(log_dir), mode="online" if online else "offline", reinit="finish_previous",
                      settings=wandb.Settings(x_disable_meta=True) if private_argv else None)


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """All records of a metrics.jsonl; a later record for the same step (after a resume) wins."""
    by_step: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]
