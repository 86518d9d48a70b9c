"""One probe: a command, the files it needs, and the check of its outcome (tests/probes/__init__.py)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.torchrun import REPO, subprocess_env


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a probe's command did: exit status, stdout, stderr, and its temporary directory (for the files)."""

    returncode: int
    stdout: str
    stderr: str
    workdir: Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """`name` (issue 38 item and what it tries); `argv(workdir)` the command (a list; `sys.executable` for
    Python); `setup(workdir)` prepares files first; `check(outcome)` returns None when the answer is good, else
    why not (one line); `env` extra environment; `timeout_s` the command's limit."""

    name: str
    argv: Callable[[Path], Sequence[str]]
    check: Callable[[Outcome], str | None]
    setup: Callable[[Path], None] = lambda workdir: None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    timeout_s: float = 300


def run_case(case: Case, workdir: Path) -> str | None:
    """Runs `case` in `workdir` (created); None when its answer is good, else why not."""
    workdir.mkdir(parents=True, exist_ok=True)
    case.setup(workdir)
    env = dict(subprocess_env(), **case.env)
    try:
        proc = subprocess.run([str(a) for a in case.argv(workdir)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=case.timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"did not finish within {case.timeout_s:.0f} s"
    return case.check(Outcome(proc.returncode, proc.stdout, proc.stderr, workdir))


PY = sys.executable


def one_line_error(pattern: str, *, status: int = 2, also: Callable[[Outcome], str | None] | None = None
                   ) -> Callable[[Outcome], str | None]:
    """A check: exit `status`, no traceback, and one stderr line `error: ...` matching `pattern` (a regex, searched
    in that line); then `also(outcome)` (e.g. that a file survived)."""

    def check(out: Outcome) -> str | None:
        if "Traceback (most recent call last)" in out.stderr + out.stdout:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [""]
            return f"a traceback (last line: {tail[0][:200]})"
        if out.returncode != status:
            return f"exit {out.returncode}, not {status} ({_last(out)})"
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ") or " error: " in line[:40]]
        if len(errors) != 1:
            return f"{len(errors)} 'error:' lines on stderr, not 1 ({_last(out)})"
        if not re.search(pattern, errors[0]):
            return f"the error line does not match {pattern!r}: {errors[0][:300]}"
        return also(out) if also else None

    return check


def _last(out: Outcome) -> str:
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1][:200] if lines else "no output"


def file_unchanged(path_of: Callable[[Path], Path], content: bytes) -> Callable[[Outcome], str | None]:
    """An `also` check: the file at path_of(workdir) still holds `content`."""

    def check(out: Outcome) -> str | None:
        path = path_of(out.workdir)
        if not path.exists():
            return f"{path} was removed"
        return None if path.read_bytes() == content else f"{path} was changed"

    return check


def module(name: str) -> list[str]:
    """`python -m name` as argv."""
    return [PY, "-m", name]

