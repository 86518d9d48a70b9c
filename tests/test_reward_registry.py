"""Reward functions by name and by dotted path."""

from __future__ import annotations

import pytest

from megatron_dapo.reward import RewardResult, compute_score, get_reward_fn


def test_builtin_names():
    assert get_reward_fn("math_dapo")("Answer: 7", "7") == compute_score("Answer: 7", "7")
    boxed = get_reward_fn("math_dapo_boxed")
    assert boxed("\\boxed{7}", "7").acc and not boxed("Answer: 7", "7").acc


def test_dotted_paths_both_spellings():
    module = "megatron_dapo.reward.math_dapo"
    for path in (f"{module}:compute_score", f"{module}.compute_score"):
        assert get_reward_fn(path)("Answer: 3", "3") == RewardResult(score=1.0, acc=True, pred="3")


def test_user_return_values_are_coerced():
    # math.copysign(x, y) is a two-argument callable returning a float: a stand-in user function.
    fn = get_reward_fn("math:copysign")
    assert fn(2.0, -1.0) == RewardResult(score=-2.0, acc=False)  # type: ignore[arg-type]


def test_user_function_bad_return_names_path():
    fn = get_reward_fn("os.path:join")  # returns a str
    with pytest.raises(TypeError, match="'os.path:join' returned str"):
        fn("a", "b")


@pytest.mark.parametrize(
    "path, message",
    [
        pytest.param("math_dap", "not a known reward function.*math_dapo", id="typo"),
        pytest.param("", "non-empty", id="empty"),
        pytest.param("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod'", id="no-module"),
        pytest.param("megatron_dapo.reward.math_dapo:nope", "has no attribute 'nope'", id="missing-attr"),
        pytest.param("megatron_dapo.reward.math_dapo:RESPONSE_WINDOW_CHARS", "not a function", id="constant"),
        pytest.param("os.path:exists", "cannot be called as fn", id="wrong-arity"),
        pytest.param("pkg:", "not a known name or a dotted path", id="empty-attr"),
    ],
)
def test_bad_paths_name_the_path(path, message):
    with pytest.raises(ValueError, match=message):
        get_reward_fn(path)
