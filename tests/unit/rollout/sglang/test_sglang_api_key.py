"""The SGLang API key stays off command lines and out of logs: the trainer's --sglang-api-key-file, the 0600 file a
launched server group hands the key over in (megatron_dapo/rollout/sglang/api_key.py), its removal on stop and on a
failed start, the router's entry point, and the filter between a keyed process's output and its log
(megatron_dapo/rollout/sglang/log_redact.py). Servers are tests/sglang/fake_server.py (which reads SGLang's
--config); a real SGLang server's log is scanned in tests/e2e/test_run_secrets.py."""

import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

import megatron_dapo.train as train_mod
from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.api_key import (
    read_key_file,
    read_server_key_file,
    remove_server_key_file,
    resolve_api_key,
    write_server_key_file,
)
from megatron_dapo.rollout.sglang.log_redact import REDACTED, Redactor, secret_forms
from megatron_dapo.rollout.sglang.router_launch import router_argv
from megatron_dapo.rollout.sglang.server import ServerConfig, ServerGroup
from megatron_dapo.startup import check_flags
from tests.ports import free_port_block
from tests.procs import processes
from tests.torchrun import REPO

KEY = 'k3y-"quoted"\\back'
"""A key with the characters JSON / YAML escape."""


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """tempfile's directory for the test: the key directories ServerGroup makes land (and must vanish) here."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _fake_python(tmp_path: Path) -> Path:
    """An interpreter stand-in that runs the fake server with sglang.launch_server's arguments."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/sglang/fake_server.py "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- the trainer's key: --sglang-api-key-file, --sglang-api-key, SGLANG_API_KEY --------------------------


