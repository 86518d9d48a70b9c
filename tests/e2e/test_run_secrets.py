"""No secret in any file a run writes: run_config.json (the run record), metrics, wandb files, checkpoints, HF export,
the --save lock; while the run lives and after it is killed; and, with launched SGLang servers, their logs.

The SGLang API key reaches the trainer through --sglang-api-key-file or SGLANG_API_KEY even when the
rollout engine is the embedded one; megatron_dapo/trainer/run_record.py redacts it where the run record is made.
A launched server logs its arguments, the key among them: megatron_dapo/rollout/sglang/log_redact.py filters it out
of the server's output before the log file (the Slurm job's logs: tests/slurm/test_slurm_rehearsal.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout.sglang.log_redact import REDACTED as LOG_REDACTED
from megatron_dapo.trainer.metrics_log import MetricsLogger
from megatron_dapo.trainer.run_record import REDACTED, run_record
from tests.conftest import train_env
from tests.e2e.test_trainer_e2e import latest_step
from tests.ports import free_port_block
from tests.sglang.real_server import QUICK_STOP_ENV, SGLANG_PY

FILE_KEY = "fileKEY-7f3a9c0d2b"
ENV_KEY = "envKEY-41e8b6d5aa"
ARGV_KEY = "argvKEY-90c1d7e3f2"


def files_holding(root: Path, secrets: tuple[str, ...]) -> list[str]:
    """Every file under `root` (binary ones too, read as bytes) that holds one of `secrets`."""
    needles = [s.encode() for s in secrets]
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles))


def write_key_file(tmp_path: Path) -> Path:
    """FILE_KEY in a 0600 file, as a user keeps it."""
    key_file = tmp_path / "key"
    key_file.write_text(FILE_KEY + "\n")
    key_file.chmod(0o600)
    return key_file


def tiny_run_cmd(tiny_base: Path, steps: int) -> list[str]:
    """`python -m megatron_dapo.train` on the tiny base for `steps` steps of 2 prompts x 2 samples x 4 tokens; the
    engine, the key and the outputs are each test's own."""
    return [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(tiny_base / "model"),
            "--prompt-data", str(tiny_base / "train.jsonl"), "--num-steps", str(steps), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--no-dynamic-sampling",
            "--max-response-length", "4", "--overlong-buffer-length", "2", "--max-prompt-length", "16"]


