"""The whole loop (`python -m megatron_dapo.train`) with --pack-sequences --fused-linear-logprob logs the
rewards, losses, entropies and grad norms of the default padded logits path, step by step."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import read_jsonl, train_cmd

pytestmark = pytest.mark.slow
STEPS = 2
COMPARED = ("rollout/reward", "train/pg_loss", "train/grad_norm", "train/entropy", "train/num_tokens",
            "train/approx_kl")


def test_packed_fused_linear_run_logs_the_padded_run(tiny_base, tmp_path):
    logs = {}
    for name, extra in (("padded", ()), ("packed", ("--pack-sequences", "--fused-linear-logprob"))):
        run = tmp_path / name
        cmd = train_cmd(tiny_base, run, *extra)
        cmd[cmd.index("--num-steps") + 1] = str(STEPS)
        subprocess.run(cmd, cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=600)
        logs[name] = read_jsonl(run / "log" / "metrics.jsonl")
    assert sorted(logs["packed"]) == sorted(logs["padded"]) and len(logs["padded"]) == STEPS
    for step, want in logs["padded"].items():
        got = logs["packed"][step]
        for key in COMPARED:
            assert key in want, key
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step, key)
