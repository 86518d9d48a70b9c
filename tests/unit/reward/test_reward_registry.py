"""Reward functions by name (registered beside their definitions; every one gets the contract check) and by dotted
path."""

from __future__ import annotations

import re
import sys

import pytest

from megatron_dapo.errors import UserError
from megatron_dapo.reward import BUILTIN_REWARD_FNS, RewardResult, compute_score, get_reward_fn, last_number, math_dapo


def test_builtin_names():
    assert get_reward_fn("math_dapo")("Answer: 7", "7") == compute_score("Answer: 7", "7")
    boxed = get_reward_fn("math_dapo_boxed")
    assert boxed("\\boxed{7}", "7").acc and not boxed("Answer: 7", "7").acc


def test_the_registry_holds_the_functions_registered_beside_their_definitions():
    assert dict(BUILTIN_REWARD_FNS) == {"math_dapo": math_dapo.compute_score,
                                        "math_dapo_boxed": math_dapo.compute_score_boxed,
                                        "last_number": last_number.compute_score}


@pytest.mark.parametrize("name", list(BUILTIN_REWARD_FNS))
def test_every_registered_reward_fn_keeps_the_contract(name):
    """By name it is the function itself (no wrapper), and it returns a RewardResult on +1 / -1 for a right and a
    wrong answer in the format every verifier here reads (an "Answer:" line holding a boxed number)."""
    fn = get_reward_fn(name)
    assert fn is BUILTIN_REWARD_FNS[name]
    right, wrong = fn("so Answer: \\boxed{7}", "7"), fn("so Answer: \\boxed{8}", "7")
    assert isinstance(right, RewardResult) and (right.score, right.acc) == (1.0, True)
    assert isinstance(wrong, RewardResult) and (wrong.score, wrong.acc) == (-1.0, False)


def test_dotted_paths_both_spellings():
    module = "megatron_dapo.reward.math_dapo"
    for path in (f"{module}:compute_score", f"{module}.compute_score"):
        assert get_reward_fn(path)("Answer: 3", "3") == RewardResult(score=1.0, acc=True, pred="3")


def test_user_return_values_are_coerced():
    # math.copysign(x, y) is a two-argument callable returning a float: a stand-in user function.
    fn = get_reward_fn("math:copysign")
    assert fn(2.0, -1.0) == RewardResult(score=-2.0, acc=False)  # type: ignore[arg-type]


def test_user_function_bad_return_names_path():
    """A reward that is not a number stops the run with one line (a UserError: `error: ...`, exit 2) naming the
    function, the type and value it returned and what it must return; it was a TypeError's traceback."""
    fn = get_reward_fn("os.path:join")  # returns a str
    with pytest.raises(UserError) as info:
        fn("a", "b")
    assert str(info.value) == ("--reward-fn 'os.path:join' returned str ('a/b'): it must return a RewardResult, a "
                               "number, or a dict with a numeric 'score' key")


def _returns(value):
    return lambda solution_str, ground_truth: value


@pytest.mark.parametrize("value, says", [
    pytest.param({"score": "1"}, "returned a dict whose 'score' is str ('1'): it must return", id="dict-str-score"),
    pytest.param(None, "returned NoneType (None): it must return", id="none"),
    pytest.param(True, "returned bool (True): it must return", id="bool"),
    pytest.param(float("nan"), "returned a score of nan: a reward must be a finite number", id="nan"),
    pytest.param({"score": float("inf")}, "returned a score of inf: a reward must be", id="dict-inf"),
])
def test_user_function_non_numbers_are_one_line_naming_the_function(monkeypatch, value, says):
    import types

    module = types.ModuleType("user_rewards")
    module.fn = _returns(value)
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    with pytest.raises(UserError, match=rf"^--reward-fn 'user_rewards:fn' {re.escape(says)}"):
        get_reward_fn("user_rewards:fn")("x", "y")


def test_user_function_numbers_and_dicts_are_kept(monkeypatch):
    import types

    module = types.ModuleType("user_rewards_ok")
    module.as_int, module.as_dict = _returns(2), _returns({"score": -1, "pred": "7"})
    monkeypatch.setitem(sys.modules, "user_rewards_ok", module)
    assert get_reward_fn("user_rewards_ok:as_int")("x", "y") == RewardResult(score=2.0, acc=True)
    assert get_reward_fn("user_rewards_ok:as_dict")("x", "y") == RewardResult(score=-1.0, acc=False, pred="7")


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
