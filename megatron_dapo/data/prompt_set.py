"""A prompt file -> the token-id prompts of a run (--prompt-data, --eval-prompt-data), within the length limits."""

from __future__ import annotations

from megatron_dapo.data.length import PromptLengthLimit, default_max_prompt_chars, encode_within_limits
from megatron_dapo.data.loading import load_prompts
from megatron_dapo.data.template import render_prompt
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.types import Prompt

PROMPT_FORMATS = ("chat", "raw")
"""--prompt-format: chat applies the tokenizer's chat template to the prompt messages, raw uses their text."""


def load_prompt_set(path: str, tokenizer, *, prompt_format: str, max_prompt_length: int,
                    max_prompt_chars: int | None = None, on_long_prompt: str = "skip", limit: int | None = None,
                    flag: str | None = None) -> list[Prompt]:
    """Dataset rows -> token-id prompts within the length limits; every row is read and validated.

    A prompt over `max_prompt_chars` (default: data.default_max_prompt_chars) is measured, never
    tokenized; one over `max_prompt_length` tokens after the template is skipped (counted) or, with
    on_long_prompt="error", rejected. Any problem raises UserError, prefixed with `flag`, the flag
    that named `path`, when given.
    """
    def encode(record) -> list[int]:
        if prompt_format == "chat":
            return render_prompt(record, tokenizer)
        return tokenizer.encode("\n".join(m["content"] for m in record.messages), add_special_tokens=False)

    prefix = f"{flag} " if flag else ""
    limits = PromptLengthLimit(max_tokens=max_prompt_length, on_long=on_long_prompt,
                               max_chars=max_prompt_chars or default_max_prompt_chars(max_prompt_length))
    try:
        kept, report = encode_within_limits(load_prompts(path, limit=limit), encode, limits, source=str(path))
    except (UserError, FileNotFoundError) as err:
        raise UserError(f"{prefix}{err}") from err
    if not kept:
        raise UserError(f"{prefix}{path}: no prompt is within --max-prompt-length {max_prompt_length} tokens and "
                        f"--max-prompt-chars {limits.max_chars} ({report.over_tokens} over the tokens, "
                        f"{report.over_chars} over the characters)")
    if report.over_chars or report.over_tokens:
        print(f"[megatron-dapo] {path}: skipped {report.over_tokens} prompts longer than {max_prompt_length} "
              f"tokens and {report.over_chars} longer than {limits.max_chars} characters (--on-long-prompt skip)")
    return [Prompt(prompt_ids=ids, ground_truth=r.ground_truth, index=r.index) for r, ids in kept]
