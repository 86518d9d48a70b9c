"""The final-number verifier (--reward-fn last_number) on prose answers."""

from __future__ import annotations

import pytest

from megatron_dapo.reward import RewardResult, get_reward_fn
from megatron_dapo.reward.last_number import compute_score, last_number


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
