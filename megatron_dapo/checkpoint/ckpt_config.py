"""Config checks that run before any tensor is read: a checkpoint's stored config against the flags.

A model that loads with the wrong rope theta, vocab or tied head trains silently wrong (slime #1059),
so every field that changes the maths is compared, and a mismatch is an error naming both values and
where each came from. Tensor geometry is checked from checkpoint metadata alone (global shapes), so a
wrong-sized checkpoint fails in milliseconds, not after gigabytes were read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.layout import global_shape
from megatron_dapo.weights.mapping import arch_mapping, dist_key
from megatron_dapo.weights.safetensors_io import CheckpointError

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# (label, function of the arch): every arch field that changes the forward pass.
_FIELDS: tuple[tuple[str, Callable[[ModelArch], Any]], ...] = (
    ("model_type", lambda a: a.model_type),
    ("vocab_size", lambda a: a.vocab_size),
    ("hidden_size", lambda a: a.hidden_size),
    ("intermediate_size", lambda a: a.intermediate_size),
    ("num_hidden_layers", lambda a: a.num_layers),
    ("num_attention_heads", lambda a: a.num_heads),
    ("num_key_value_heads", lambda a: a.num_kv_heads),
    ("head_dim", lambda a: a.head_dim),
    ("rope_theta", lambda a: a.rope_theta),
    ("rms_norm_eps", lambda a: a.rms_norm_eps),
    ("tie_word_embeddings", lambda a: a.tie_word_embeddings),
    ("qkv_bias", lambda a: a.qkv_bias),
    ("qk_layernorm", lambda a: a.qk_layernorm),
    ("family_options", lambda a: a.family_options),
)


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """A JSON object from `path`; errors name the file (and `what` points at, e.g. the flag)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: {path} not found")
    try:
        with open(path) as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what}: {path} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{what}: {path} holds a {type(value).__name__}, expected a JSON object")
    return value


def read_hf_config(model_dir_or_file: str | os.PathLike[str], *, flag: str) -> dict[str, Any]:
    """config.json of an HF model directory (or the file itself), with the file named in errors."""
    path = os.fspath(model_dir_or_file)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    return read_json(path, what=flag)


def config_dtype(hf_config: dict[str, Any]) -> torch.dtype | None:
    """The dtype config.json declares (`torch_dtype`, or `dtype` in transformers >= 5), if any."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return DTYPE_NAMES.get(name) if isinstance(name, str) else None


def check_same_arch(stored: ModelArch, requested: ModelArch, *, stored_from: str, requested_from: str) -> None:
    """Raise CheckpointError listing every architecture field where the two configs differ."""
    wrong = [
        f"{label}: {stored_from} has {get(stored)!r}, {requested_from} has {get(requested)!r}"
        for label, get in _FIELDS
        if get(stored) != get(requested)
    ]
    if wrong:
        raise CheckpointError("config mismatch:\n  " + "\n  ".join(wrong))


def check_dtype(declared: torch.dtype | None, actual: torch.dtype, *, declared_from: str, actual_from: str) -> None:
    if declared is not None and declared != actual:
        raise CheckpointError(
            f"dtype mismatch: {declared_from} declares {declared}, but the tensors of {actual_from} are {actual}; "
            "pass --dtype "
            "to cast deliberately"
        )


def expected_global_shapes(arch: ModelArch, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """dist-checkpoint key -> global shape of every model tensor of `arch` (tied: no output layer)."""
    return {
        dist_key(e): global_shape(e, arch, padded_vocab)
        for e in arch_mapping(arch)
        if not (e.tied_hf and arch.tie_word_embeddings)
    }


def check_global_shapes(shapes: dict[str, tuple[int, ...]], arch: ModelArch, *, source: str, against: str) -> int:
    """Check a dist checkpoint's tensor shapes (from metadata) against `arch`; return its padded vocab.

    The vocab may be padded to any multiple of 128 at or above vocab_size (megatron-core reshards the
    padding at load); every other shape must match exactly. Names the config field behind a mismatch:
    qkv rows -> num_key_value_heads, a missing bias -> qkv bias, an output layer -> tie_word_embeddings.
    """
    embedding = next(e for e in arch_mapping(arch) if e.kind == "vocab" and e.stage == "first")
    emb = shapes.get(dist_key(embedding))
    if emb is None:
        raise CheckpointError(f"{source} has no {dist_key(embedding)}: not a {arch.model_type} model checkpoint")
    padded = emb[0]
    if padded < arch.vocab_size or padded % 128:
        raise CheckpointError(
            f"vocab mismatch: {source} has {padded} embedding rows (padded vocab), {against} has vocab_size "
            f"{arch.vocab_size}, which pads to {padded_vocab_size(arch.vocab_size, 1)} (a multiple of 128)"
        )
    expected = expected_global_shapes(arch, padded)
    problems = []
    for key, want in expected.items():
        have = shapes.get(key)
        if have is None:
            hint = (f" (qkv bias: {arch.model_type} models have one)" if key.endswith("linear_qkv.bias")
                    else "")
            problems.append(f"{key}: missing in {source}{hint}")
        elif tuple(have) != want:
            problems.append(f"{key}: {source} has {list(have)}, {against} implies {list(want)}")
    if arch.tie_word_embeddings and "output_layer.weight" in shapes:
        problems.append(
            f"output_layer.weight: {source} has an untied output layer, {against} has tie_word_embeddings=true"
        )
    if problems:
        raise CheckpointError("checkpoint does not match the config:\n  " + "\n  ".join(problems[:10]))
    return padded
