"""Running Python code the policy wrote, in a jail whose limits hold against hostile code.

`run_python(code, limits)` runs `code` with the base interpreter (`sys.base_prefix`'s Python, `python -I -c`, the
standard library only: the base interpreter's site-packages are hidden under an empty tmpfs, the venv's are never
on its path) in new user, mount, pid, network, IPC and UTS namespaces, and returns a `ToolResult`.

The jail is built by a separate launcher process, `tool_use/jail.py` (its docstring has the process tree), rather
than by ctypes calls in the trainer: unshare(CLONE_NEWUSER) refuses a multithreaded caller, and forking the trainer
to make one is slow (its mappings) and unsafe (locks held by other threads). The launcher is itself run by the base
interpreter with `-I -S`, a fresh single-threaded process of about 10 MB.

What holds the code (docs/TOOL_SANDBOX.md has the table of attacks and their outcomes):

- file system: a read-only root holding /usr, /lib*, /bin and the Python prefix (read-only binds), a fresh /proc of
  its pid namespace, /dev/null, /dev/zero, /dev/urandom, and a tmpfs of `max_file_mib` MiB as /tmp and cwd. Nothing
  of /work, /root, /home, /etc or the host's /tmp is visible.
- network: a new network namespace with only its loopback, down: no network at all.
- identity: uid/gid 1000 inside, mapped to host uid 65534 when the trainer is root (RLIMIT_NPROC does not apply to
  host root, so a fork bomb would otherwise run free), else to the trainer's own uid; no capabilities (bounding set
  empty, securebits locked), no_new_privs.
- rlimits: RLIMIT_CPU (`cpu_s`, SIGXCPU), RLIMIT_AS (`memory_mib`), RLIMIT_NPROC (`max_processes`, counted in the
  jail's own user namespace), RLIMIT_NOFILE (`max_open_files`), RLIMIT_FSIZE (`max_file_mib`), RLIMIT_CORE 0.
- time: the launcher SIGKILLs the pid namespace's init at `wall_s`; the kernel then kills every process in the
  namespace, and the call returns after all are gone (daemons and fork bombs included).
- output: stdout and stderr are read with a bound: at most `max_output_bytes` bytes are kept, and the run is
  stopped (error 'output limit', truncated=True) as soon as it writes more.

Needs: Linux user namespaces (`check_sandbox` says which sysctl to change when they are off); no root.
"""

from __future__ import annotations

import contextlib
import marshal
import math
import os
import selectors
import signal
import site
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

