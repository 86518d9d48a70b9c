"""One prompt of a dataset, and the error raised for a malformed row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.errors import UserError


class DataFormatError(UserError):
    """A dataset row is malformed; the message names the file, the row and the field."""

    def __init__(self, path: str, row: int | None, field_name: str | None, problem: str) -> None:
        where = str(path)
        if row is not None:
            where += f": row {row}"
        if field_name is not None:
            where += f": field {field_name!r}"
        super().__init__(f"{where}: {problem}")
        self.path, self.row, self.field_name = str(path), row, field_name


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """A prompt ready for rollout: chat messages plus what the verifier needs."""

    messages: list[dict[str, str]]
    """Chat messages [{"role": ..., "content": ...}], the DAPO template already applied."""
    ground_truth: str
    """Reference answer given to the reward function."""
    data_source: str
    """Dataset name (e.g. "math_dapo"), for per-source metrics."""
    index: int
    """0-based row of the source file; repeats of one prompt (avg@k) share it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (e.g. extra_info, ability, url), passed through untouched."""

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("PromptRecord.messages must be a non-empty list of chat messages")
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"PromptRecord.messages[{i}] must be a dict with a str 'role'")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"PromptRecord.messages[{i}] must have a str 'content'")
        if not isinstance(self.ground_truth, str) or not self.ground_truth.strip():
            raise ValueError("PromptRecord.ground_truth must be a non-empty string")
        if not isinstance(self.data_source, str):
            raise ValueError("PromptRecord.data_source must be a string")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"PromptRecord.index must be an int >= 0, got {self.index!r}")
        if not isinstance(self.extra, dict):
            raise ValueError("PromptRecord.extra must be a dict")

    @property
    def prompt_text(self) -> str:
        """Content of the last user message (the problem statement with the template)."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return users[-1] if users else self.messages[-1]["content"]
