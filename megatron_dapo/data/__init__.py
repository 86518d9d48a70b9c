"""Prompt datasets, the DAPO template, the resumable sampler and the synthetic demo task."""

from megatron_dapo.data.length import (
    CHARS_PER_TOKEN_BOUND,
    ON_LONG_PROMPT,
    LengthReport,
    PromptLengthLimit,
    default_max_prompt_chars,
    encode_within_limits,
    prompt_chars,
)
from megatron_dapo.data.loading import load_prompts
from megatron_dapo.data.records import DataFormatError, PromptRecord
from megatron_dapo.data.sampler import ResumableSampler
from megatron_dapo.data.template import (
    DAPO_PROMPT_TEMPLATE,
    apply_dapo_template,
    render_prompt,
    render_prompt_text,
)

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "DAPO_PROMPT_TEMPLATE",
    "ON_LONG_PROMPT",
    "DataFormatError",
    "LengthReport",
    "PromptLengthLimit",
    "PromptRecord",
    "ResumableSampler",
    "apply_dapo_template",
    "default_max_prompt_chars",
    "encode_within_limits",
    "load_prompts",
    "prompt_chars",
    "render_prompt",
    "render_prompt_text",
]
