"""Stopping on SIGTERM or SIGINT: the last finished step saved within --exit-save-timeout-s, then exit.

Slurm sends SIGTERM at a time limit, a preemption or a `scancel`, and SIGKILL `KillWait` seconds later (30 s by
default); torchrun passes a SIGTERM on to its workers and SIGKILLs them `--shutdown-timeout` seconds later (30 s by
default, TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Without a handler the trainer died at once and lost every step since its
last save (up to --save-interval steps: 10 steps of 20-45 minutes at 32B).

On every rank (`StopSignal.install`, from train.py):

- the first SIGTERM or SIGINT records the request and its time and starts a watchdog; a second SIGTERM changes
  nothing (Slurm signals every process of the step and torchrun passes its own on: each rank may see two); a second
  SIGINT exits at once (`exit_now`: one line, no traceback);
- the watchdog ends the process `timeout_s` after the signal whatever it is doing (`exit_now`), so the run is gone
  before the SIGKILL: global rank 0 (the --save lock holder) first removes any unfinished `step_N.tmp` (a save
  still being written, by this rank or another), so the previous checkpoint stays the newest step; exit status
  128 + the signal (143 for SIGTERM, 130 for SIGINT), never 0, which the Slurm jobs read as a finished run;
- the trainer acts at its next safe point (trainer/loop.py, `Trainer.run`): a step boundary, where the ranks agree
  (one gloo all-reduce of 8 bytes per step), or global rank 0's synchronous rollout, which it abandons
  (`abandonable`: the handler raises StopRequested there and rank 0 sends the waiting ranks a STOP instead of the
  batch). It then saves the last finished step unless it is saved already, and only when the save fits in what is
  left of `timeout_s` (judged by the slowest save of this run), and exits with the same status.

Processes forked by the trainer (dist_checkpointing's writers) inherit the handler and ignore the signal: they
finish their part of a save, and die with the trainer (checkpoint/procs.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

UNFINISHED = "step_*.tmp"
"""The directories of saves still being written (checkpoint/training.py), removed by `exit_now` on rank 0."""


class StopRequested(BaseException):
    """The run stops on a signal: raised where the trainer leaves its work (the abandoned rollout, its loop) and
    caught by train.py, which exits with `status`. A BaseException, like KeyboardInterrupt: the retry and
    recovery code of the rollout engines (`except Exception`) must not take it for a failed server."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StopSignal:
    """This process's stop request (see the module docstring). `timeout_s`: --exit-save-timeout-s; `save_dir`: on
    global rank 0 with --save, where `exit_now` removes unfinished saves (None elsewhere)."""

    timeout_s: float
    save_dir: Path | None = None
    signum: int | None = None
    """The first SIGTERM or SIGINT received; None until then."""
    received: float | None = None
    """When it arrived (time.time(): the ranks compare theirs, so a wall clock, not a monotonic one)."""
    _abandonable: bool = field(default=False, repr=False)
    _exiting: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _pid: int = field(default_factory=os.getpid, repr=False)

    def __post_init__(self) -> None:
        if not self.timeout_s >= 0:
            raise ValueError(f"--exit-save-timeout-s must be >= 0 seconds, got {self.timeout_s}")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def status(self) -> int:
        """The exit status of a stop: 128 + the signal (143 SIGTERM, 130 SIGINT), as a shell reports a kill."""
        return 128 + (self.signum or signal.SIGTERM)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process (main thread only, as Python's signal module requires)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked checkpoint writer: finish the write, die with the trainer
            return
        if self.signum is None:
            self.signum, self.received = signum, time.time()
            again = "; Ctrl-C again exits at once" if signum == signal.SIGINT else ""
            _say(f"[megatron-dapo] {self.name}: stopping at the next safe point (an unfinished rollout is abandoned), "
                 f"saving the last finished step and exiting within {self.timeout_s:g} s "
                 f"(--exit-save-timeout-s){again}")
            threading.Thread(target=self._watch, name="exit-save-timeout", daemon=True).start()
            if self._abandonable:
                raise StopRequested(self.status, f"{self.name} during the rollout")
        elif signum == signal.SIGINT:
            self.exit_now("a second SIGINT")

    def _watch(self) -> None:
        time.sleep(max(0.0, self.received + self.timeout_s - time.time()))
        self.exit_now(f"--exit-save-timeout-s {self.timeout_s:g} s passed")

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """Global rank 0's synchronous rollout: a stop request raises StopRequested in the body (at once if it came
        before), so the rollout is abandoned instead of run to its end (20-45 minutes a round at 32B)."""
        self._abandonable = True
        try:
            if self.requested:
                raise StopRequested(self.status, f"{self.name} before the rollout")
            yield
        finally:
            self._abandonable = False

    def left_s(self, first: float) -> float:
        """Seconds left of the bound for a stop whose first signal (on any rank) came at `first` (time.time())."""
        return first + self.timeout_s - time.time()

    def exit_now(self, reason: str) -> NoReturn:
        """End the process now (from the watchdog thread or a second SIGINT): rank 0 removes the unfinished saves
        (the previous checkpoint stays the newest step), one line, exit status `status`. No clean-up runs: the
        --save lock goes with the process (the next run takes it over), forked writers die with it."""
        self._exiting.acquire()  # the first caller exits; a second one waits here for that
        removed = remove_unfinished(self.save_dir) if self.save_dir is not None else []
        note = f"; removed the unfinished {', '.join(removed)}" if removed else ""
        _say(f"[megatron-dapo] {self.name}: exiting now ({reason}){note}; a run with --load resumes from the "
             f"newest complete step")
        os._exit(self.status)


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    """The SIGTERM and SIGINT handlers of the body's caller are put back when it ends (train.py: a process that runs
    the trainer in-process, as tests do, keeps its own Ctrl-C)."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def remove_unfinished(save_dir: Path, passes: int = 3, pause_s: float = 0.05) -> list[str]:
    """Remove the unfinished saves (`UNFINISHED`) of `save_dir`; their names. Each is first renamed to a hidden
    name that loading never reads, then deleted: a rename is atomic, so a save finishing at the same moment
    (renamed to step_N by its own rank) is either left whole or not found. A few passes `pause_s` apart catch a
    directory another rank was still creating."""
    removed: list[str] = []
    for attempt in range(passes):
        found = sorted(save_dir.glob(UNFINISHED))
        for tmp in found:
            trash = save_dir / f".removing-{tmp.name}-{os.getpid()}-{attempt}"
            try:
                os.rename(tmp, trash)
            except OSError:  # renamed or removed meanwhile
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(tmp.name)
        if not found:
            break
        time.sleep(pause_s)
    return sorted(set(removed))


def _say(line: str) -> None:
    """One line on stderr with a single write(2): safe in a signal handler or a second thread, where print() may
    meet the main thread inside the same buffered stream."""
    os.write(2, (line + "\n").encode(errors="replace"))
