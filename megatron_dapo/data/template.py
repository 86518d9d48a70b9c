"""DAPO's prompt template and prompt rendering to token ids."""

from __future__ import annotations

from typing import Any

from megatron_dapo.data.records import PromptRecord

DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The user turn of DAPO-Math-17k (byte-identical to its parquet prompts); `{problem}` is filled."""


def apply_dapo_template(problem: str) -> str:
    """Wrap a raw problem statement in DAPO's template (the verifier expects "Answer: ...")."""
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("apply_dapo_template: problem must be a non-empty string")
    # str.replace rather than str.format: problems are LaTeX and contain '{' and '}'.
    return DAPO_PROMPT_TEMPLATE.replace("{problem}", problem)


def render_prompt_text(record: PromptRecord, tokenizer: Any, *, add_generation_prompt: bool = True) -> str:
    """The prompt string the model sees: the tokenizer's chat template when it has one.

    Without a chat template (base models, the synthetic char tokenizer) the message contents are
    joined by newlines, which for the usual single user turn is just its content.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            record.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    return "\n".join(m["content"] for m in record.messages)


def render_prompt(record: PromptRecord, tokenizer: Any, *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `render_prompt_text`: no BOS / EOS beyond what the chat template writes. Special-token
    text inside a message (a problem containing "<|im_end|>") is parsed as that special token, as HF's
    `apply_chat_template(tokenize=True)` does (SmolLM2: "a<|im_end|>b" -> [81, 2, 82])."""
    text = render_prompt_text(record, tokenizer, add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
