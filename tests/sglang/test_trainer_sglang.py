"""The trainer with a real SGLang 0.5.23 server (CPU) as its rollout engine.

Every step's rollouts come from the server; after each step the actor's weights go to it through
update_weights_from_tensor. The rollout-vs-actor log-prob mismatch staying at fp32 noise on steps
2 and 3 shows the server really serves the updated weights (a stale server would differ by the
size of an update). Needs .venv-sglang (`make sglang-env`); skipped otherwise.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD
from tests.sglang.real_server import MARKS, sglang_train_cmd

pytestmark = [*MARKS, pytest.mark.slow]


def test_training_steps_with_an_sglang_server_follow_the_actor(tiny_base, tmp_path):
    cmd = sglang_train_cmd(tiny_base, tmp_path / "log", PARITY_REWARD, 31200, "--weight-sync-mode", "tensor")
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r
        assert r["train/grad_norm"] > 0
    assert records[1]["train/pg_loss"] != records[0]["train/pg_loss"]
