"""A final-number verifier for short arithmetic answers (registered as "last_number").

R(y_hat, y) = +1 if the last integer in the response equals the integer ground truth, else -1, the same
+1 / -1 scale as DAPO's verifier (math_dapo.py). Meant for small chat models that answer in prose
("... so Tom has 14 + 11 = 25 coins.") rather than in DAPO's "Answer: ..." format: the number that ends the
response is the answer, so a model that keeps writing after a right result (a new, wrong equation) is wrong.
Thousands separators ("1,250") are read as one number; decimals count only when they are whole ("25.0").
Only the last RESPONSE_WINDOW_CHARS characters are read (DAPO's window), so the cost is linear and bounded.
"""

from __future__ import annotations

import re

from megatron_dapo.reward.math_dapo import RESPONSE_WINDOW_CHARS
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
    return str(int(whole))


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
