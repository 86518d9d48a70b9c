"""Issue 38 probes of a run's life: the --save lock and directory, --log-dir, SIGTERM and SIGINT (items 2, 3, 4, 11,
15). Each case runs the trainer on a tiny model (tools/make_tiny_base.py, built once per process, 20 warm-up steps)
whose reward can send the trainer a signal from inside its rollout (tests/rewards.py: length_parity_signalled, where
Slurm's SIGTERM or a Ctrl-C land most of the time at scale)."""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.probes.case import PY, Case, Outcome, module, one_line_error
from tests.rewards import SIGNALLED_REWARD
from tests.torchrun import REPO, subprocess_env

KEY = "argvKEY-probe-3c9e71"
CALL_IN_STEP_4 = 3 * 16 + 2
"""The reward call during step 4's rollout (16 responses a step: 4 prompts x 4, no dynamic sampling)."""


@functools.cache
def _tiny_base() -> Path:
    """tools/make_tiny_base.py output (model/, train.jsonl), built once per process (~10 s)."""
    out = Path(tempfile.mkdtemp(prefix="probe-tiny-base-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    subprocess.run([PY, "tools/make_tiny_base.py", "--out", str(out), "--sft-steps", "20", "--num-train", "300",
                    "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64", "--sft-batch-size", "16"],
                   cwd=REPO, env=subprocess_env(), check=True, capture_output=True, timeout=300)
    return out


def _train(w: Path, *extra: str, steps: int = 5) -> list[str]:
    """`python -m megatron_dapo.train` on the tiny model: --save w/ckpt every 2 steps, --log-dir w/log."""
    base = _tiny_base()
    return [*module("megatron_dapo.train"), "--hf-checkpoint", str(base / "model"), "--prompt-data",
            str(base / "train.jsonl"), "--num-steps", str(steps), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *SIGNALLED_REWARD, "--max-response-length", "12",
            "--overlong-buffer-length", "10", "--global-batch-size", "8", "--max-prompt-length", "16",
            "--log-dir", str(w / "log"), "--save", str(w / "ckpt"), "--save-interval", "2", "--no-wandb",
            "--no-progress", "--seed", "7", *extra]


def _entries(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name != ".megatron_dapo.lock") if ckpt.is_dir() else []


def _latest(w: Path) -> str:
    marker = w / "ckpt" / "latest"
    return marker.read_text().strip() if marker.is_file() else "none"


def _last_line(out: Outcome) -> str:
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1][:200] if lines else "no output"


# ---- 38.2: no secret in the lock file -----------------------------------------------------------------------------
def _no_key_anywhere(out: Outcome) -> str | None:
    if out.returncode != -9:
        return f"exit {out.returncode}, not -9 (the reward's SIGKILL; {_last_line(out)})"
    lock = out.workdir / "ckpt" / ".megatron_dapo.lock"
    if not lock.is_file() or not lock.read_text().strip():
        return "the killed run left no lock file naming it"
    holding = sorted(str(p.relative_to(out.workdir)) for p in out.workdir.rglob("*")
                     if p.is_file() and KEY.encode() in p.read_bytes())
    return f"the key given on the command line is in {', '.join(holding)}" if holding else None


# ---- 38.3: --save over another run's steps ------------------------------------------------------------------------
def _old_run(w: Path) -> None:
    """A --save holding steps 1-6 of an earlier run (`latest` = step 6)."""
    for step in range(1, 7):
        (w / "ckpt" / f"step_{step:07d}").mkdir(parents=True)
        (w / "ckpt" / f"step_{step:07d}" / "metadata.json").write_text("{}")
    (w / "ckpt" / "latest").write_text("step_0000006")


def _old_run_untouched(out: Outcome) -> str | None:
    entries = _entries(out.workdir / "ckpt")
    want = ["latest"] + [f"step_{s:07d}" for s in range(1, 7)]
    if entries != want or _latest(out.workdir) != "step_0000006":
        return f"the old run's steps were changed: {entries}, latest {_latest(out.workdir)}"
    return None


def _overwritten(out: Outcome) -> str | None:
    if out.returncode != 0:
        return f"exit {out.returncode}, not 0 ({_last_line(out)})"
    if "--overwrite-save: deleted steps 1-6 of a previous run from" not in out.stdout:
        return "no line names the deleted steps"
    entries = _entries(out.workdir / "ckpt")
    if entries != ["latest", "step_0000002"] or _latest(out.workdir) != "step_0000002":
        return f"--save holds {entries}, latest {_latest(out.workdir)}: not only the new run's step 2"
    return None


# ---- 38.4: SIGTERM and SIGINT -------------------------------------------------------------------------------------
def _stopped_after_step_3(out: Outcome) -> str | None:
    if "Traceback (most recent call last)" in out.stdout + out.stderr:
        return f"a traceback ({_last_line(out)})"
    if out.returncode != 143:
        return f"exit {out.returncode}, not 143 ({_last_line(out)})"
    entries = _entries(out.workdir / "ckpt")
    if _latest(out.workdir) != "step_0000003" or any(e.endswith(".tmp") for e in entries):
        return f"--save holds {entries}, latest {_latest(out.workdir)}: not the last finished step 3, whole"
    if not re.search(r"SIGTERM: saved step 3 to .* in [\d.]+ s", out.stdout):
        return "no line says step 3 was saved"
    return None


