"""Rollout: the RolloutEngine interface, the embedded CPU engine and the SGLang server engine."""

from __future__ import annotations

from typing import Any

from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams

ENGINE_KINDS = ("embedded", "sglang")


def make_engine(kind: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """Builds an engine by --rollout-engine name.

    "embedded": EmbeddedEngine(model_dir_or_config, *, arch, state_dict, tokenizer, dtype, max_batch_size, seed);
    a model directory comes with its ModelArch (`arch`, ModelArch.from_hf of it).
    "sglang": SGLangEngine(ServerConfig(...) or server_urls=[...], *, client=ClientConfig(...), router_url).
    """
    if kind == "embedded":
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine(*args, **kwargs)
    if kind == "sglang":
        from megatron_dapo.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(*args, **kwargs)
    raise ValueError(f"--rollout-engine must be one of {ENGINE_KINDS}, got {kind!r}")


__all__ = ["ENGINE_KINDS", "RolloutEngine", "RolloutRequest", "Sample", "SamplingParams", "make_engine"]
