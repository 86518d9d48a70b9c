"""The adversarial probes of issue 38: each a command a new user or an adversary might run, and what a good
answer to it is. `python -m tests.probes` runs them all and prints one line a case and the count of good ones;
tests/probes/test_probes.py runs the same cases in the suite.

A case module (`tests/probes/cases_<area>.py`) exports `CASES: list[Case]`. A case builds what it needs under
its own temporary directory (`setup`), runs one command, and `check`s the outcome; a good answer to bad input is
usually `one_line_error`: exit status 2 (or the given one), one `error: ...` line naming what to fix, no
traceback, nothing of the user's lost (the case's own check says what that means).
"""
