"""What the tests against a real CPU SGLang 0.5.23 server share: its Python, the tiny model, a free port, the config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.rollout.sglang.server import ServerConfig
from tests.ports import free_port, free_port_block  # noqa: F401  (free_port re-exported)

SGLANG_PY = Path(__file__).resolve().parents[2] / ".venv-sglang" / "bin" / "python"
MARKS = [
    pytest.mark.sglang,
    pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`"),
]
"""pytestmark of a module that starts real servers: skipped without the CPU SGLang environment."""
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1,
           bos_token_id=0)


MODEL_TYPE = Qwen2Config.model_type
"""The family of `tiny_model`: the real-server tests push weights into it in every mode (test_sglang_families.py runs
the other registered families)."""


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 (CFG); each seed gives other weights, for weight-update checks."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**CFG)).eval()


QUICK_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
"""ServerProcess.stop sends SIGTERM to the whole process group: the scheduler dies first, and SGLang 0.5.23's
launcher takes that for a crash and, with these on (its default), sleeps 5 s "to let GPU activity settle" before
py-spy / CUDA-coredump diagnostics (tokenizer_manager.py dump_requests_before_crash). Off: a stop takes ~1 s
instead of ~6 s, for every server a test stops or restarts."""


def cpu_server_config(root: Path, **overrides) -> ServerConfig:
    """One fp32 CPU server of the model saved under root/model, logs in root/logs; `env` overrides are added to
    OMP_NUM_THREADS=1 and QUICK_STOP_ENV."""
    ports = free_port_block(overrides.get("num_servers", 1) + 1)  # the servers and a router
    env = {"OMP_NUM_THREADS": "1", **QUICK_STOP_ENV, **overrides.pop("env", {})}
    fields = dict(model_path=str(root / "model"), base_port=ports, device="cpu",
                  python=str(SGLANG_PY), startup_timeout_s=400, log_dir=str(root / "logs"),
                  extra_args=("--dtype", "float32"), env=env)
    return ServerConfig(**{**fields, **overrides})


def sglang_train_cmd(base: Path, log_dir: Path, reward: tuple[str, ...], port: int, *extra: str) -> list[str]:
    """`python -m megatron_dapo.train` on the tiny base (tests/conftest.py tiny_base) with its rollouts from a CPU
    SGLang server it launches (fp32, base port `port`): 3 steps of 4 prompts x 4 samples of up to 12 tokens, scored by
    `reward` (tests/rewards.py), metrics under `log_dir`; then `extra`."""
    return [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
            "--prompt-data", str(base / "train.jsonl"), "--num-steps", "3", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *reward, "--max-response-length", "12",
            "--overlong-buffer-length", "10", "--lr", "1e-3", "--log-dir", str(log_dir), "--no-wandb",
            "--no-progress", "--seed", "7", "--rollout-engine", "sglang", "--sglang-python", str(SGLANG_PY),
            "--sglang-extra-args", "--dtype float32", "--sglang-base-port", str(port), "--max-prompt-length", "16",
            *extra]


def max_logprob_error(model, samples) -> float:
    """Largest |server log-prob - teacher-forced HF log-prob| over every response token of `samples`."""
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = model(ids).logits[0].log_softmax(-1)[len(s.prompt_ids) - 1 : -1]
        ref = lp.gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst
