"""The linear-time normaliser against the regex formulation of Minerva appendix D (DAPO variant)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from megatron_dapo.reward import normalize
from megatron_dapo.reward.normalize import REMOVED_EXPRESSIONS, SUBSTITUTIONS, normalize_final_answer
from tests.torchrun import REPO


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


# ---- cost, counted: the characters the scans examine, not a clock -------------------------------------------------


class ScanMeter:
    """What the metered scans examined: `chars` in all, `calls` per scan name."""

    def __init__(self) -> None:
        self.chars = 0
        self.calls: Counter[str] = Counter()


class Scanned(str):
    """A str that adds to `meter.chars` the characters each read of it examines: find / index up to the end of
    the match (the end of the range when absent), rfind / rindex from the end of the range down to the match,
    startswith / endswith the prefix's length, s[i] one, a slice its length (a copy); any other method that
    reads the string counts all of it. What it returns is a plain str: only the string handed to a scan is
    metered, not what the scan builds. CPython's regex engine reads the buffer directly, uncounted: a scan
    rewritten as a regex shows as a scan that no longer runs (`ScanMeter.calls`) and in the CPU budget test."""

    meter: ScanMeter

    def __new__(cls, text: str, meter: ScanMeter) -> Scanned:
        obj = super().__new__(cls, text)
        obj.meter = meter
        return obj

    def _range(self, start: int | None, end: int | None) -> tuple[int, int]:
        lo, hi, _ = slice(start, end).indices(len(self))
        return lo, max(lo, hi)

    def find(self, sub: str, start: int | None = None, end: int | None = None) -> int:
        lo, hi = self._range(start, end)
        at = super().find(sub, lo, hi)
        self.meter.chars += (at + len(sub) if at >= 0 else hi) - lo
        return at

    def rfind(self, sub: str, start: int | None = None, end: int | None = None) -> int:
        lo, hi = self._range(start, end)
        at = super().rfind(sub, lo, hi)
        self.meter.chars += hi - (at if at >= 0 else lo)
        return at

    def index(self, sub: str, start: int | None = None, end: int | None = None) -> int:
        if (at := self.find(sub, start, end)) < 0:
            raise ValueError("substring not found")
        return at

    def rindex(self, sub: str, start: int | None = None, end: int | None = None) -> int:
        if (at := self.rfind(sub, start, end)) < 0:
            raise ValueError("substring not found")
        return at

    def startswith(self, prefix, *args) -> bool:
        self.meter.chars += max(map(len, prefix)) if isinstance(prefix, tuple) else len(prefix)
        return super().startswith(prefix, *args)

    def endswith(self, suffix, *args) -> bool:
        self.meter.chars += max(map(len, suffix)) if isinstance(suffix, tuple) else len(suffix)
        return super().endswith(suffix, *args)

    def __getitem__(self, key):
        out = super().__getitem__(key)
        self.meter.chars += len(out)
        return out


def _reads_all(name: str):
    def read(self, *args, **kwargs):
        self.meter.chars += len(self)
        return getattr(str, name)(self, *args, **kwargs)

    return read


for _name in ("__contains__", "__iter__", "__add__", "split", "rsplit", "splitlines", "partition", "rpartition",
              "replace", "count", "strip", "lstrip", "rstrip", "lower", "upper", "casefold", "encode", "isdigit",
              "join", "translate", "expandtabs", "format"):
    setattr(Scanned, _name, _reads_all(_name))


def meter_scans(monkeypatch: pytest.MonkeyPatch, module, names: tuple[str, ...]) -> ScanMeter:
    """Replace each function `module.<name>` by one that hands it its first argument as a `Scanned`."""
    meter = ScanMeter()

    def metered(name: str, scan):
        def run(text: str, *rest):
            meter.calls[name] += 1
            return scan(Scanned(text, meter), *rest)

        return run

    for name in names:
        monkeypatch.setattr(module, name, metered(name, getattr(module, name)))
    return meter


NORMALIZE_SCANS = ("_first_dollar_span", "_unwrap_lazy", "_unwrap_boxed_greedy", "_expand_frac_shorthand",
                   "_expand_sqrt_shorthand")
"""The five scans that replace the published regexes; normalize_final_answer must run each of them."""

EXAMINED_PER_CHAR = 28
"""Bound on the characters the scans examine per input character, from the scans' code. Each search starts at or
after the end of the previous match, or one past a rejected candidate (re-reading at most 3 characters of a
4-character needle); slices copy each character once. Per character of a pass's input: the first $ span 2 (its
searches, its slice), each lazy wrapper 2, the greedy \\boxed 3 (forwards to the opener, backwards to the last
'}', the slices), \\frac 7 (searches 4, 2 reads per candidate, the slices), \\sqrt 6. Every pass reads a text no
longer than the input, except \\sqrt's: \\frac turns 6 characters into up to 10 ("frac12" -> "frac{1}{2}"). So
2 + 3 x 2 + 3 + 7 + 6 x 10/6 = 28. A scan that re-reads from the start at each opener needs thousands here."""


ADVERSARIAL = [  # (head, unit, tail): the input is head + unit * k + tail
    pytest.param("", "\\text{", "", id="unclosed-text"),
    pytest.param("", "\\text{\n", "", id="text-newlines"),
    pytest.param("", "$", "", id="dollars"),
    pytest.param("a$", "b", "", id="single-dollar-long-line"),
    pytest.param("", "frac", "", id="frac-runs"),
    pytest.param("", "sqrt{", "", id="sqrt-braces"),
    pytest.param("", "\\boxed{", "}", id="boxed"),
    pytest.param("", "{", "", id="braces"),
]


@pytest.mark.parametrize("head, unit, tail", ADVERSARIAL)
def test_normalize_is_linear_on_adversarial_input(monkeypatch, head, unit, tail):
    """Linear time, counted: on 20,000 and 40,000 characters of input the published regexes are quadratic on (they
    backtrack over the rest of the line at every opener), every scan runs, doubling the input at most doubles the
    characters they examine (a quadratic scan quadruples them), and each input character is examined at most
    EXAMINED_PER_CHAR times. The result is the unmetered one."""
    texts = [head + unit * (n // len(unit)) + tail for n in (20_000, 40_000)]
    expected = [normalize_final_answer(t) for t in texts]
    meter = meter_scans(monkeypatch, normalize, NORMALIZE_SCANS)
    examined = []
    for text, want in zip(texts, expected, strict=True):
        before = meter.chars
        assert normalize_final_answer(text) == want and len(want) <= 3 * len(text)
        examined.append(meter.chars - before)
        assert examined[-1] <= EXAMINED_PER_CHAR * len(text), (examined[-1], len(text))
    assert sorted(meter.calls) == sorted(NORMALIZE_SCANS)
    # + 64: each of the 7 passes may examine up to one needle (<= 7 characters) more or less than a multiple of n
    assert examined[1] <= 2 * examined[0] + 64, examined


CPU_BUDGET_S = 60
"""CPU-seconds the 1 MB adversarial inputs may use in a child process (RLIMIT_CPU). The linear scans use 1.1 CPU-s
here (an x86 Xeon; the verifier's inputs 0.5), interpreter start included, so 60 leaves 50x for a slower CPU; CPU
time does not grow with the load on the machine, as a clock does. The published regexes took 9.6 CPU-s at 30,000
characters of "\\text{" and 36 at 60,000 (quadratic): hours at 1 MB."""


def run_with_cpu_budget(code: str, cpu_s: int = CPU_BUDGET_S) -> None:
    """Run `code` in a fresh interpreter that the kernel stops (SIGXCPU) once it used `cpu_s` CPU-seconds; it must
    exit 0 having printed "done". The wall-clock timeout only ends a child that hangs without using the CPU."""
    limits = (f"import resource\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
              f"resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s + 1}))\n")
    out = subprocess.run([sys.executable, "-c", limits + code], cwd=REPO, capture_output=True, text=True,
                         timeout=20 * cpu_s)
    over = f": over its budget of {cpu_s} CPU-s (SIGXCPU)" if out.returncode == -signal.SIGXCPU else ""
    assert out.returncode == 0 and out.stdout == "done\n", f"exit {out.returncode}{over}: {out.stderr[-2000:]}"


def test_normalize_stays_within_a_cpu_budget_at_one_megabyte():
    """What the count cannot see (the C parts: str.replace, split, a regex brought back): 1 MB of each adversarial
    input, all in one child, within CPU_BUDGET_S CPU-seconds."""
    cases = [tuple(p.values) for p in ADVERSARIAL]
    run_with_cpu_budget(f"""
from megatron_dapo.reward.normalize import normalize_final_answer
for head, unit, tail in {cases!r}:
    text = head + unit * (1_000_000 // len(unit)) + tail
    assert len(normalize_final_answer(text)) <= 3 * len(text)
print("done")
""")