JAIL = Path(__file__).resolve().with_name("jail.py")
MAX_CODE_BYTES = 131071
"""The longest code accepted (UTF-8 bytes): the kernel's limit on one exec argument (MAX_ARG_STRLEN) less the NUL."""
LAUNCHER_GRACE_S = 2.0
"""How long past `wall_s` the trainer waits for the launcher before killing its process group itself."""
STATUS_BYTES = 65536
"""The most the trainer reads of the launcher's status pipe."""
STDERR_LINES_FOR_POLICY = 20
"""How many of the last stderr lines (the traceback's end) `ToolResult.for_policy` shows on a failure."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one execution may use. The defaults fit a math-tool call."""

    cpu_s: int = 5
    """CPU seconds (user + system) of each process of the code: RLIMIT_CPU, SIGXCPU at cpu_s, SIGKILL a second
    later."""
    wall_s: float = 10.0
    """Wall-clock seconds from the start of the call; the jail's pid namespace is killed then."""
    memory_mib: int = 1024
    """Address space of each process in MiB: RLIMIT_AS (Python raises MemoryError)."""
    max_processes: int = 16
    """Processes and threads of the code at once: RLIMIT_NPROC in the jail's user namespace (the jail's own two
    supervising processes are added to the rlimit, not taken from this)."""
    max_open_files: int = 64
    """File descriptors per process: RLIMIT_NOFILE."""
    max_output_bytes: int = 65536
    """Bytes of stdout + stderr kept; the run is stopped once it writes more (ToolResult.truncated)."""
    max_file_mib: int = 16
    """MiB the code may write: the size of its tmpfs (/tmp, its cwd) and RLIMIT_FSIZE."""

    def __post_init__(self) -> None:
        minimum = {"cpu_s": 1, "wall_s": 0.1, "memory_mib": 64, "max_processes": 1, "max_open_files": 8,
                   "max_output_bytes": 1, "max_file_mib": 1}
        why = {"memory_mib": " (the interpreter needs about 40 MiB of address space to start)",
               "max_open_files": " (the interpreter opens a few files to start)"}
        for f in fields(self):
            value = getattr(self, f.name)
            kind = float if f.name == "wall_s" else int
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise ValueError(f"SandboxLimits.{f.name} must be {'a number' if kind is float else 'an integer'}, "
                                 f"got {value!r}")
            if not (math.isfinite(value) and value >= minimum[f.name]):
                raise ValueError(f"SandboxLimits.{f.name} must be >= {minimum[f.name]}{why.get(f.name, '')}, "
                                 f"got {value!r}")

    def rlimits(self) -> list[tuple[str, int, int]]:
        """(resource name, soft, hard) for the code's process, as the launcher applies them."""
        mib = 1 << 20
        return [("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1), ("RLIMIT_AS", self.memory_mib * mib, self.memory_mib * mib),
                ("RLIMIT_NPROC", self.max_processes + 2, self.max_processes + 2),
                ("RLIMIT_NOFILE", self.max_open_files, self.max_open_files),
                ("RLIMIT_FSIZE", self.max_file_mib * mib, self.max_file_mib * mib), ("RLIMIT_CORE", 0, 0)]


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one execution."""

    stdout: str
    """The captured stdout, decoded as UTF-8 with errors='replace'."""
    stderr: str
    """The captured stderr (a traceback, on an exception), decoded likewise."""
    exit_code: int | None
    """The code's exit status; None when it did not exit by itself (a signal, the wall limit, a jail error)."""
    error: str | None
    """None, or a short label: 'timeout', 'cpu limit', 'memory limit', 'output limit', 'killed by signal N',
    'code too long', 'cancelled', 'sandbox error: ...'. A nonzero exit without a label is the code's own failure."""
    wall_s: float
    """Wall-clock seconds of the call."""
    truncated: bool = False
    """Whether output beyond max_output_bytes was discarded."""

    @property
    def ok(self) -> bool:
        """Whether the code ran to a zero exit status within its limits."""
        return self.error is None and self.exit_code == 0

    def for_policy(self, max_chars: int) -> str:
        """The text the policy is shown, at most `max_chars` characters: stdout; on a failure also the last
        STDERR_LINES_FOR_POLICY lines of stderr (the traceback's end) and a line naming the error or exit status.
        A longer text keeps its head and tail around a marker saying how many characters were cut."""
        if max_chars < 64:
            raise ValueError(f"for_policy: max_chars must be >= 64 (room for the cut marker), got {max_chars}")
        parts = [self.stdout]
        if self.truncated:
            parts.append("[output truncated: the program wrote more than the sandbox keeps]\n")
        if not self.ok:
            tail = "\n".join(self.stderr.rstrip("\n").splitlines()[-STDERR_LINES_FOR_POLICY:])
            if tail:
                parts.append(tail + "\n")
            parts.append(f"[error: {self.error}]" if self.error else f"[exit code {self.exit_code}]")
        text = "".join(p if p.endswith("\n") or p is parts[-1] else p + "\n" for p in parts if p)
        if len(text) <= max_chars:
            return text
        cut = len(text) - max_chars
        while True:  # the marker's own length depends on the count it prints
            marker = f"\n[... {cut} characters cut ...]\n"
            need = len(text) - (max_chars - len(marker))
            if need == cut:
                break
            cut = need
        keep = max_chars - len(marker)
        head = keep // 2
        return text[:head] + marker + text[len(text) - (keep - head):]


def base_python() -> str:
    """The base interpreter's executable (not the venv's), resolved."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(exe)


def jail_config(limits: SandboxLimits, status_fd: int) -> dict:
    """The launcher's configuration (jail.py reads it from its first argument)."""
    python = base_python()
    prefix = os.path.realpath(sys.base_prefix)
    extra = [prefix] if python.startswith(prefix + "/") else [prefix, os.path.dirname(python)]
    hide = [os.path.realpath(p) for p in site.getsitepackages([sys.base_prefix])]
    return {"python": python, "extra_dirs": extra, "hide_dirs": hide, "wall_s": limits.wall_s,
            "max_file_mib": limits.max_file_mib, "rlimits": limits.rlimits(), "status_fd": status_fd,
            "parent_pid": os.getpid()}


@dataclass(eq=False)
class Execution:
    """One running execution: `stop()` (any thread) ends it, `wait()` (one thread) collects its ToolResult."""

    code: str
    limits: SandboxLimits
    started: float = field(default_factory=time.monotonic)
    stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.reject: str | None = None
        if "\0" in self.code or len(self.code.encode("utf-8", "surrogateescape")) > MAX_CODE_BYTES:
            self.reject = "code too long" if "\0" not in self.code else "code contains a NUL character"
            return
        status_r, status_w = os.pipe()
        config = marshal.dumps(jail_config(self.limits, status_w)).hex()
        try:
            self.proc = subprocess.Popen(
                [base_python(), "-I", "-S", str(JAIL), config, self.code],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                start_new_session=True, env={})
        except OSError:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self.status_r = status_r

    def stop(self) -> None:
        """Cancel: ask the launcher to kill the jail (the result says 'cancelled'); idempotent, thread-safe."""
        self.stopped = True
        self._close_control()

    def _close_control(self) -> None:
        """Close the launcher's control pipe: it kills the jail's init, and with it every process of the jail."""
        with self._lock:
            if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()

    def _kill_launcher(self) -> None:
        """The backstop when the launcher outlives its own deadline: SIGKILL its process group (the launcher and C;
        I follows C by its death signal)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self) -> ToolResult:
        """Read the output with a bound until the launcher is gone; then the ToolResult."""
        if self.proc is None:
            return ToolResult("", "", None, self.reject, time.monotonic() - self.started)
        limit = self.limits.max_output_bytes
        out = {self.proc.stdout.fileno(): bytearray(), self.proc.stderr.fileno(): bytearray()}
        status = bytearray()
        truncated = backstop_hit = False
        backstop = self.started + self.limits.wall_s + LAUNCHER_GRACE_S
        with selectors.DefaultSelector() as sel:
            for fd in (*out, self.status_r):
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = backstop - time.monotonic()
                if left <= 0:
                    if backstop_hit:  # the tree did not die with its launcher: stop reading, keep what we have
                        break
                    self._kill_launcher()
                    backstop_hit = True
                    backstop += LAUNCHER_GRACE_S
                    continue
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == self.status_r:
                        chunk = os.read(fd, 4096)
                        status += chunk[:max(0, STATUS_BYTES - len(status))]
                    else:
                        room = limit - sum(len(b) for b in out.values())
                        chunk = os.read(fd, min(65536, room + 1) if not truncated else 65536)
                        if not truncated:
                            out[fd] += chunk[:room]
                            if len(chunk) > room:
                                truncated = True
                                self._close_control()
                    if not chunk:
                        sel.unregister(fd)
        os.close(self.status_r)
        self._close_control()
        try:
            self.proc.wait(timeout=LAUNCHER_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill_launcher()
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()
        stdout, stderr = (bytes(b).decode("utf-8", "replace") for b in out.values())
        exit_code, error = self._verdict(status.decode("utf-8", "replace"), stderr, truncated, backstop_hit)
        return ToolResult(stdout, stderr, exit_code, error, time.monotonic() - self.started, truncated)

    def _verdict(self, status: str, stderr: str, truncated: bool, backstop_hit: bool) -> tuple[int | None, str | None]:
        """(exit_code, error label) from the launcher's status lines and how the reading ended."""
        lines = status.splitlines()
        errors = [line.removeprefix("error ") for line in lines if line.startswith("error ")]
        exits = [int(line.split()[1]) for line in lines if line.startswith("exit ")]
        if truncated:
            return None, "output limit"
        if errors:
            return None, f"sandbox error: {errors[0]}"
        if "timeout" in lines or backstop_hit:
            return None, "timeout"
        if not exits:
            if self.stopped:
                return None, "cancelled"
            return None, f"sandbox error: the launcher exited with status {self.proc.returncode} and no report"
        wait_status = exits[0]
        if os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
            return None, "cpu limit" if sig == signal.SIGXCPU else f"killed by signal {sig}"
        code = os.waitstatus_to_exitcode(wait_status)
        last = stderr.rstrip().rsplit("\n", 1)[-1]
        if code != 0 and last.startswith("MemoryError"):
            return code, "memory limit"
        return code, None


def run_python(code: str, limits: SandboxLimits) -> ToolResult:
    """Run `code` in the jail (module docstring) and return its result; blocks for at most about `limits.wall_s`
    seconds. Costs one launcher and one interpreter start (docs/TOOL_SANDBOX.md: the measured overhead)."""
    return Execution(code, limits).wait()


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here; the message names the cause and the setting that fixes it."""


def check_sandbox(limits: SandboxLimits | None = None) -> None:
    """Run one trivial program in the jail; raise SandboxUnavailable naming the cause (and, when namespaces are
    off, the sysctl to change) unless it printed what it should. Call it at start-up: no code ever runs outside the
    jail."""
    result = run_python("print(6 * 7)", limits or SandboxLimits())
    if result.ok and result.stdout == "42\n":
        return
    raise SandboxUnavailable(f"the code sandbox does not work on this machine: {result.error or 'no error'}; "
                             f"exit code {result.exit_code}, stdout {result.stdout[-200:]!r}, "
                             f"stderr {result.stderr[-500:]!r}")
