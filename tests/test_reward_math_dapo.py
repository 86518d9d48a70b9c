"""DAPO verifier: hand-written cases, the 300-character window, strict-boxed mode, adversarial input."""

from __future__ import annotations

import time

import pytest

from megatron_dapo.reward import RewardResult, compute_score
from megatron_dapo.reward.math_dapo import extract_answer, last_boxed_content

# (response, ground truth, expected acc, expected normalised pred)
CASES = [
    pytest.param("2 + 40 = 42.\nAnswer: 42", "42", True, "42", id="plain"),
    pytest.param("Answer: 41", "42", False, "41", id="wrong"),
    pytest.param("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}", id="boxed-frac"),
    pytest.param("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}", id="frac-shorthand"),
    pytest.param("Answer: 0.5", "\\frac12", False, "0.5", id="no-numeric-equivalence"),
    pytest.param("Answer: 1,000", "1000", True, "1000", id="thousands-comma"),
    pytest.param("Answer: 1000", "1,000", True, "1000", id="gt-normalised-too"),
    pytest.param("Answer: 10 dollars", "10", True, "10", id="unit-word"),
    pytest.param("Answer: x = 5", "5", True, "5", id="equation"),
    pytest.param("answer: 7", "7", True, "7", id="lowercase"),
    pytest.param("ANSWER : 7", "7", True, "7", id="uppercase-space-before-colon"),
    pytest.param("Answer:\n13", "13", True, "13", id="answer-on-next-line"),
    pytest.param("Answer: 3\nNo wait.\nAnswer: 4", "4", True, "4", id="last-answer-wins"),
    pytest.param("Answer: 3\nNo wait.\nAnswer: 4", "3", False, "4", id="earlier-answer-ignored"),
    pytest.param("Answer: $\\text{(B)}$", "(B)", True, "(B)", id="dollar-text-choice"),
    pytest.param("Answer: 90^\\circ", "90", True, "90", id="degrees"),
    pytest.param("Answer: 3 \\sqrt2", "3\\sqrt{2}", True, "3\\sqrt{2}", id="sqrt-shorthand"),
    pytest.param("Answer: 5", "\\boxed{5}", True, "5", id="boxed-ground-truth"),
    pytest.param("The answer is 42.", "42", False, None, id="no-answer-line"),
    pytest.param("", "42", False, None, id="empty-response"),
]


@pytest.mark.parametrize("response, truth, acc, pred", CASES)
def test_verifier_cases(response, truth, acc, pred):
    result = compute_score(response, truth)
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_window_is_the_last_300_characters():
    head = "Answer: 42\n"
    inside = head + "z" * (300 - len(head))  # exactly 300 characters: the answer is seen
    outside = head + "z" * (301 - len(head))  # one more: the window starts at "nswer: 42"
    assert len(inside) == 300 and compute_score(inside, "42").acc
    result = compute_score(outside, "42")
    assert (result.acc, result.pred, result.score) == (False, None, -1.0)


def test_answer_before_window_falls_back_to_later_answer():
    text = "Answer: 1\n" + "." * 400 + "\nAnswer: 2"
    assert compute_score(text, "2").acc and not compute_score(text, "1").acc


@pytest.mark.parametrize(
    "response, truth, acc, pred",
    [
        pytest.param("so we get \\boxed{42}.", "42", True, "42", id="boxed"),
        pytest.param("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}", id="nested-braces"),
        pytest.param("\\boxed{1} or rather \\boxed{2}", "2", True, "2", id="last-box-wins"),
        pytest.param("\\boxed{ 42 }", "42", False, " 42 ", id="no-normalisation"),
        pytest.param("\\boxed{1,000}", "1000", False, "1,000", id="no-comma-removal"),
        pytest.param("Answer: 42", "42", False, None, id="answer-line-not-enough"),
        pytest.param("\\boxed{42", "42", False, None, id="unclosed"),
        pytest.param("\\boxed{42}\n" + "w" * 100, "42", False, None, id="outside-100-chars"),
    ],
)
def test_strict_box_mode(response, truth, acc, pred):
    result = compute_score(response, truth, strict_box=True)
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_extract_answer_and_box_helpers():
    assert extract_answer("Answer: a\nanswer:b") == "b"
    # Matches never overlap: the first match consumes the rest of its line, "Answer:" included.
    assert extract_answer("Answer: the Answer: 5") == "the Answer: 5"
    assert extract_answer("no colon here") is None
    assert last_boxed_content("\\boxed{a{b}c} \\boxed{}") == ""
    assert last_boxed_content("\\boxed{a{b}c}") == "a{b}c"


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="solution_str must be str"):
        compute_score(None, "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ground_truth must be str.*str\\(\\)"):
        compute_score("Answer: 1", 1)  # type: ignore[arg-type]


_MB = 1_000_000


@pytest.mark.parametrize("strict_box", [False, True], ids=["answer-mode", "boxed-mode"])
@pytest.mark.parametrize(
    "response",
    [
        pytest.param("{" * _MB, id="braces"),
        pytest.param("Answer:" * (_MB // 7), id="answer-repeats"),
        pytest.param("Answer:\n" * (_MB // 8), id="answer-newline-repeats"),
        pytest.param("\\boxed{" * (_MB // 7), id="box-repeats"),
    ],
)
def test_adversarial_responses_finish_fast(response, strict_box):
    start = time.perf_counter()
    result = compute_score(response, "42", strict_box=strict_box)
    elapsed = time.perf_counter() - start
    assert not result.acc and result.score == -1.0
    assert elapsed < 2.0, f"{elapsed:.2f}s"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("Answer:" * (_MB // 7), id="answer-repeats"),
        pytest.param("answer  " * (_MB // 8), id="answer-no-colon"),
        pytest.param("Answer:" + "\n" * _MB, id="answer-then-newlines"),
    ],
)
def test_helpers_are_linear_on_unwindowed_input(text):
    start = time.perf_counter()
    extract_answer(text)
    last_boxed_content("\\boxed{" + text)
    assert time.perf_counter() - start < 2.0


def test_long_ground_truth_is_fast():
    start = time.perf_counter()
    assert not compute_score("Answer: 1", "{" * _MB + "\\text{" * (_MB // 6)).acc
    assert time.perf_counter() - start < 2.0


def test_huge_number_answers_never_raise():
    """Issue 38.7's answers for the DAPO verifier: compared as normalised text (never int()), so any length works;
    a 100,000-digit ground truth cannot fit the 300-character window and is simply wrong."""
    huge = "9" + "0123456789" * 10_000
    assert compute_score("Answer: 5", huge) == RewardResult(score=-1.0, acc=False, pred="5")
    assert compute_score("Answer: 5", "1,000," + huge[:99_999]).acc is False
    big = huge[:280]
    assert compute_score(f"Answer: {big}", big).acc
    assert not compute_score(f"Answer: {big[:-1]}{(int(big[-1]) + 1) % 10}", big).acc
