"""`python -m tests.die_at_log STEP <megatron_dapo.train flags>`: the trainer, SIGKILLed by itself the moment rank 0
is about to log step STEP's metrics record.

Every mode saves a step before it logs that step's record (Trainer._finish_step), so with a save due at STEP this
is a kill in the window between the checkpoint and the log line, every time: what a SIGKILL a few milliseconds after
the checkpoint appears hits by chance (tests/e2e/test_trainer_e2e.py `_kill_after_save`)."""

from __future__ import annotations

import os
import signal
import sys

from megatron_dapo import train
from megatron_dapo.trainer.metrics_log import MetricsLogger


def main(argv: list[str]) -> None:
    step = int(argv[0])
    log = MetricsLogger.log

    def log_or_die(self: MetricsLogger, at: int, metrics: dict[str, float]) -> None:
        if at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        log(self, at, metrics)

    MetricsLogger.log = log_or_die
    train.main(argv[1:])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
