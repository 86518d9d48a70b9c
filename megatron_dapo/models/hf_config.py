"""The architecture facts of an HF Qwen2 / Qwen2.5 checkpoint, read once from its config.json.

Every other module (model provider, converter, weight sync, rollout) takes a `Qwen2Arch` rather
than a raw HF config, so a field is parsed and validated in one place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2",)


@dataclass(frozen=True, kw_only=True)
class Qwen2Arch:
    """Qwen2-family decoder: RMSNorm, SwiGLU MLP, RoPE, GQA attention with q/k/v bias only."""

    vocab_size: int
    """Rows of the HF embedding (before any TP padding)."""
    hidden_size: int
    intermediate_size: int
    """SwiGLU inner size (gate and up projections each have this many rows)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Query groups (GQA); equals num_heads for plain multi-head attention."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("config.json: rms_norm_eps and rope_theta must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Parameter count of the HF model (untied head counted once more when untied)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) + self.q_size * h
        layer = attn + 3 * h * f + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, config: Any) -> Qwen2Arch:
        """Build from an HF config: a dict, a `PretrainedConfig`, a config.json path or its directory."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no HF config at {path}: pass the model directory with config.json")
            with open(path) as f:
                config = json.load(f)
        elif not isinstance(config, dict):
            config = config.to_dict()
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in config]
        if missing:
            raise ValueError(f"config.json is missing {missing}")
        num_heads = config["num_attention_heads"]
        rope_theta = config.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
