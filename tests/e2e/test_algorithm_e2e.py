"""`python -m megatron_dapo.train --policy-loss gspo --advantage-estimator dr_grpo`: the chosen loss and
estimator run through the whole loop (rollout, advantages, actor step, weight sync) on CPU; a dotted-path loss's
own metric reaches metrics.jsonl."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, train_env
from tests.losses import POLICY_LOSS
from tests.rewards import PARITY_REWARD

pytestmark = pytest.mark.slow


def run_train(base: Path, log: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
           "--prompt-data", str(base / "train.jsonl"), "--num-steps", "2", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "12",
           "--overlong-buffer-length", "10", "--lr", "1e-3", "--global-batch-size", "8", "--log-dir", str(log),
           "--no-progress", "--no-wandb", "--seed", "7", "--max-prompt-length", "16", *extra]
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_gspo_with_dr_grpo_advantages_trains(tiny_base, tmp_path):
    default = run_train(tiny_base, tmp_path / "default")
    chosen = run_train(tiny_base, tmp_path / "gspo", "--policy-loss", "gspo", "--advantage-estimator", "dr_grpo",
                       "--clip-ratio-low", "3e-4", "--clip-ratio-high", "4e-4")
    assert [r["step"] for r in chosen] == [1, 2]
    # step 1 generates from the same weights with the same seeds: the same responses and rewards ...
    assert chosen[0]["rollout/reward"] == default[0]["rollout/reward"]
    assert chosen[0]["train/responses"] == default[0]["train/responses"]
    # ... but other advantages: R - mean, whose mean |.| over +-1 rewards is at most 1, not grpo's (R - mean) / std
    # (the two differ wherever a group of 4 splits 2/2: std sqrt(4/3))
    assert chosen[0]["train/advantage_abs_mean"] != pytest.approx(default[0]["train/advantage_abs_mean"])
    assert chosen[0]["train/advantage_abs_mean"] <= 1.0 + 1e-9
    for record in chosen:
        assert record["train/grad_norm"] > 0
        assert math.isfinite(record["train/pg_loss"])
    # the second mini-batch of a step is off-policy: GSPO's 4e-4 clip range on sequence ratios engages
    assert any(r["train/clipfrac_high"] + r["train/clipfrac_low"] > 0 for r in chosen)
    record = json.loads((tmp_path / "gspo" / "run_config.json").read_text())
    assert record["policy_loss"] == "gspo" and record["advantage_estimator"] == "dr_grpo"
    assert record["config"]["trainer"]["advantage_estimator"] == "megatron_dapo.algorithm.advantages:dr_grpo_advantages"


def test_a_losss_declared_metric_is_logged(tiny_base, tmp_path):
    """--policy-loss tests.losses:neg_adv_loss declares 'neg_adv_tokens' beside the shared metrics: it is logged as
    train/neg_adv_tokens (its token mean, a share of the tokens), and the shared ones are all still there."""
    (record,) = run_train(tiny_base, tmp_path / "own", *POLICY_LOSS, "--num-steps", "1")
    assert 0.0 < record["train/neg_adv_tokens"] < 1.0
    assert {f"train/{k}" for k in ("pg_loss", "clipfrac_high", "approx_kl", "ratio", "entropy", "num_tokens")} <= \
        set(record)
