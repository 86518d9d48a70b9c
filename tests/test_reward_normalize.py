"""The linear-time normaliser against the regex formulation of Minerva appendix D (DAPO variant)."""

from __future__ import annotations

import random
import re
import time

import pytest

from megatron_dapo.reward.normalize import REMOVED_EXPRESSIONS, SUBSTITUTIONS, normalize_final_answer


def _reference_normalize(answer: str) -> str:
    """The published formulation, written out with backtracking regexes (quadratic worst case)."""
    text = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    text = re.sub(r"(\\text\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


_PIECES = [
    "$", "\\text{", "\\textbf{", "\\overline{", "\\boxed{", "}", "{", "frac", "sqrt", "\n", "a ",
    "an ", "1", "2", ",", " ", "=", "x", "\\", "dollars", "\\$", ".$", "^\\circ", "\\text{m}",
]  # fmt: skip


def test_scans_match_reference_regexes_on_random_strings():
    rng = random.Random(1234)
    for _ in range(4000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 14)))
        assert normalize_final_answer(text) == _reference_normalize(text), repr(text)


@pytest.mark.parametrize(
    "raw, expected",
    [
        pytest.param("x = 5", "5", id="after-last-equals"),
        pytest.param("10 dollars", "10", id="unit-word"),
        pytest.param("1,000", "1000", id="thousands-comma"),
        pytest.param("1,2", "12", id="comma-quirk-digits-only"),
        pytest.param("(1,2)", "(1,2)", id="tuple-keeps-commas"),
        pytest.param("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", id="boxed-frac"),
        pytest.param("\\frac12", "\\frac{1}{2}", id="frac-shorthand"),
        pytest.param("\\dfrac34", "\\dfrac{3}{4}", id="dfrac-shorthand"),
        pytest.param("\\sqrt2", "\\sqrt{2}", id="sqrt-shorthand"),
        pytest.param("$\\text{(B)}$", "(B)", id="dollar-text"),
        pytest.param("so $x$ is $7$", "x", id="first-dollar-span-wins"),
        pytest.param("90^\\circ", "90", id="degrees"),
        pytest.param("\\overline{AB}", "AB", id="overline"),
        pytest.param("5 ft", "5ft", id="dapo-variant-keeps-ft"),
    ],
)
def test_normalize_examples(raw, expected):
    assert normalize_final_answer(raw) == expected
    assert _reference_normalize(raw) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("\\text{" * 200_000, id="unclosed-text"),
        pytest.param("\\text{\n" * 150_000, id="text-newlines"),
        pytest.param("$" * 1_000_000, id="dollars"),
        pytest.param("a$" + "b" * 1_000_000, id="single-dollar-long-line"),
        pytest.param("frac" * 250_000, id="frac-runs"),
        pytest.param("sqrt{" * 200_000, id="sqrt-braces"),
        pytest.param("\\boxed{" * 150_000 + "}", id="boxed"),
        pytest.param("{" * 1_000_000, id="braces"),
    ],
)
def test_normalize_is_linear_on_adversarial_input(text):
    start = time.perf_counter()
    out = normalize_final_answer(text)
    elapsed = time.perf_counter() - start
    assert isinstance(out, str) and len(out) <= 3 * len(text)
    # Generous: a linear scan of 1 MB takes milliseconds; the regex formulation is quadratic on
    # several of these inputs.
    assert elapsed < 2.0, f"{elapsed:.2f}s"
