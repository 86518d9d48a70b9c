"""The tool task: products of large numbers, which a tiny model cannot compute in its head and a one-line program can.

A problem is "482*937=" (each factor `ToolTask.min_digits`..`max_digits` digits, 3 by default: a product of 5 or 6
digits; the verifier reads the last "Answer:" line). A two-layer model of ~0.3 M parameters cannot multiply 3-digit
numbers: its direct answers are right about never. With the Python tool (`--tool-template code_fence`) the problem
is a copy:

    ```python
    print(482*937)
    ```
    ```output            <- the tool's tokens (the sandbox's stdout, appended by rollout/multi_turn.py;
    451634                  masked out of the loss)
    ```
    Answer: 451634

The warm-up (ReTool's cold start, `warmup_segments`): a share `ToolWarmup.call_prob` of the supervised responses call
the tool as above, the rest answer at once with a guess of the right number of digits. The base policy then calls
the tool on about that share of its samples, and DAPO, rewarded on the answer, has to find that calling pays: the
held-out accuracy and the tool-call rate rise together (examples/run_tool_demo.sh). The same base without a tool
(no --tool-template: a call gets no output back) has nothing to find.

Values come from the drawn numbers, never from evaluating text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_dapo.data.records import PromptRecord
from megatron_dapo.tool_use.templates import CODE_CLOSE, CODE_OPEN, ToolTemplate

TOOL_DATA_SOURCE = "synthetic_tool_product"
TOOL_MAX_RESPONSE_LENGTH = 72
"""Tokens (one a character): a call (~31), its output block (~23) and the answer line (~17) fit; a guess is ~17."""


@dataclass(frozen=True, kw_only=True)
class ToolTask:
    """Which problems are drawn: "a*b=" with a and b of min_digits..max_digits digits each, uniform."""

    min_digits: int = 3
    max_digits: int = 3
    prompt_template: str = "{expression}="

    def __post_init__(self) -> None:
        if not isinstance(self.min_digits, int) or not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"ToolTask: need 1 <= min_digits <= max_digits, got {self.min_digits}, "
                             f"{self.max_digits}")
        if "{expression}" not in self.prompt_template:
            raise ValueError("ToolTask.prompt_template must contain '{expression}'")


@dataclass(frozen=True, kw_only=True)
class ToolWarmup:
    """How the supervised warm-up answers: a call with share call_prob, else a guess."""

    call_prob: float = 0.5
    """Share of warm-up responses that call the tool (the rest guess)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.call_prob <= 1.0:
            raise ValueError(f"ToolWarmup.call_prob must be in [0, 1], got {self.call_prob!r}")


def _factor(rng: random.Random, task: ToolTask) -> int:
    digits = rng.randint(task.min_digits, task.max_digits)
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def make_tool_problems(n: int, *, seed: int, task: ToolTask | None = None) -> list[PromptRecord]:
    """`n` seeded problems; ground truth the product as a string; extra: expression, a, b."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"make_tool_problems: n must be an int >= 1, got {n!r}")
    task = task or ToolTask()
    rng = random.Random(seed)
    records = []
    for index in range(n):
        a, b = _factor(rng, task), _factor(rng, task)
        expression = f"{a}*{b}"
        records.append(PromptRecord(
            messages=[{"role": "user", "content": task.prompt_template.replace("{expression}", expression)}],
            ground_truth=str(a * b), data_source=TOOL_DATA_SOURCE, index=index,
            extra={"expression": expression, "a": a, "b": b}))
    return records


def warmup_segments(record: PromptRecord, rng: random.Random, style: ToolWarmup,
                    template: ToolTemplate) -> list[tuple[str, bool]]:
    """A warm-up response as (text, the policy's) segments, in order: with probability style.call_prob a call of
    `template` printing the expression, the tool's output block (not the policy's: out of the warm-up's loss as out
    of RL's) and the answer; otherwise a guess "Answer: <digits>" with as many digits as the product. Each segment is
    tokenized on its own, as a rollout's turns and tool outputs are."""
    value = record.ground_truth
    if rng.random() < style.call_prob:
        call = CODE_OPEN + f"print({record.extra['expression']})" + CODE_CLOSE
        return [(call, True), (template.render_output(value), False), (f"Answer: {value}", True)]
    guess = rng.randint(10 ** (len(value) - 1), 10 ** len(value) - 1)
    return [(f"Answer: {guess}", True)]
