"""Prompt length limits applied when a prompt set is loaded: characters first, then tokens.

The character bound is checked before a prompt is tokenized, so one pathological row (a 50 MB
prompt) costs a `len()` instead of a tokenizer pass over it (the fast Qwen2 tokenizer held ~19 GB
for 50 MB of text). It is a coarse guard, not the limit: the limit is --max-prompt-length tokens.
The default bound, CHARS_PER_TOKEN_BOUND x --max-prompt-length, is far above what text needs: with the
Qwen2.5 tokenizer the DAPO-Math-17k sample (data/) averages 3.78 characters per token and no prompt
exceeds 4.94, so the bound only catches prompts that could not fit in --max-prompt-length tokens
anyway. Only a prompt made mostly of the vocabulary's longest tokens (runs of spaces or dashes, up to
128 characters each) could fit in tokens yet exceed the bound; --max-prompt-chars raises it.
At the default 2048 tokens the tokenizer never sees more than 65,536 characters (well under 1 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_dapo.data.records import DataFormatError, PromptRecord

CHARS_PER_TOKEN_BOUND = 32
"""Default --max-prompt-chars per token of --max-prompt-length (2048 tokens -> 65,536 characters)."""
ON_LONG_PROMPT = ("skip", "error")
"""--on-long-prompt choices: drop (and count) a prompt over a limit, or stop naming its row."""


def default_max_prompt_chars(max_prompt_length: int) -> int:
    """--max-prompt-chars when not given: CHARS_PER_TOKEN_BOUND characters per allowed token."""
    return CHARS_PER_TOKEN_BOUND * max_prompt_length


def prompt_chars(record: PromptRecord) -> int:
    """Characters of the record's message contents (the chat template adds a bounded few more)."""
    return sum(len(m["content"]) for m in record.messages)


@dataclass(frozen=True, kw_only=True)
class PromptLengthLimit:
    max_tokens: int
    """--max-prompt-length: prompt tokens after the chat template."""
    max_chars: int
    """--max-prompt-chars: message characters, checked before tokenizing."""
    on_long: str = "skip"
    """--on-long-prompt: skip or error."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"--max-prompt-length must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.max_chars, bool) or not isinstance(self.max_chars, int) or self.max_chars < 1:
            raise ValueError(f"--max-prompt-chars must be an integer >= 1, got {self.max_chars!r}")
        if self.on_long not in ON_LONG_PROMPT:
            raise ValueError(f"--on-long-prompt must be one of {ON_LONG_PROMPT}, got {self.on_long!r}")


@dataclass(frozen=True)
class LengthReport:
    """How many prompts a limit dropped, by the check that dropped them."""

    over_chars: int = 0
    over_tokens: int = 0


def encode_within_limits(
    records: Sequence[PromptRecord], encode: Callable[[PromptRecord], list[int]], limit: PromptLengthLimit,
    *, source: str,
) -> tuple[list[tuple[PromptRecord, list[int]]], LengthReport]:
    """(record, token ids) of each prompt within `limit`, and the counts of those that were not.

    `encode` runs only on prompts within `limit.max_chars`. With on_long="error" the first prompt over a
    limit raises DataFormatError naming `source` (the file), its row and the flag.
    """
    kept: list[tuple[PromptRecord, list[int]]] = []
    over_chars = over_tokens = 0
    for record in records:
        chars = prompt_chars(record)
        if chars > limit.max_chars:
            _too_long(limit, source, record, f"{chars} characters > --max-prompt-chars={limit.max_chars}")
            over_chars += 1
            continue
        ids = encode(record)
        if len(ids) > limit.max_tokens:
            _too_long(limit, source, record, f"{len(ids)} tokens > --max-prompt-length={limit.max_tokens}")
            over_tokens += 1
            continue
        kept.append((record, ids))
    return kept, LengthReport(over_chars=over_chars, over_tokens=over_tokens)


def _too_long(limit: PromptLengthLimit, source: str, record: PromptRecord, what: str) -> None:
    if limit.on_long == "error":
        raise DataFormatError(source, record.index, "prompt",
                              f"{what} (--on-long-prompt=error; with skip such prompts are dropped and counted)")
