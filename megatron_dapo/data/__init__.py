"""Prompt datasets, the DAPO template, the resumable sampler and the synthetic demo task."""

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
    "DAPO_PROMPT_TEMPLATE",
    "DataFormatError",
    "PromptRecord",
    "ResumableSampler",
    "apply_dapo_template",
    "load_prompts",
    "render_prompt",
    "render_prompt_text",
]
