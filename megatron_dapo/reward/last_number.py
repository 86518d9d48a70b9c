"""A final-number verifier for short arithmetic answers (--reward-fn last_number).

R(y_hat, y) = +1 if the last integer in the response equals the integer ground truth, else -1, the same
+1 / -1 scale as DAPO's verifier (math_dapo.py). Meant for small chat models that answer in prose
("... so Tom has 14 + 11 = 25 coins.") rather than in DAPO's "Answer: ..." format: the number that ends the
response is the answer, so a model that keeps writing after a right result (a new, wrong equation) is wrong.
Thousands separators ("1,250") are read as one number; decimals count only when they are whole ("25.0").
Only the last RESPONSE_WINDOW_CHARS characters of the response are read (DAPO's window); the ground truth is
read whole. Numbers are compared as canonical digit strings, never through `int`: Python's int <-> str conversion
is quadratic in the digit count and refuses more than `sys.get_int_max_str_digits()` (4300) digits, while a
dataset may hold a 100,000-digit answer. So the cost is linear in len(ground_truth) + 300, whatever the lengths.
"""

from __future__ import annotations

import re
import unicodedata

from megatron_dapo.reward.math_dapo import RESPONSE_WINDOW_CHARS
from megatron_dapo.reward.registry import register_reward_fn
from megatron_dapo.reward.result import RewardResult

# An optional minus, digits with optional thousands groups, an optional decimal part. No nested quantifiers.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number of `text` as a canonical integer string ("1,250" -> "1250", "25.0" -> "25"), or None.

    A number with a non-zero fractional part is returned as written without commas ("2.5").
    """
    last = None
    for match in _NUMBER.finditer(text):
        last = match.group(0)
    if last is None:
        return None
    last = last.replace(",", "")
    whole, _, frac = last.partition(".")
    if frac.strip("0"):
        return last
    return canonical_integer(whole)


def canonical_integer(number: str) -> str:
    """`str(int(number))` for `number` matching `-?\\d+`, by string operations: linear in len(number), any length.

    Leading zeros go, "-0" is "0", and Unicode decimal digits (`\\d` matches them, as `int` accepts them) become
    ASCII ("\\u0663" -> "3"), so two spellings of one integer give one string.
    """
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    if not digits.isascii():
        digits = "".join(str(unicodedata.decimal(ch)) for ch in digits)
    digits = digits.lstrip("0")
    return sign + digits if digits else "0"


@register_reward_fn("last_number")
def compute_score(solution_str: str, ground_truth: str) -> RewardResult:
    """+1.0 when the response's last number equals the integer `ground_truth`, else -1.0 (pred: that number)."""
    if not isinstance(solution_str, str) or not isinstance(ground_truth, str):
        raise TypeError(
            "last_number.compute_score: solution_str and ground_truth must be str, got "
            f"{type(solution_str).__name__} and {type(ground_truth).__name__}"
        )
    pred = last_number(solution_str[-RESPONSE_WINDOW_CHARS:])
    truth = last_number(ground_truth)
    correct = pred is not None and pred == truth
    return RewardResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)
