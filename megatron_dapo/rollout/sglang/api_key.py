"""The SGLang API key: where the trainer reads it, and the private file that hands it to launched servers.

Why not argv: every user of a node can read every process's command line (ps, /proc/<pid>/cmdline), and
SGLang's weight endpoints unpickle what they receive, so whoever reads the key can run code on the rollout
GPUs. The trainer therefore reads it from --sglang-api-key-file (a file only its owner can read) or the
SGLANG_API_KEY environment variable (/proc/<pid>/environ is readable by the owner only); --sglang-api-key
still works but is visible in ps. Launched servers get it through a 0600 YAML file given to SGLang's
own --config option, and the router through the same file (megatron_dapo.rollout.sglang.router_launch).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from megatron_dapo.distributed.stale_dirs import owner_tag, remove_dead_owners

SERVER_KEY_FILE = "api_key.yaml"
"""Name of the key file in a server group's private directory (SGLang's --config wants a .yaml suffix)."""
KEY_DIR_PREFIX = "sglang_key-"
KEY_DIR = re.compile(rf"^{KEY_DIR_PREFIX}(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+$")
"""A key directory: `sglang_key-<host>-<pid>-<random>` (tempfile.mkdtemp's random part has no '-'), so that a
later start can tell one whose trainer was SIGKILLed (its pid is gone) from one in use."""


def check_key(key: str, source: str) -> str:
    """`key` if it can be a bearer token (non-empty, printable ASCII, no whitespace) that SGLang's argument
    parser takes as a value (no leading '-'); else ValueError naming `source` (the flag, variable or file)."""
    if not key:
        raise ValueError(f"the SGLang API key from {source} is empty: give a real key or none")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"the SGLang API key from {source} has whitespace, control or non-ASCII characters; it "
                         f"is sent as an HTTP 'Authorization: Bearer' header, which cannot carry them")
    if key.startswith("-"):
        raise ValueError(f"the SGLang API key from {source} starts with '-', which SGLang's and sglang-router's "
                         f"argument parsers take for an option: pick another key")
    return key


def read_key_file(path: str | os.PathLike, *, flag: str = "--sglang-api-key-file") -> str:
    """The key in the key file `path` (given as `flag`): its text without surrounding whitespace (a trailing
    newline of `echo key > file`). ValueError naming the flag when the file is missing, not a regular file,
    readable or writable by group or others (it must be mode 0600 or 0400), or empty."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag} {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"{flag} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read or write "
                         f"the key; `chmod 600 {path}`")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err})") from None
    key = text.strip()
    if not key:
        raise ValueError(f"{flag} {path}: the file is empty; write the key into it")
    return check_key(key, f"{flag} {path}")


def resolve_api_key(key: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The trainer's SGLang API key: --sglang-api-key-file, else --sglang-api-key, else $SGLANG_API_KEY, else
    None. Both flags at once is a ValueError (which one is meant?)."""
    if key_file is not None:
        if key is not None:
            raise ValueError("give the SGLang API key once: --sglang-api-key-file or --sglang-api-key, not both")
        return read_key_file(key_file)
    if key is not None:
        return check_key(key, "--sglang-api-key")
    env = environ.get("SGLANG_API_KEY")
    return check_key(env, "SGLANG_API_KEY") if env else None


def write_server_key_file(api_key: str) -> Path:
    """Writes `api_key` as SGLang config YAML ({"api-key": ...}; JSON, which YAML reads too) to a new file of
    mode 0600 in a new directory of mode 0700 under the temp dir; returns the file's path. Remove it with
    remove_server_key_file. First removes the key directories that SIGKILLed trainers of this host left there
    (remove_stale_key_dirs)."""
    remove_stale_key_dirs()
    # 0700, a fresh name: no one else's file or link
    directory = Path(tempfile.mkdtemp(prefix=f"{KEY_DIR_PREFIX}{owner_tag()}-"))
    path = directory / SERVER_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"api-key": api_key}) + "\n")
    except BaseException:
        remove_server_key_file(path)
        raise
    return path


def remove_stale_key_dirs(parent: str | os.PathLike[str] | None = None) -> list[str]:
    """Removes the key directories under `parent` (default: the temp dir) whose trainer on this host is no longer
    alive (a SIGKILL skips ServerGroup.stop); returns their names. Those of live processes stay."""
    return remove_dead_owners(parent if parent is not None else tempfile.gettempdir(), KEY_DIR)


def read_server_key_file(path: str | os.PathLike) -> str:
    """The key that write_server_key_file wrote to `path`."""
    with open(path) as f:
        return json.load(f)["api-key"]


def remove_server_key_file(path: str | os.PathLike) -> None:
    """Deletes a write_server_key_file file and its directory; no error when they are already gone."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(FileNotFoundError):
        path.parent.rmdir()
