"""`python -m megatron_dapo.train --load <hf-to-mcore output>` starts from its weights, not --hf-checkpoint's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from checkpoint_convert.cli import main as convert_main
from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD

pytestmark = pytest.mark.slow


def test_train_starts_from_converted_checkpoint_at_iteration_0(tiny_base: Path, tmp_path: Path) -> None:
    # A variant of the base policy (same config, other weights), converted; the run's --hf-checkpoint
    # stays the base, so the exported weights show which one the actor started from.
    variant = Qwen2ForCausalLM.from_pretrained(tiny_base / "model")
    with torch.no_grad():
        for p in variant.parameters():
            p.mul_(0.9)
    variant.save_pretrained(tmp_path / "variant")
    assert convert_main(["hf-to-mcore", "--hf-path", str(tmp_path / "variant"), "--save", str(tmp_path / "mc")]) == 0
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(tiny_base / "model"),
           "--prompt-data", str(tiny_base / "train.jsonl"), "--num-steps", "1", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "8",
           "--overlong-buffer-length", "4", "--max-prompt-length", "16", "--lr", "1e-30", "--weight-decay", "0",
           "--log-dir",
           str(tmp_path / "log"), "--load", str(tmp_path / "mc"), "--export-hf", str(tmp_path / "hf"),
           "--no-progress", "--no-wandb"]
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" not in out.stdout  # iteration 0, not a resume
    trained = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    base = Qwen2ForCausalLM.from_pretrained(tiny_base / "model").state_dict()
    for name, tensor in variant.state_dict().items():
        # lr 1e-30: one Adam step moves no weight by more than 1e-30
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=1e-29, msg=name)
    assert any(not torch.equal(trained[n], base[n]) for n in base)
    shutil.rmtree(tmp_path / "mc")