def _key_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_key_file_is_read_once_stripped(tmp_path):
    path = _key_file(tmp_path, "s3cret\n")
    assert read_key_file(path) == "s3cret"
    assert resolve_api_key(None, str(path), {"SGLANG_API_KEY": "env"}) == "s3cret"  # the file wins over the env
    assert resolve_api_key(None, None, {"SGLANG_API_KEY": "env"}) == "env"
    assert resolve_api_key("flag", None, {"SGLANG_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key(None, str(_key_file(tmp_path, "ro", 0o400)), {}) == "ro"


@pytest.mark.parametrize("case, message", [
    ("missing", r"--sglang-api-key-file .*/nope: cannot read it \(No such file"),
    ("empty", r"--sglang-api-key-file .*: the file is empty"),
    ("blank", r"--sglang-api-key-file .*: the file is empty"),
    ("group-readable", r"--sglang-api-key-file .*: mode 0640 lets group or others read.*chmod 600"),
    ("world-readable", r"--sglang-api-key-file .*: mode 0644 lets group or others read.*chmod 600"),
    ("directory", r"--sglang-api-key-file .*: not a regular file"),
    ("two-lines", r"--sglang-api-key-file .*whitespace"),
])
def test_key_file_errors_name_the_flag(tmp_path, case, message):
    path = {
        "missing": lambda: tmp_path / "nope",
        "empty": lambda: _key_file(tmp_path, ""),
        "blank": lambda: _key_file(tmp_path, " \n"),
        "group-readable": lambda: _key_file(tmp_path, "k", 0o640),
        "world-readable": lambda: _key_file(tmp_path, "k", 0o644),
        "directory": lambda: tmp_path,
        "two-lines": lambda: _key_file(tmp_path, "k\nsecond"),
    }[case]()
    with pytest.raises(ValueError, match=message):
        resolve_api_key(None, str(path), {})


def test_both_key_flags_and_bad_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--sglang-api-key-file or --sglang-api-key, not both"):
        resolve_api_key("k", str(_key_file(tmp_path, "k")), {})
    with pytest.raises(ValueError, match="SGLANG_API_KEY has whitespace"):
        resolve_api_key(None, None, {"SGLANG_API_KEY": "a b"})
    with pytest.raises(ValueError, match="--sglang-api-key starts with '-'"):
        resolve_api_key("-k", None, {})


def test_check_flags_reads_the_key_file(tmp_path):
    """The trainer's flag checks put the file's key where the engine and the colocated pusher read it, and turn
    a bad file into a one-line input error naming --sglang-api-key-file."""
    from tests.unit.trainer.test_validation import make_model_dir, parse

    model, data = make_model_dir(tmp_path), tmp_path / "train.jsonl"
    args = parse(model, data, "--sglang-api-key-file", str(_key_file(tmp_path, "fromfile\n")))
    run, _ = check_flags(args)
    assert run.engine.sglang_api_key == "fromfile"
    (tmp_path / "key").chmod(0o644)
    with pytest.raises(UserError, match="--sglang-api-key-file .*chmod 600"):
        check_flags(parse(model, data, "--sglang-api-key-file", str(tmp_path / "key")))
    help_text = {a.dest: a.help for a in build_parser()._actions}
    assert "ps" in help_text["sglang_api_key"] and "--sglang-api-key-file" in help_text["sglang_api_key"]


# ---- the launched group's key file -----------------------------------------------------------------------


def test_server_key_file_is_private_and_sglang_yaml(private_tmp):
    path = write_server_key_file(KEY)
    assert path.parent.parent == private_tmp and path.suffix == ".yaml"  # SGLang's --config wants .yaml
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert yaml.safe_load(path.read_text()) == {"api-key": KEY}  # as SGLang's ConfigArgumentMerger reads it
    assert read_server_key_file(path) == KEY
    remove_server_key_file(path)
    assert list(private_tmp.iterdir()) == []
    remove_server_key_file(path)  # twice: no error


def test_commands_carry_a_key_file_never_the_key():
    cfg = ServerConfig(model_path="m", host="0.0.0.0", api_key="k3y", num_servers=2)
    for cmd, option in ((cfg.server_command(1, "/p/api_key.yaml"), "--config"),
                        (cfg.router_command("/p/api_key.yaml"), "--api-key-file")):
        assert "k3y" not in " ".join(cmd) and "--api-key" not in cmd
        assert cmd[cmd.index(option) + 1] == "/p/api_key.yaml"
    for build in (lambda: cfg.server_command(0), cfg.router_command):
        with pytest.raises(ValueError, match="key_file"):
            build()
    # keyed: our entry point reads the file; keyless: sglang_router itself (megatron_dapo need not be importable)
    assert cfg.router_command("/p/api_key.yaml")[2] == "megatron_dapo.rollout.sglang.router_launch"
    assert ServerConfig(model_path="m", num_servers=2).router_command()[2] == "sglang_router.launch_router"
    with pytest.raises(ValueError, match="--sglang-extra-args has --api-key.*--sglang-api-key-file"):
        ServerConfig(model_path="m", api_key="k", extra_args=("--api-key", "k"))
    with pytest.raises(ValueError, match="--sglang-extra-args has --config"):
        ServerConfig(model_path="m", api_key="k", extra_args=("--config", "mine.yaml"))
    assert "--config" in ServerConfig(model_path="m", extra_args=("--config", "mine.yaml")).server_command(0)


def test_router_entry_point_adds_the_key_from_the_file(private_tmp):
    path = write_server_key_file(KEY)
    rest = ["--host", "127.0.0.1", "--worker-urls", "http://a:1", "http://b:2"]
    assert router_argv(["--api-key-file", str(path), *rest]) == [*rest, "--api-key", KEY]
    assert router_argv(rest) == rest
    remove_server_key_file(path)


def _keyed_pair(tmp_path: Path, python: Path) -> ServerConfig:
    """Two stand-in servers run by `python`, keyed with KEY, logging under tmp_path/logs, alive for 60 s."""
    return ServerConfig(model_path="m", num_servers=2, router=False, base_port=free_port_block(2), device="cpu",
                        python=str(python), startup_timeout_s=30, log_dir=str(tmp_path / "logs"), api_key=KEY,
                        env={"FAKE_SGLANG_LIFETIME": "60"})


def test_keyed_group_hands_the_key_over_in_a_file_and_removes_it_on_stop(tmp_path, private_tmp):
    """Two fake servers launched with a key: it reaches them (a call without it is refused with 401, with it
    answered) through the 0600 file, no process of theirs has it on its command line, the logs are 0600, and
    stop() deletes the file and its directory."""
    cfg = _keyed_pair(tmp_path, _fake_python(tmp_path))
    group = ServerGroup(cfg)
    group.start()
    try:
        key_file = group.key_file
        assert key_file is not None and key_file.parent.parent == private_tmp
        assert _mode(key_file) == 0o600 and _mode(key_file.parent) == 0o700
        for i, server in enumerate(group.servers):
            assert httpx.post(f"{cfg.server_url(i)}/generate", json={}, timeout=10).status_code == 401
            assert httpx.get(f"{cfg.server_url(i)}/server_info", headers=server.headers, timeout=10).status_code == 200
            group_pids = [pid for pid, f in processes() if int(f[2]) == server.pid]
            assert group_pids and all(_cmdline(pid) and KEY.encode() not in _cmdline(pid) for pid in group_pids)
            assert _mode(server.log_path) == 0o600
    finally:
        group.stop()
    assert group.key_file is None and not key_file.exists() and list(private_tmp.iterdir()) == []


def test_failed_keyed_start_removes_the_key_file(tmp_path, private_tmp):
    """A server that exits during start-up: start() raises with its log, and the key file is gone."""
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho no sglang here; exit 3\n")
    failing.chmod(0o755)
    cfg = ServerConfig(model_path="m", base_port=free_port_block(2), device="cpu", python=str(failing),
                       startup_timeout_s=30, log_dir=str(tmp_path / "logs"), api_key="k")
    group = ServerGroup(cfg)
    with pytest.raises(RuntimeError, match=r"exited with 3(?s:.*)no sglang here"):
        group.start()
    assert group.key_file is None and list(private_tmp.iterdir()) == []
    assert os.listdir(tmp_path / "logs") == ["sglang_0.log"]


def test_key_dirs_of_sigkilled_trainers_are_removed_at_the_next_start(private_tmp):
    """A key directory names its trainer (`sglang_key-<host>-<pid>-...`); the next keyed start removes those of
    this host whose pid is dead (a SIGKILL skipped their stop) and keeps those of live processes and other hosts."""
    import socket
    import subprocess

    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {"dead": f"sglang_key-{host}-{dead.pid}-x1y2z3_a", "live": f"sglang_key-{host}-{live.pid}-abc",
                 "mine": f"sglang_key-{host}-{os.getpid()}-abc", "other_host": f"sglang_key-elsewhere-{dead.pid}-abc",
                 "unrelated": f"other-{host}-{dead.pid}-abc"}
        for name in names.values():
            (private_tmp / name).mkdir(mode=0o700)
            (private_tmp / name / "api_key.yaml").write_text("{}")
        path = write_server_key_file(KEY)
        left = {p.name for p in private_tmp.iterdir()}
        assert names["dead"] not in left
        assert {names[k] for k in ("live", "mine", "other_host", "unrelated")} <= left
        assert path.parent.name.startswith(f"sglang_key-{host}-{os.getpid()}-")  # this run's own, by its owner
        remove_server_key_file(path)
    finally:
        live.kill()
        live.wait()


def test_wide_bind_without_a_key_is_one_error_line_naming_the_flags(tmp_path, capsys, monkeypatch):
    """`--sglang-host 0.0.0.0` with no key is refused with the other flag checks: `error: ...` naming
    --sglang-host, --sglang-api-key-file and the opt-out, exit status 2, before any model is built (it was a
    ValueError traceback from ServerConfig after the actor was built). A key, the opt-out or attach mode pass."""
    from tests.unit.trainer.test_validation import make_model_dir, parse

    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    model, data = make_model_dir(tmp_path), tmp_path / "train.jsonl"
    wide = ["--rollout-engine", "sglang", "--sglang-host", "0.0.0.0"]
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-steps", "1", "--max-prompt-length",
            "16", "--max-response-length", "8", "--overlong-buffer-length", "4", *wide]
    with pytest.raises(SystemExit) as exit_info:
        train_mod.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for flag in ("--sglang-host 0.0.0.0", "--sglang-api-key-file", "--sglang-allow-no-api-key"):
        assert flag in err[0]
    key = _key_file(tmp_path, "k")
    for ok in (["--sglang-api-key-file", str(key)], ["--sglang-allow-no-api-key"],
               ["--sglang-server-urls", "http://10.0.0.1:30000"]):
        check_flags(parse(model, data, *wide, *ok))


# ---- the key filtered out of what a keyed process prints --------------------------------------------------


def _printed(key: str) -> tuple[bytes, bytes]:
    """A log as SGLang writes it (its ServerArgs as a dict's repr, a JSON line, the key bare and twice in a row) and
    that log redacted, written out by hand: each form of the key replaced by the marker, quotes kept."""
    r, j, k = repr(key).encode(), json.dumps(key).encode(), key.encode()
    text = b"server_args={'model_path': 'm', 'api_key': " + r + b", 'port': 30000}\n" + b'{"api_key": ' + j + \
        b"}\n" + b"key=" + k + k + b" end\n"
    want = b"server_args={'model_path': 'm', 'api_key': " + r[:1] + REDACTED + r[-1:] + b", 'port': 30000}\n" + \
        b'{"api_key": "' + REDACTED + b'"}\n' + b"key=" + REDACTED + REDACTED + b" end\n"
    return text, want


@pytest.mark.parametrize("key", [KEY, "plainKEY-0123456789abcdef", "Q"], ids=["escaped", "plain", "one-char"])
def test_redactor_removes_every_form_of_the_key_however_the_stream_is_cut(key):
    """The output's pieces are whatever the pipe's reads return: a key cut in two (at every position), or fed a
    byte at a time, comes out redacted the same as the whole text at once."""
    text, want = _printed(key)
    assert len(secret_forms(key)) == (3 if key == KEY else 1)  # the quote and backslash escape in repr and JSON
    whole = Redactor(key)
    assert whole.feed(text) + whole.close() == want
    for cut in range(len(text) + 1):
        r = Redactor(key)
        assert r.feed(text[:cut]) + r.feed(text[cut:]) + r.close() == want, cut
    r = Redactor(key)
    assert b"".join(r.feed(text[i:i + 1]) for i in range(len(text))) + r.close() == want
    if len(key) > 1:  # a key cut off by the writer's death
        r = Redactor(key)
        assert r.feed(b"x" + key.encode()[:-1]) + r.close() == b"x" + REDACTED
    with pytest.raises(ValueError, match="non-empty"):
        Redactor("")


PRINTING_SERVER = """
import os, subprocess, sys, yaml
args = sys.argv[1:]
key = yaml.safe_load(open(args[args.index("--config") + 1]))["api-key"]
half = len(key) // 2
sys.stdout.write("server_args={'api_key': " + repr(key)[:half])  # two writes: the key split between them
sys.stdout.flush()
sys.stdout.write(repr(key)[half:] + "}\\n")
sys.stdout.flush()
print("stderr: " + key, file=sys.stderr, flush=True)
subprocess.run([sys.executable, "-c", "import sys; print('child: ' + sys.argv[1], flush=True)", key], check=True)
os.execv(sys.executable, [sys.executable, FAKE_SERVER, *args])
"""
"""A stand-in for sglang.launch_server that prints the key it read from --config as SGLang does (its ServerArgs, on
stdout, in two writes), on stderr, and from a child process (as SGLang's scheduler would), then serves."""


def _printing_python(tmp_path: Path) -> Path:
    script = tmp_path / "printing_server.py"
    script.write_text(f"FAKE_SERVER = {str(REPO / 'tests' / 'sglang' / 'fake_server.py')!r}\n" + PRINTING_SERVER)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_what_a_keyed_server_prints_reaches_its_log_without_the_key(tmp_path, private_tmp):
    """A keyed group of stand-ins that print the key (stdout, stderr, a child process): every file under the log
    directory lacks the key in any form, and each print is in the log with the marker where the key was; the copy
    still runs after a restart (server 0 killed and started again) and the log is complete once stop() returns."""
    cfg = _keyed_pair(tmp_path, _printing_python(tmp_path))
    group = ServerGroup(cfg)
    group.start()
    try:
        group.restart(0)
    finally:
        group.stop()
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name for p in logs] == ["sglang_0.log", "sglang_1.log"]
    for path in logs:
        text = path.read_bytes()
        assert not [f for f in secret_forms(KEY) if f in text], text
        starts = 2 if path.name == "sglang_0.log" else 1
        marked = (b"server_args={'api_key': '" + REDACTED + b"'}\n", b"stderr: " + REDACTED + b"\n",
                  b"child: " + REDACTED + b"\n")
        assert [text.count(m) for m in marked] == [starts] * 3, text
