"""DAPO verifier: hand-written cases, the 300-character window, strict-boxed mode, adversarial input."""

from __future__ import annotations

import pytest

from megatron_dapo.reward import RewardResult, compute_score, math_dapo, normalize
from megatron_dapo.reward.math_dapo import (
    RESPONSE_WINDOW_CHARS,
    STRICT_BOX_WINDOW_CHARS,
    extract_answer,
    last_boxed_content,
)
from tests.unit.reward.test_reward_normalize import (
    EXAMINED_PER_CHAR,
    NORMALIZE_SCANS,
    ScanMeter,
    Scanned,
    meter_scans,
    run_with_cpu_budget,
)

# (response, ground truth, expected acc, expected normalised pred), answer mode (the default)
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

# the same in strict-boxed mode (compute_score(..., strict_box=True), --reward-fn math_dapo_boxed): pred is the last
# box's raw content
BOXED_CASES = [
    pytest.param("so we get \\boxed{42}.", "42", True, "42", id="boxed"),
    pytest.param("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}", id="nested-braces"),
    pytest.param("\\boxed{1} or rather \\boxed{2}", "2", True, "2", id="last-box-wins"),
    pytest.param("\\boxed{ 42 }", "42", False, " 42 ", id="no-normalisation"),
    pytest.param("\\boxed{1,000}", "1000", False, "1,000", id="no-comma-removal"),
    pytest.param("Answer: 42", "42", False, None, id="answer-line-not-enough"),
    pytest.param("\\boxed{42", "42", False, None, id="unclosed"),
    pytest.param("\\boxed{42}\n" + "w" * 100, "42", False, None, id="outside-100-chars"),
]


@pytest.mark.parametrize("strict_box, response, truth, acc, pred",
                         [pytest.param(False, *case.values, id=case.id) for case in CASES]
                         + [pytest.param(True, *case.values, id=f"strict-box-{case.id}") for case in BOXED_CASES])
def test_verifier_cases(strict_box, response, truth, acc, pred):
    result = compute_score(response, truth, strict_box=strict_box)
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
_UNITS = [pytest.param(u, id=i) for u, i in (("{", "braces"), ("Answer:", "answer-repeats"),
                                               ("Answer:\n", "answer-newline-repeats"), ("\\boxed{", "box-repeats"))]


@pytest.mark.parametrize("strict_box", [False, True], ids=["answer-mode", "boxed-mode"])
@pytest.mark.parametrize("unit", _UNITS)
def test_the_verifier_scans_only_the_window_of_an_adversarial_response(monkeypatch, unit, strict_box):
    """Counted, not timed: of a 1 MB and a 2 MB response the scans get the same characters, at most the window
    (answer mode: the 300-character window, then the answer found in it and the ground truth; boxed mode: the last
    100 characters), so the verifier's cost does not grow with the response."""
    handed: list[dict[str, int]] = []

    def recording(name: str, scan):
        def run(text: str, *rest):
            handed[-1][name] = handed[-1].get(name, 0) + len(text)
            return scan(text, *rest)

        return run

    for name in ("extract_answer", "last_boxed_content", "normalize_final_answer"):
        monkeypatch.setattr(math_dapo, name, recording(name, getattr(math_dapo, name)))
    for size in (_MB, 2 * _MB):
        handed.append({})
        result = compute_score(unit * (size // len(unit)), "42", strict_box=strict_box)
        assert not result.acc and result.score == -1.0
    assert handed[0] == handed[1]
    bound = STRICT_BOX_WINDOW_CHARS if strict_box else 2 * RESPONSE_WINDOW_CHARS + len("42")
    assert 0 < sum(handed[0].values()) <= bound, handed[0]


@pytest.mark.parametrize("head, unit", [
    pytest.param("\\boxed{", "Answer:", id="answer-repeats"),
    pytest.param("\\boxed{", "answer  ", id="answer-no-colon"),
    pytest.param("\\boxed{Answer:", "\n", id="answer-then-newlines"),
    pytest.param("\\boxed{", "{", id="unclosed-nesting"),
    pytest.param("", "\\boxed{", id="box-repeats"),
    pytest.param("", "\\boxed{}", id="closed-boxes"),
])
def test_last_boxed_content_is_linear_on_unwindowed_input(head, unit):
    """Counted (tests/unit/reward/test_reward_normalize.py's Scanned): at most 3 reads per character (the backward
    search for the last opener, the brace scan after it, the returned slice), and doubling the input at most doubles
    them; a scan that falls back to earlier boxes when the last is unclosed re-reads the rest at each box
    (quadratic)."""
    examined = []
    for n in (20_000, 40_000):
        text, meter = head + unit * (n // len(unit)), ScanMeter()
        assert last_boxed_content(Scanned(text, meter)) == last_boxed_content(text)
        assert meter.chars <= 3 * len(text), (meter.chars, len(text))
        examined.append(meter.chars)
    assert examined[1] <= 2 * examined[0] + len(head) + len("\\boxed{"), examined


def test_a_long_ground_truth_costs_linear_time(monkeypatch):
    """The ground truth is normalised whole (only the response is windowed): the scans examine at most
    EXAMINED_PER_CHAR characters per character of it and of the answer, and doubling it at most doubles that."""
    meter = meter_scans(monkeypatch, normalize, NORMALIZE_SCANS)
    examined = []
    for n in (12_000, 24_000):
        truth, before = "{" * n + "\\text{" * (n // 6), meter.chars
        assert not compute_score("Answer: 1", truth).acc
        examined.append(meter.chars - before)
        assert examined[-1] <= EXAMINED_PER_CHAR * (len(truth) + len("1"))
    assert examined[1] <= 2 * examined[0] + 2 * 64, examined  # 64 per normalisation: see the normaliser's test


def test_the_verifier_stays_within_a_cpu_budget_at_one_megabyte():
    """What no count sees: the answer regex (CPython's C engine) on 1 MB it could backtrack over, and the rest of
    the verifier on the inputs above at 1 MB, all in one child within CPU_BUDGET_S (60) CPU-seconds (linear: 0.5).
    A pattern that backtracks over the rest of the line at each "answer" (a lookahead `Answer(?=[^\\n]*)...`, or a
    leading `.*` to find the last answer) is quadratic on "answer  " repeated: over the budget (SIGXCPU)."""
    units = [p.values[0] for p in _UNITS]
    run_with_cpu_budget(f"""
from megatron_dapo.reward.math_dapo import compute_score, extract_answer, last_boxed_content
n = {_MB}
for unit in {units!r}:
    for strict_box in (False, True):
        assert not compute_score(unit * (n // len(unit)), "42", strict_box=strict_box).acc
for text in ("Answer:" * (n // 7), "answer  " * (n // 8), "Answer:" + "\\n" * n):
    extract_answer(text)
    assert last_boxed_content("\\\\boxed{{" + text) is None
assert not compute_score("Answer: 1", "{{" * n + "\\\\text{{" * (n // 6)).acc
print("done")
""")


def test_huge_number_answers_never_raise():
    """Issue 38.7's answers for the DAPO verifier: compared as normalised text (never int()), so any length works;
    a 100,000-digit ground truth cannot fit the 300-character window and is simply wrong."""
    huge = "9" + "0123456789" * 10_000
    assert compute_score("Answer: 5", huge) == RewardResult(score=-1.0, acc=False, pred="5")
    assert compute_score("Answer: 5", "1,000," + huge[:99_999]).acc is False
    big = huge[:280]
    assert compute_score(f"Answer: {big}", big).acc
    assert not compute_score(f"Answer: {big[:-1]}{(int(big[-1]) + 1) % 10}", big).acc
