"""The API key filtered out of a launched server's (or router's) output before it reaches the log file.

SGLang 0.5.23 logs its whole ServerArgs at start (`server_args={...}`, engine.py), the API key among them, and it
is not alone: its scheduler / detokenizer children, crash reports and sglang-router (Rust) write to the same
stdout / stderr. So a keyed launch (ServerProcess, the trainer's own servers and the Slurm rollout nodes') gives
the process a pipe instead of the log file, and a thread of the launcher copies the pipe to the file through
`Redactor`, which writes every occurrence of the key as `<redacted>`. Filtering the byte stream, rather than
patching SGLang's own print, covers every process that writes there, whatever version prints whatever.

The key reaches the server in a 0600 `--config` file, never on a command line (api_key.py): the filter is for what
the server prints, not for how the key gets there.

Cost: one thread a launched process, blocked in read(2) between writes; a server logs a few hundred bytes a second
(one "Decode batch" line every 40 decode steps), so the copy takes microseconds a second, also with 16 servers a
rollout node.
"""

from __future__ import annotations

import json
import os
import threading

REDACTED = b"<redacted>"
"""What the log shows where the process printed the key (trainer/run_record.py's marker is this one too)."""
READ_BYTES = 65536
"""At most this many bytes a read (a pipe's default capacity)."""


def secret_forms(secret: str) -> tuple[bytes, ...]:
    """The byte strings a log can carry `secret` as: itself, inside a JSON string and inside a Python repr
    (SGLang prints its arguments as a dict's repr, so a key with a quote or backslash appears escaped); longest
    first, so that a form containing another is replaced whole."""
    forms = {secret, json.dumps(secret)[1:-1], repr(secret)[1:-1]}
    return tuple(sorted((f.encode() for f in forms), key=len, reverse=True))


class Redactor:
    """Rewrites a byte stream, fed in pieces of any size, with every form of `secret` (secret_forms) replaced by
    REDACTED. A piece's tail that could be the start of the secret is held back until the next piece shows
    whether it is: a key split across two writes (or two reads of the pipe) is still found."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("Redactor needs a non-empty secret")
        self.forms = secret_forms(secret)
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        """The part of the stream so far (the held tail, then `data`) that is safe to write now, redacted."""
        buf = self.held + data
        for form in self.forms:
            buf = buf.replace(form, REDACTED)
        keep = self._partial_tail(buf)
        self.held = buf[len(buf) - keep:] if keep else b""
        return buf[:len(buf) - keep]

    def close(self) -> bytes:
        """The end of the stream: a held tail is the beginning of the key cut off by the writer's death (logs end
        with a newline, which no key holds: api_key.check_key), so it is written as REDACTED too."""
        held, self.held = self.held, b""
        return REDACTED if held else b""

    def _partial_tail(self, buf: bytes) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a form of the secret (0 if none)."""
        for k in range(min(len(buf), len(self.forms[0]) - 1), 0, -1):
            tail = buf[-k:]
            if any(len(f) > k and f.startswith(tail) for f in self.forms):
                return k
        return 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def start_redacting_copy(read_fd: int, log_fd: int, secret: str, name: str) -> threading.Thread:
    """A daemon thread that copies `read_fd` (the read end of the process's stdout / stderr pipe) to `log_fd`
    through a Redactor until every writer closed the pipe, then closes both descriptors (it owns them)."""

    def copy() -> None:
        redactor = Redactor(secret)
        try:
            while chunk := os.read(read_fd, READ_BYTES):
                _write_all(log_fd, redactor.feed(chunk))
            _write_all(log_fd, redactor.close())
        finally:
            os.close(read_fd)
            os.close(log_fd)

    thread = threading.Thread(target=copy, name=f"log-redact {name}", daemon=True)
    thread.start()
    return thread
