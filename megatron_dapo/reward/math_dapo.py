"""DAPO's rule-based math verifier (arXiv 2503.14476, section 2.4 "Rule-based reward modelling").

Reward R(y_hat, y) = +1 if is_equivalent(y_hat, y) else -1, where equivalence is exact string
equality after Minerva normalisation (`normalize.normalize_final_answer`):

* default mode: the prediction is the text after the last case-insensitive "Answer:" in the last
  300 characters of the response (DAPO's window; the longest MATH-500 answer is 159 characters);
* strict-boxed mode: the prediction is the content of the last balanced \\boxed{...} in the last
  100 characters, compared to the ground truth without any normalisation.

Deviation from the reference implementation: a response with no "Answer:" (or no box) gets
pred=None and is always wrong; the reference compares the placeholder "[INVALID]" to the ground
truth instead, which differs only for a ground truth that normalises to "[INVALID]".

Nothing here evaluates text; every step is a bounded scan, so cost is linear in the input.
"""

from __future__ import annotations

import re

from megatron_dapo.reward.normalize import normalize_final_answer
from megatron_dapo.reward.registry import register_reward_fn
from megatron_dapo.reward.result import RewardResult

RESPONSE_WINDOW_CHARS = 300
"""Only the last this-many characters of a response are verified (DAPO's truncation)."""

STRICT_BOX_WINDOW_CHARS = 100
"""Strict-boxed mode looks for the box in the last this-many characters of that window."""

# "Answer", optional whitespace, ':', optional whitespace (newlines included), then the rest of a
# line. No nested quantifiers: each match attempt is linear in the whitespace run it consumes,
# and the runs of distinct attempts do not overlap, so a full scan is linear.
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOXED = "\\boxed{"


def extract_answer(text: str) -> str | None:
    """The raw text after the last "Answer:" of `text` (matches never overlap), or None."""
    last = None
    for match in _ANSWER_LINE.finditer(text):
        last = match.group(1)
    return last


def last_boxed_content(text: str) -> str | None:
    """Content of the last \\boxed{...} of `text` with balanced braces, or None if unclosed/absent."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOXED) - 1, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i]
    return None


def _check_inputs(solution_str: object, ground_truth: object) -> None:
    if not isinstance(solution_str, str):
        raise TypeError(f"compute_score: solution_str must be str, got {type(solution_str).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(
            f"compute_score: ground_truth must be str, got {type(ground_truth).__name__}; "
            "convert numeric answers with str() when building the dataset"
        )


@register_reward_fn("math_dapo")
def compute_score(solution_str: str, ground_truth: str, *, strict_box: bool = False) -> RewardResult:
    """Score one response against its ground truth: +1.0 if correct, -1.0 otherwise.

    `pred` is the normalised prediction (default mode) or the raw box content (strict mode), or
    None when the response has no answer in the verified window.
    """
    _check_inputs(solution_str, ground_truth)
    window = solution_str[-RESPONSE_WINDOW_CHARS:]
    if strict_box:
        pred = last_boxed_content(window[-STRICT_BOX_WINDOW_CHARS:])
        correct = pred is not None and pred == ground_truth
    else:
        raw = extract_answer(window)
        pred = None if raw is None else normalize_final_answer(raw)
        correct = pred is not None and pred == normalize_final_answer(ground_truth)
    return RewardResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


@register_reward_fn("math_dapo_boxed")
def compute_score_boxed(solution_str: str, ground_truth: str) -> RewardResult:
    """`compute_score` in strict-boxed mode."""
    return compute_score(solution_str, ground_truth, strict_box=True)
