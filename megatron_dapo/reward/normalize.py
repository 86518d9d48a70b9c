"""Minerva-style answer normalisation, as DAPO's verifier applies it.

The rules are those of Lewkowycz et al. 2022 (Minerva, appendix D) in the variant DAPO ships
(its list of removed unit words has no "ft"): keep the text after the last '=', apply literal
substitutions and removals, unwrap the first $..$ span, \\text{}, \\textbf{}, \\overline{} and
\\boxed{}, expand the \\frac12 / \\sqrt2 shorthand, drop '$', drop thousands commas from pure
digit strings, strip.

The reference formulation uses five backtracking regular expressions. Each is re-implemented
here as a left-to-right scan with the same match semantics (Python `re` without DOTALL: '.'
never crosses a newline, '[^{]' does), so the cost is linear in the input length whatever the
input; tests/unit/reward/test_reward_normalize.py checks the scans against the regexes on random strings.
"""

from __future__ import annotations

# Applied in order with str.replace; order matters ("an " before "a ", spaces before "mbox").
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Removed in order after SUBSTITUTIONS (so they see text with spaces already gone).
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip

# Unwrapped with a lazy match up to the first '}' on the same line, in this order.
_LAZY_WRAPPERS: tuple[str, ...] = ("\\text{", "\\textbf{", "\\overline{")
_BOXED = "\\boxed{"


def _map_lines(text: str, fn) -> str:
    """Apply `fn` to every '\\n'-separated line (the regexes' '.' never crosses a newline)."""
    return "\n".join(fn(line) for line in text.split("\n"))


def _first_dollar_span(line: str) -> str:
    """A line with two or more '$' becomes '$' + text between its first two '$' + '$'."""
    first = line.find("$")
    if first < 0:
        return line
    second = line.find("$", first + 1)
    if second < 0:
        return line
    return "$" + line[first + 1 : second] + "$"


def _unwrap_lazy(line: str, opener: str) -> str:
    """Replace every `opener`..'}' (first '}' after the opener) by its inner text."""
    out: list[str] = []
    pos = 0
    while True:
        start = line.find(opener, pos)
        if start < 0:
            break
        close = line.find("}", start + len(opener))
        if close < 0:
            # No '}' after this opener means none after any later opener either: done.
            break
        out.append(line[pos:start])
        out.append(line[start + len(opener) : close])
        pos = close + 1
    out.append(line[pos:])
    return "".join(out)


def _unwrap_boxed_greedy(line: str) -> str:
    """Replace the first '\\boxed{' .. last '}' of the line by the text between them."""
    start = line.find(_BOXED)
    if start < 0:
        return line
    close = line.rfind("}", start + len(_BOXED))
    if close < 0:
        return line
    return line[:start] + line[start + len(_BOXED) : close] + line[close + 1 :]


def _expand_frac_shorthand(text: str) -> str:
    """'frac' + X + Y -> 'frac{X}{Y}' when X is not '{' and Y is not a newline."""
    out: list[str] = []
    pos = 0
    n = len(text)
    while True:
        start = text.find("frac", pos)
        if start < 0:
            break
        a, b = start + 4, start + 5
        if b < n and text[a] != "{" and text[b] != "\n":
            out.append(text[pos:start])
            out.append("frac{" + text[a] + "}{" + text[b] + "}")
            pos = b + 1
        else:
            # No match here; the next candidate starts one character later.
            out.append(text[pos : start + 1])
            pos = start + 1
    out.append(text[pos:])
    return "".join(out)


def _expand_sqrt_shorthand(text: str) -> str:
    """'sqrt' + X -> 'sqrt{X}' when X is not '{' (X may be a newline, as with '[^{]')."""
    out: list[str] = []
    pos = 0
    n = len(text)
    while True:
        start = text.find("sqrt", pos)
        if start < 0:
            break
        a = start + 4
        if a < n and text[a] != "{":
            out.append(text[pos:start])
            out.append("sqrt{" + text[a] + "}")
            pos = a + 1
        else:
            out.append(text[pos : start + 1])
            pos = start + 1
    out.append(text[pos:])
    return "".join(out)


def normalize_final_answer(answer: str) -> str:
    """Normalise one final answer (a prediction or a ground truth) for exact string comparison.

    Examples: "x = 5" -> "5"; "10 dollars" -> "10"; "\\boxed{\\frac12}" -> "\\frac{1}{2}";
    "1,000" -> "1000"; "$\\text{(B)}$" -> "(B)". Linear time in len(answer).
    """
    text = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = _map_lines(text, _first_dollar_span)
    for opener in _LAZY_WRAPPERS:
        text = _map_lines(text, lambda line, o=opener: _unwrap_lazy(line, o))
    text = _map_lines(text, _unwrap_boxed_greedy)
    text = _expand_frac_shorthand(text)
    text = _expand_sqrt_shorthand(text)
    text = text.replace("$", "")
    # Thousands separators go only when the rest is all digits; like DAPO this also turns "1,2"
    # into "12", so a comma-separated list of single numbers is not a safe answer format.
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()
