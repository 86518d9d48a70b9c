"""The ablation's embedded task: a remainder by repeated subtraction, worked one line per subtraction.

A problem is "47 mod 6=" (a in 10..99, b in 4..9); the worked solution subtracts b until less than b is left,

    47-6=41
    41-6=35
    ...
    11-6=5
    Answer: 5

so it takes a // b lines, from 1 to 24, and 20 to ~200 tokens under the demo's character tokenizer (one token a
character). Every line is a local fact (copy the last result, subtract one digit), which a two-layer model
learns in minutes; what makes the task hard is its length. Each property is there to give one of DAPO's
techniques room to act:

- **Variable length, errors that compound.** One slip anywhere makes the final answer wrong, so accuracy falls
  with the number of lines and the long problems are the hard ones. A response's length says how much it had
  to work: the token-level loss (DAPO Sec. 3.3) weighs a long response's tokens as much as a short one's, where
  the sample-level mean shrinks each of them by the response's length.
- **Rambling and repeating** (`WarmupStyle.ramble_prob`): a share of the warm-up responses repeat a line a few
  times and slip more often after it; a few never stop repeating. They are the long, low-quality samples whose
  growth the token-level loss checks (DAPO Fig. 4), and most of the truncated ones.
- **A max response length the longest sound solutions do not fit** (`ABLATION_MAX_RESPONSE_LENGTH`, 160
  tokens, ~19 lines): a right solution of 20+ lines (b = 4, a >= 80), or a long one with a repeated line,
  is cut off and scores -1 like a wrong one. That is the reward noise overlong filtering masks and the soft
  punishment (Sec. 3.4) grades within its buffer.
- **A systematic mistake** (`WarmupStyle.early_stop_prob`): a third of the warm-up responses stop one
  subtraction early and answer a number >= b. It is made the same way on every problem, so a few dozen RL steps
  find it (as the demo's misreported sums); the per-line slips are what stays hard.
- **Real entropy** (`WarmupStyle.error_prob`): the warm-up writes a wrong difference on some lines, so the
  base policy samples with entropy in the digits and in whether to repeat. That entropy is what symmetric
  clipping collapses and Clip-Higher keeps (Sec. 3.1).
- **Base accuracy ~0.2-0.4:** most groups of 8 samples then hold both right and wrong answers; as training
  makes short problems all-correct while the longest stay all-wrong, the share of groups with zero advantage
  grows, which is what dynamic sampling (Sec. 3.2) removes from the batch.

Values come from the drawn numbers, never from evaluating text. The verifier is the DAPO one
(`--reward-fn math_dapo`, the last "Answer:" line).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_dapo.data.records import PromptRecord

REMAINDER_DATA_SOURCE = "synthetic_remainder"
ABLATION_MAX_RESPONSE_LENGTH = 160
"""Tokens: ~19 lines of work. Problems with 20+ lines (b = 4, a >= 80) cannot finish within it."""


@dataclass(frozen=True, kw_only=True)
class RemainderTask:
    """Which problems are drawn: "a mod b" with a and b uniform in their ranges."""

    min_dividend: int = 10
    """Smallest a (inclusive)."""
    max_dividend: int = 99
    """Largest a (inclusive); two digits keep every line the same width."""
    min_divisor: int = 4
    """Smallest b; a // b lines, so the smallest b gives the longest solutions."""
    max_divisor: int = 9
    """Largest b, one digit."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_dividend <= self.max_dividend <= 999:
            raise ValueError(
                "RemainderTask: need 1 <= min_dividend <= max_dividend <= 999, got "
                f"{self.min_dividend}, {self.max_dividend}"
            )
        if not 2 <= self.min_divisor <= self.max_divisor <= 9:
            raise ValueError(
                f"RemainderTask: need 2 <= min_divisor <= max_divisor <= 9, got {self.min_divisor}, "
                f"{self.max_divisor}"
            )


@dataclass(frozen=True, kw_only=True)
class WarmupStyle:
    """How the supervised warm-up's responses depart from the clean worked solution."""

    early_stop_prob: float = 0.35
    """Chance that a response stops one subtraction early (while a < 2b) and answers a number >= b: one
    systematic mistake, made at the end, that RL can find across all problems (as the demo's misreported sum)."""
    error_prob: float = 0.03
    """Chance that a line's difference is written off by 1-3 (the error carries into the later lines): the
    per-problem slips that make long problems hard."""
    ramble_prob: float = 0.2
    """Chance that a response repeats one of its lines (1-4 extra copies)."""
    ramble_error_factor: float = 3.0
    """error_prob is this many times higher on the lines after a repeat."""
    endless_prob: float = 0.1
    """Chance that a rambling response repeats its line until it is cut off at `max_chars`."""
    max_chars: int = ABLATION_MAX_RESPONSE_LENGTH
    """Where an endless response is cut (characters, = tokens of the character tokenizer); it gets no answer."""

    def __post_init__(self) -> None:
        for name in ("early_stop_prob", "error_prob", "ramble_prob", "endless_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"WarmupStyle.{name} must be in [0, 1], got {value}")
        if self.ramble_error_factor < 1.0:
            raise ValueError(f"WarmupStyle.ramble_error_factor must be >= 1, got {self.ramble_error_factor}")


def prompt_text(a: int, b: int) -> str:
    """The problem as the model sees it: "47 mod 6="."""
    return f"{a} mod {b}="


def solution_lines(a: int, b: int) -> list[str]:
    """The clean worked solution: "a-b=a'" lines while a >= b, then "Answer: a mod b"."""
    if b < 1 or a < 0:
        raise ValueError(f"solution_lines: need a >= 0 and b >= 1, got {a}, {b}")
    lines = []
    while a >= b:
        lines.append(f"{a}-{b}={a - b}")
        a -= b
    return [*lines, f"Answer: {a}"]


def solution_text(a: int, b: int) -> str:
    """The response a clean solver writes: a newline after the prompt's "=", the lines, no trailing newline."""
    return "\n" + "\n".join(solution_lines(a, b))


def warmup_response(a: int, b: int, rng: random.Random, style: WarmupStyle) -> str:
    """One warm-up response in `style`: the worked lines with an early stop, random slips and repeats; an endless
    one is cut at `style.max_chars` without an answer (the warm-up gives it no end-of-text either).

    A slip writes the difference off by 1-3 and the next lines go on from the written value, so the final
    answer is that of the written lines, as a real solver's would be."""
    stop_below = 2 * b if rng.random() < style.early_stop_prob else b
    steps = a // b
    rambles = steps > 0 and rng.random() < style.ramble_prob
    ramble_at = rng.randrange(steps) if rambles else -1
    endless = rambles and rng.random() < style.endless_prob
    lines, error_prob, line_no = [], style.error_prob, 0
    while a >= stop_below:
        value = a - b
        if rng.random() < error_prob:
            value = max(value + rng.choice((-3, -2, -1, 1, 2, 3)), 0)
        line = f"{a}-{b}={value}"
        lines.append(line)
        if line_no == ramble_at:
            if endless:
                text = "\n" + "\n".join(lines)
                while len(text) < style.max_chars:
                    text += "\n" + line
                return text[:style.max_chars]
            lines.extend([line] * rng.randint(1, 4))
            error_prob = min(1.0, style.error_prob * style.ramble_error_factor)
        a, line_no = value, line_no + 1
    return "\n" + "\n".join([*lines, f"Answer: {a}"])


def make_remainder_problems(n: int, *, seed: int, task: RemainderTask | None = None) -> list[PromptRecord]:
    """`n` seeded problems "a mod b=" (plain text, no chat template); ground truth is a % b as a string.

    `extra` holds a, b, the expression and the clean solution."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"make_remainder_problems: n must be an int >= 1, got {n!r}")
    task = task if task is not None else RemainderTask()
    rng = random.Random(seed)
    records = []
    for index in range(n):
        a = rng.randint(task.min_dividend, task.max_dividend)
        b = rng.randint(task.min_divisor, task.max_divisor)
        records.append(
            PromptRecord(
                messages=[{"role": "user", "content": prompt_text(a, b)}],
                ground_truth=str(a % b),
                data_source=REMAINDER_DATA_SOURCE,
                index=index,
                extra={"a": a, "b": b, "expression": f"{a} mod {b}", "reference_response": solution_text(a, b)},
            )
        )
    return records


def parse_prompt(text: str) -> tuple[int, int]:
    """"47 mod 6=" -> (47, 6); a ValueError naming the text otherwise."""
    left, sep, right = text.rstrip("=").partition(" mod ")
    if not (sep and left.isdigit() and right.isdigit()):
        raise ValueError(f"not a remainder problem (\"a mod b=\"): {text!r}")
    return int(left), int(right)


def sound_so_far(response: str, a: int, b: int) -> bool:
    """Whether every complete line of `response` is a right step of the worked solution of a mod b.

    A right step is the next line of `solution_lines`; a repeat of the line before is allowed (it is
    rambling, not an error). The last line is ignored when the response does not end in a newline (it may be
    cut mid-line). A truncated response for which this holds was sound work that ran out of room: its -1 is
    the reward noise of DAPO Sec. 3.4."""
    body = response.strip("\n")
    lines = body.split("\n") if body else []
    if lines and not response.endswith("\n"):
        lines = lines[:-1]
    expected = solution_lines(a, b)
    step, previous = 0, None
    for line in lines:
        if line == previous:
            continue
        if step >= len(expected) or line != expected[step]:
            return False
        previous, step = line, step + 1
    return True