def _second_sigint(out: Outcome) -> str | None:
    if "Traceback (most recent call last)" in out.stdout + out.stderr:
        return f"a traceback ({_last_line(out)})"
    if out.returncode != 130:
        return f"exit {out.returncode}, not 130 ({_last_line(out)})"
    entries = _entries(out.workdir / "ckpt")
    if any(e.endswith(".tmp") for e in entries):
        return f"an unfinished save was left: {entries}"
    if "SIGINT: exiting now (a second SIGINT)" not in out.stderr:
        return "no line says why it exited"
    return None


# ---- 38.11: --log-dir ----------------------------------------------------------------------------------------------
def _a_file(w: Path) -> None:
    (w / "a-file").write_text("x")


# ---- 38.15: two runs at the same instant --------------------------------------------------------------------------
SAME_INSTANT = """
import subprocess, sys
from megatron_dapo import train  # the imports first: they take seconds, the lock milliseconds after them
holder = subprocess.Popen([sys.executable, "-c", '''
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(1.0)  # a trainer that took the lock and is descheduled before it writes its name
os.ftruncate(fd, 0)
os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}).encode(), 0)
print(os.getpid(), flush=True)
time.sleep(60)
''', sys.argv[1] + "/.megatron_dapo.lock"], stdout=subprocess.PIPE, text=True)
assert holder.stdout.readline().strip() == "locked"
try:
    train.main(sys.argv[2:])
finally:
    print("holder pid", holder.stdout.readline().strip(), file=sys.stderr, flush=True)
    holder.kill()
"""


def _same_instant(w: Path) -> list[str]:
    (w / "ckpt").mkdir(parents=True, exist_ok=True)
    return [PY, "-c", SAME_INSTANT, str(w / "ckpt"), *_train(w)[3:]]


def _names_the_holder(out: Outcome) -> str | None:
    why = one_line_error(r"--save .* is in use by another run: pid \d+ on host ")(out)
    if why is not None:
        return why
    holder = re.search(r"holder pid (\d+)", out.stderr)
    error = next(line for line in out.stderr.splitlines() if line.startswith("error: "))
    if holder is None or f"pid {holder[1]} on host " not in error:
        return f"the error does not name the holder's pid {holder[1] if holder else '?'}: {error[:200]}"
    return None


CASES = [
    Case(name="38.2 a --sglang-api-key given on the command line is in no file of the run after a SIGKILL mid-run "
              "(the --save lock recorded the command line)",
         argv=lambda w: _train(w, "--sglang-api-key", KEY, "--save-interval", "1"),
         env={"DAPO_TEST_SIGNAL": "SIGKILL:40"}, check=_no_key_anywhere),
    Case(name="38.3 --save over steps 1-6 of another run without --load is refused, naming the steps",
         argv=lambda w: _train(w, steps=2), setup=_old_run,
         check=one_line_error(r"--save .*/ckpt already holds steps 1-6 of another run; resume it with --load .*/ckpt, "
                              r"or give this run a new --save", also=_old_run_untouched)),
    Case(name="38.3 --overwrite-save deletes the other run's steps 1-6 and saves its own",
         argv=lambda w: _train(w, "--overwrite-save", steps=2), setup=_old_run, check=_overwritten),
    Case(name="38.4 SIGTERM in the rollout of step 4 (--save-interval 2): step 3 saved, exit 143, no step_N.tmp",
         argv=lambda w: _train(w), env={"DAPO_TEST_SIGNAL": f"SIGTERM:{CALL_IN_STEP_4}"},
         check=_stopped_after_step_3),
    Case(name="38.4 a second SIGINT a second after the first exits at once: status 130, no traceback, no step_N.tmp",
         argv=lambda w: _train(w, "--async-rollout", "1"), env={"DAPO_TEST_SIGNAL": f"SIGINT:{CALL_IN_STEP_4}:again"},
         check=_second_sigint),
    Case(name="38.11 --log-dir naming a file is refused at start",
         argv=lambda w: _train(w, "--log-dir", str(w / "a-file")), setup=_a_file,
         check=one_line_error(r"--log-dir .*/a-file is a file, not a directory$")),
    Case(name="38.11 --log-dir under a file is refused at start",
         argv=lambda w: _train(w, "--log-dir", str(w / "a-file" / "log")), setup=_a_file,
         check=one_line_error(r"--log-dir .*/a-file/log cannot be created: .*/a-file is a file, not a directory")),
    Case(name="38.15 a run that finds --save locked an instant after another run took it names that run's host and "
              "pid", argv=_same_instant, check=_names_the_holder),
]
