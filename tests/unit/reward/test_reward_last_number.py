"""The final-number verifier (--reward-fn last_number) on prose answers."""

from __future__ import annotations

import sys

import pytest

from megatron_dapo.reward import RewardResult, get_reward_fn
from megatron_dapo.reward.last_number import canonical_integer, compute_score, last_number


@pytest.mark.parametrize("text, want", [
    pytest.param("Sam has 14 + 11 = 25 coins now.", "25", id="equation"),
    pytest.param("There are 1,250 apples.", "1250", id="thousands"),
    pytest.param("It is 25.0 in all.", "25", id="whole-decimal"),
    pytest.param("Each gets 2.5 cookies.", "2.5", id="fraction"),
    pytest.param("The change is -3.", "-3", id="negative"),
    pytest.param("No idea.", None, id="none"),
    pytest.param("Tom has 13 coins.\nTom has 13 + 1 = 14 coins.", "14", id="last-wins"),
])
def test_last_number(text, want):
    assert last_number(text) == want


def test_scores_and_registry():
    fn = get_reward_fn("last_number")
    assert fn is compute_score
    assert fn("So Tom has 7 + 5 = 12 apples.", "12") == RewardResult(score=1.0, acc=True, pred="12")
    # a right result followed by more (wrong) arithmetic is wrong: the last number is the answer
    assert fn("7 + 5 = 12. Then 12 + 1 = 13.", "12") == RewardResult(score=-1.0, acc=False, pred="13")
    assert fn("I do not know.", "12") == RewardResult(score=-1.0, acc=False, pred=None)
    with pytest.raises(TypeError, match="ground_truth must be str"):
        fn("12", 12)  # type: ignore[arg-type]


def test_only_the_verified_window_counts():
    assert compute_score("The answer is 12." + " filler" * 30, "12").pred == "12"  # inside the 300-char window
    assert compute_score("12" + " filler" * 100, "12").pred is None


_HUGE = "9" + "0123456789" * 10_000  # 100,001 digits: beyond Python's 4300-digit int-string limit


def test_huge_numbers_compare_as_digit_strings():
    """Issue 38.7: a 100,000-digit answer was fed to int() and raised; now it is compared as canonical text."""
    assert 0 < sys.get_int_max_str_digits() < len(_HUGE)
    assert last_number(f"it is {_HUGE}") == _HUGE
    assert last_number(f"it is 000{_HUGE}.000") == _HUGE  # leading zeros and a whole decimal: one integer
    assert last_number("-" + _HUGE) == "-" + _HUGE
    assert last_number("-" + "0" * 100_000) == "0"
    head = len(_HUGE) % 3 or 3
    grouped = _HUGE[:head] + "".join("," + _HUGE[i:i + 3] for i in range(head, len(_HUGE), 3))
    assert last_number(grouped) == _HUGE  # thousands separators over the whole length
    # the ground truth is read whole, the response only in its 300-character window
    assert compute_score("The answer is 5.", _HUGE) == RewardResult(score=-1.0, acc=False, pred="5")
    big = _HUGE[:250]  # fits the window: equal and unequal huge-looking integers
    assert compute_score(f"so it is {big}.", "00" + big).acc
    off_by_one_digit = big[:-1] + str((int(big[-1]) + 1) % 10)
    assert not compute_score(f"so it is {off_by_one_digit}.", big).acc


@pytest.mark.parametrize("number", ["0", "-0", "007", "-007", "123", "\u0663\u0664", "-\u0660\u0661", "1" * 50])
def test_canonical_integer_is_str_of_int(number):
    assert canonical_integer(number) == str(int(number))


def _python_lines(fn, *args) -> int:
    """How many Python lines `fn(*args)` executes (sys.settrace 'line' events, every frame)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def test_huge_answer_cost_is_linear():
    """A timing-free cost argument: the Python steps of scoring do not grow with the answer's digits (same line
    count at 1,000 and 100,000 digits), so what grows is single C passes over the text (a regex without nested
    quantifiers, str.replace / partition / lstrip), each linear; and no int() of it (that would raise, above)."""
    short, long = _python_lines(compute_score, "5", _HUGE[:1000]), _python_lines(compute_score, "5", _HUGE)
    assert short == long