@pytest.mark.slow
def test_embedded_run_writes_no_api_key_anywhere(tiny_base, tmp_path):
    key_file = write_key_file(tmp_path)
    run = tmp_path / "run"
    cmd = [*tiny_run_cmd(tiny_base, 1),
           "--rollout-engine", "embedded", "--sglang-api-key-file", str(key_file),
           "--log-dir", str(run / "log"), "--save", str(run / "ckpt"), "--save-interval", "1",
           "--export-hf", str(run / "hf"), "--no-progress", "--seed", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=train_env() | {"SGLANG_API_KEY": ENV_KEY}, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run / "log" / "run_config.json").is_file() and any((run / "ckpt").iterdir()) and (run / "hf").is_dir()
    assert FILE_KEY not in proc.stdout + proc.stderr
    assert files_holding(tmp_path, (FILE_KEY, ENV_KEY)) == [str(key_file)]  # only the user's own key file
    record = json.loads((run / "log" / "run_config.json").read_text())
    assert record["sglang_api_key"] == REDACTED and record["sglang_api_key_file"] == str(key_file)


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`")
def test_a_run_with_launched_sglang_servers_writes_no_api_key_anywhere(tiny_base, tmp_path):
    """One step with a real SGLang server the trainer launches, keyed from --sglang-api-key-file: no file under the
    run's directories holds the key (the server's log included), and the log has SGLang's argument print with the
    key's place marked, so the scan had what to find. Before the filter that line carried the key."""
    key_file = write_key_file(tmp_path)
    run = tmp_path / "run"
    cmd = [*tiny_run_cmd(tiny_base, 1),
           "--rollout-engine", "sglang", "--sglang-python", str(SGLANG_PY), "--sglang-extra-args", "--dtype float32",
           "--sglang-base-port", str(free_port_block(2)), "--weight-sync-mode", "tensor",
           "--sglang-api-key-file", str(key_file), "--log-dir", str(run / "log"), "--no-progress", "--seed", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=train_env() | QUICK_STOP_ENV, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    server_log = run / "log" / "sglang" / "sglang_0.log"
    assert (run / "log" / "metrics.jsonl").is_file() and server_log.is_file()
    assert FILE_KEY not in proc.stdout + proc.stderr
    assert files_holding(tmp_path, (FILE_KEY,)) == [str(key_file)]  # only the user's own key file
    assert f"'api_key': '{LOG_REDACTED.decode()}'" in server_log.read_text()


@pytest.mark.slow
def test_a_run_given_the_key_on_the_command_line_writes_it_in_no_file(tiny_base, tmp_path):
    """The real path of --sglang-api-key: `python -m megatron_dapo.train` with the key in argv, run to its end (wandb's
    finish writes the run metadata, sys.argv among it, into the offline .wandb file unless the trainer saw the key
    in argv: trainer/build.make_logger -> run_record.argv_has_secret). The SIGKILL test below ends the run before
    wandb writes that record, so only a finished run checks it."""
    run = tmp_path / "run"
    cmd = [*tiny_run_cmd(tiny_base, 1),
           "--rollout-engine", "embedded", "--sglang-api-key", ARGV_KEY,
           "--log-dir", str(run / "log"), "--save", str(run / "ckpt"), "--save-interval", "1",
           "--export-hf", str(run / "hf"), "--no-progress", "--seed", "3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=train_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any((run / "log" / "wandb").rglob("*.wandb")) and latest_step(run / "ckpt") == 1 and (run / "hf").is_dir()
    assert ARGV_KEY not in proc.stdout + proc.stderr
    assert files_holding(tmp_path, (ARGV_KEY,)) == []
    assert json.loads((run / "log" / "run_config.json").read_text())["sglang_api_key"] == REDACTED


@pytest.mark.slow
def test_a_key_on_the_command_line_is_in_no_file_while_the_run_lives_nor_after_sigkill(tiny_base, tmp_path):
    """The worst way to pass the key (ps shows it, and so did every file that recorded the command line): scanned
    under the run's directories while the run holds its --save lock and has written a checkpoint and wandb files,
    then after a SIGKILL, which leaves the lock file and any unfinished save behind. The lock file used to record
    the whole command line, world-readable, for the run's lifetime and after."""
    run = tmp_path / "run"
    cmd = [*tiny_run_cmd(tiny_base, 40),
           "--rollout-engine", "embedded", "--sglang-api-key", ARGV_KEY,
           "--log-dir", str(run / "log"), "--save", str(run / "ckpt"), "--save-interval", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while latest_step(run / "ckpt") < 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = files_holding(tmp_path, (ARGV_KEY,))
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before it could be looked at alive"
        assert (run / "ckpt" / ".megatron_dapo.lock").read_text().strip() and any((run / "log").rglob("*.wandb"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert alive == [], "while the run lives"
    assert files_holding(tmp_path, (ARGV_KEY,)) == [], "after SIGKILL"


def test_run_record_redacts_the_key_wherever_it_appears():
    args = build_parser().parse_args(["--hf-checkpoint", "m", "--prompt-data", "d", "--num-steps", "1",
                                      "--sglang-extra-args", f"--foo {ARGV_KEY}"])
    flags = vars(args) | {"sglang_api_key": ARGV_KEY}
    record = run_record(flags)
    assert record["sglang_api_key"] == REDACTED and record["sglang_extra_args"] == f"--foo {REDACTED}"
    assert ARGV_KEY not in json.dumps(record) and flags["sglang_api_key"] == ARGV_KEY  # the flags are untouched
    flags["sglang_api_key"] = None
    assert run_record(flags)["sglang_api_key"] is None  # no key: nothing to hide, the record says so


def test_wandb_files_hold_no_key_given_on_the_command_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["megatron_dapo.train", "--sglang-api-key", ARGV_KEY])
    args = build_parser().parse_args(sys.argv[1:] + ["--hf-checkpoint", "m", "--prompt-data", "d", "--num-steps", "1"])
    logger = MetricsLogger(tmp_path / "log", total_steps=1, config=run_record(vars(args)), progress=False,
                           private_argv=True)
    logger.log(1, {"x": 1.0})
    logger.close()
    assert any((tmp_path / "log" / "wandb").rglob("*.wandb"))
    assert files_holding(tmp_path, (ARGV_KEY,)) == []
