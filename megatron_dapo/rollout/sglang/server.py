"""Launching and supervising SGLang server processes (and sglang-router in front of several).

Each server is `python -m sglang.launch_server` in its own process group, bound to 127.0.0.1 unless told
otherwise; the interpreter can be another venv's (SGLang never has to be importable in the trainer).

Security: SGLang's weight endpoints (/update_weights_from_tensor) unpickle what they are sent, so anyone who
can reach a server can run code in it. Servers bind to loopback by default; a wider bind needs an API key
(--sglang-api-key-file, SGLANG_API_KEY or --sglang-api-key; sent by the client as `Authorization: Bearer`),
or an explicit --sglang-allow-no-api-key.

The key is on no process's command line (which every user of the node can read with ps): ServerGroup.start
writes it to a 0600 file in a fresh 0700 directory (api_key.write_server_key_file) that servers read through
SGLang's --config option (YAML merged into their arguments in-process; their scheduler / detokenizer children
are multiprocessing spawns that get their arguments through a pipe) and the router through
megatron_dapo.rollout.sglang.router_launch. ServerGroup.stop deletes it (a failed start stops the group); only
a trainer killed with SIGKILL leaves it behind, still readable by its owner only, until the next keyed start
on that host removes it (api_key.remove_stale_key_dirs). SGLang logs its arguments, key included: a keyed
process writes into a pipe, and a thread of the launcher copies it to the log file with the key replaced by
<redacted> (log_redact.py). The logs of a keyed group are still created 0600, for a key printed in a form the
filter does not know (base64, say).

Lifetime: every launched process gets PR_SET_PDEATHSIG=SIGKILL, so a trainer killed with SIGKILL takes its
servers with it (SGLang's own scheduler / detokenizer children die with their server the same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from megatron_dapo.rollout.sglang.api_key import check_key, remove_server_key_file, write_server_key_file
from megatron_dapo.rollout.sglang.log_redact import start_redacting_copy


@dataclass(kw_only=True)
class ServerConfig:
    """Where and how to run the SGLang servers of one rollout engine."""

    model_path: str
    """HF model directory the servers load first (--hf-checkpoint)."""
    num_servers: int = 1
    """Independent servers (data parallel rollout); --sglang-num-servers."""
    tp_per_server: int = 1
    """Tensor parallel GPUs per server; server i uses GPUs [i*tp, (i+1)*tp) (--sglang-tp-size)."""
    base_port: int = 30000
    """Server i listens on base_port + i; the router on base_port + num_servers."""
    host: str = "127.0.0.1"
    """Bind address. Keep loopback unless trainer and servers are on different hosts."""
    device: str = "cuda"
    """'cuda', or 'cpu' for SGLang's torch-native CPU path (tests, tools/setup_sglang_env.sh)."""
    extra_args: tuple[str, ...] = ()
    """Passed verbatim to sglang.launch_server (e.g. ('--mem-fraction-static', '0.7'))."""
    startup_timeout_s: float = 600.0
    router: bool | None = None
    """Put sglang-router in front (default: when num_servers > 1)."""
    python: str = sys.executable
    """Interpreter with sglang installed (e.g. .venv-sglang/bin/python)."""
    log_dir: str | None = None
    """Server logs go to log_dir/sglang_<i>.log (default: a temp dir)."""
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    """SGLang's api_key of each server (and the router); required when `host` is not loopback
    (--sglang-api-key-file, SGLANG_API_KEY or --sglang-api-key). Handed over in a 0600 file, never on a command
    line (see the module docstring)."""
    return_routed_experts: bool = False
    """Start the servers with --enable-return-routed-experts (--moe-routing-replay): they record the experts each
    token is routed to (SGLang 0.5.23 keeps a host buffer of max_total_tokens x layers x top_k int32: at
    Qwen3-30B-A3B 1,536 B a token) and return them when a request asks. On CPU the buffer's pin_memory needs the
    no-op `_cuda_host_register` of tools/sgl_kernel_stub/megatron_dapo_cpu_guard.py."""
    allow_no_api_key: bool = False
    """Allow a non-loopback `host` without an API key (--sglang-allow-no-api-key): anyone who can reach the
    port can then push pickled tensors, i.e. run code, in the server."""
    skip_tokenizer_init: bool = True
    """--skip-tokenizer-init (token ids in and out: the trainer owns tokenization). False: the servers load their
    tokenizer and answer /tokenize and /detokenize, as a --teacher-url teacher's check asks
    (rollout/sglang/teacher.py)."""

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"ServerConfig.num_servers must be >= 1 (--sglang-num-servers), got "
                f"{self.num_servers}")
        if self.tp_per_server < 1:
            raise ValueError(f"ServerConfig.tp_per_server must be >= 1 (--sglang-tp-size), got "
                f"{self.tp_per_server}")
        if not 1024 <= self.base_port <= 65535 - self.num_servers:
            raise ValueError(f"ServerConfig.base_port {self.base_port} leaves no room for "
                f"{self.num_servers} ports")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"ServerConfig.device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError("ServerConfig.startup_timeout_s must be > 0")
        if self.api_key == "":
            raise ValueError("ServerConfig.api_key is empty: give a real key (--sglang-api-key-file / "
                             "SGLANG_API_KEY) or none")
        if self.api_key is not None:
            check_key(self.api_key, "ServerConfig.api_key")
        check_key_args(self.extra_args, self.api_key)
        check_bind(self.host, self.api_key, allow_no_api_key=self.allow_no_api_key)
        if self.router is None:
            self.router = self.num_servers > 1
        self.extra_args = tuple(self.extra_args)

    @property
    def memory_saver(self) -> bool:
        """Whether the servers run with --enable-memory-saver (torch_memory_saver; --colocate adds it)."""
        return "--enable-memory-saver" in self.extra_args

    def server_url(self, i: int) -> str:
        return f"http://{self.host}:{self.base_port + i}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.base_port + self.num_servers}"

    def server_command(self, i: int, key_file: str | None = None) -> list[str]:
        """Server i's command line; `key_file` (api_key.write_server_key_file) is required when api_key is set:
        SGLang reads the key from it (--config), not from the command line."""
        cmd = [
            self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
            "--host", self.host, "--port", str(self.base_port + i), "--tp-size", str(self.tp_per_server),
            *(["--skip-tokenizer-init"] if self.skip_tokenizer_init else []),  # ids in, ids out
            # Otherwise an idle server spins: TP rank 0's scheduler polls its sockets in a busy loop and
            # broadcasts each empty poll to the other TP ranks. Measured on CPU over 20 s idle: 20 CPU-s at
            # TP 1, 27 at TP 2 (rank 0 a whole core, rank 1 about a third); with it, 1. At 32B colocated (two
            # TP 4 engines per node) that is roughly 2 + 6 x 0.3 = 4 host cores per node taken from the
            # trainer's host side (data, optimizer offload copies) for the whole training phase, and in split
            # mode one core per engine on the rollout nodes. Requests wake it at once (a zmq poll on the same
            # sockets).
            "--sleep-on-idle",
        ]
        if self.device == "cpu":
            # What ran on CPU (shared/notes/sglang-on-cpu.md); a KV cache sized from free RAM takes 15 GB, so
            # --max-total-tokens caps it (65536 tokens: 3 GB fp32 at SmolLM2-135M, kilobytes for the tiny test
            # models). SGLang 0.5.23 sizes the pool as free RAM after loading minus (1 - fraction) x free RAM
            # before: at 0.1 anything else taking ~10% of RAM while the server loads (a colocated trainer
            # building its model) left no room at all and the start failed; 0.5 leaves half of it.
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                    "--max-total-tokens", "65536", "--mem-fraction-static", "0.5"]
        else:
            cmd += ["--base-gpu-id", str(i * self.tp_per_server)]
        cmd += trainer_server_flags(moe_routing_replay=self.return_routed_experts)
        return cmd + self._key_args(key_file, "--config") + list(self.extra_args)

    def router_command(self, key_file: str | None = None) -> list[str]:
        """The router's command line: sglang_router itself without an API key; with one, through
        megatron_dapo.rollout.sglang.router_launch, which reads the key from `key_file` (required then) and so
        needs megatron_dapo importable in `python`."""
        urls = [self.server_url(i) for i in range(self.num_servers)]
        return router_command(self.python, self.host, self.base_port + self.num_servers, urls,
                              self._key_args(key_file, "--api-key-file"))

    def _key_args(self, key_file: str | None, option: str) -> list[str]:
        if self.api_key is None:
            return []
        if key_file is None:
            raise ValueError("ServerConfig has an api_key: pass the key_file it was written to "
                             "(api_key.write_server_key_file); it never goes on a command line")
        return [option, str(key_file)]


RETURN_ROUTES_FLAG = "--enable-return-routed-experts"


def trainer_server_flags(*, moe_routing_replay: bool) -> tuple[str, ...]:
    """The sglang.launch_server flags the trainer's flags require of every server it uses, launched or attached:
    --enable-return-routed-experts with --moe-routing-replay (without it a /generate that asks for the routed
    experts gets none, and the run stops at the first response: protocol.parse_generate_response). The one rule
    for the servers ServerConfig launches (`return_routed_experts`) and for those a launcher starts
    (launch/server_args.py: examples/slurm/job.sh, the by-hand launchers). Cost at Qwen3-30B-A3B:
    ServerConfig.return_routed_experts (server) and ClientConfig.routing (rank 0)."""
    return (RETURN_ROUTES_FLAG,) if moe_routing_replay else ()


def router_command(python: str, host: str, port: int, worker_urls: list[str], key_args: list[str]) -> list[str]:
    """sglang-router on `host:port` in front of `worker_urls`, round robin: sglang_router itself, or with
    `key_args` (["--api-key-file", PATH]) megatron_dapo.rollout.sglang.router_launch, which reads the key from
    PATH so that no command line carries it."""
    entry = "megatron_dapo.rollout.sglang.router_launch" if key_args else "sglang_router.launch_router"
    return [python, "-m", entry, *key_args, "--host", host, "--port", str(port), "--policy", "round_robin",
            "--worker-urls", *worker_urls]


def check_key_args(extra_args: Sequence[str], api_key: str | None) -> None:
    """ValueError naming --sglang-extra-args when a keyed launch's servers would get their key from it: --api-key
    (on the command line, which ps shows) or --config (the option the key is handed over through). Checked with
    the other flags (RolloutEngineConfig) and again by ServerConfig."""
    if api_key is None:
        return
    for arg in extra_args:
        if arg == "--api-key" or arg.startswith("--api-key="):
            raise ValueError("--sglang-extra-args has --api-key, which puts the key on the servers' command "
                             "line for every user of the node to read: give it with --sglang-api-key-file "
                             "or SGLANG_API_KEY")
        if arg == "--config" or arg.startswith("--config="):
            raise ValueError("--sglang-extra-args has --config, which SGLang takes once and which a keyed "
                             "launch uses to hand over the API key: pass those options as "
                             "flags in --sglang-extra-args instead")


def check_bind(host: str, api_key: str | None, *, allow_no_api_key: bool) -> None:
    """ValueError naming the flags unless launched servers may bind `host`: loopback, or with an API key, or
    with the explicit opt-out. Checked with the other flags (RolloutEngineConfig) and again by ServerConfig."""
    if not is_loopback(host) and api_key is None and not allow_no_api_key:
        raise ValueError(
            f"refusing to launch SGLang servers bound to --sglang-host {host} without an API key: their weight "
            f"endpoints unpickle what they receive, so anyone reaching the port can run code in them. Give a key "
            f"with --sglang-api-key-file (or SGLANG_API_KEY), bind --sglang-host 127.0.0.1, or pass "
            f"--sglang-allow-no-api-key on a trusted network")


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1 (a bind only this machine can reach)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


_PR_SET_PDEATHSIG = 1


def _die_with_parent(prctl, parent_pid: int) -> None:
    """preexec_fn of every launched process: SIGKILL it when the launching thread's process dies.

    The kernel sends the signal when the *thread* that forked exits, so launches happen on threads that live
    as long as the engine (the main thread, or the engine's launcher thread). `prctl` is resolved before the
    fork: nothing here loads a library in the child of a threaded parent."""
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(113)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(114)


TORCHRUN_ENV_PREFIXES = ("TORCHELASTIC_",)
TORCHRUN_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
})
"""What torchrun puts in its workers' environment. A server launched from a torchrun rank must not inherit it:
SGLang's own torch.distributed init then joins the trainer's store (TORCHELASTIC_USE_AGENT_STORE, MASTER_PORT,
RANK) and hangs at "Init parallel begin"."""


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch's caching-allocator options (the second is the newer name of the first)."""


def without_expandable_segments(conf: str) -> str:
    """torch allocator options `conf` ('key:value,...') without `expandable_segments:True`, the others kept in
    order: torch_memory_saver (SGLang's --enable-memory-saver) refuses it at its first region ("expandable_segments
    is not supported yet"), and the trainers' launchers set it for the actor."""
    return ",".join(o for o in conf.split(",") if o.replace(" ", "") != "expandable_segments:True")


def server_env(parent: dict[str, str], extra: dict[str, str], *, memory_saver: bool = False) -> dict[str, str]:
    """The environment of a launched server or router: `parent` without torchrun's worker variables, plus
    `extra` (which wins); with `memory_saver`, PYTORCH_(CUDA_)ALLOC_CONF without expandable segments (a variable
    left empty is dropped)."""
    kept = {k: v for k, v in parent.items() if k not in TORCHRUN_ENV and not k.startswith(TORCHRUN_ENV_PREFIXES)}
    env = kept | extra
    for var in ALLOC_CONF_VARS if memory_saver else ():
        if var in env:
            env[var] = without_expandable_segments(env[var])
            if not env[var]:
                del env[var]
    return env


LOG_DRAIN_S = 5.0
"""How long an exited process's log copy may take to reach the end of its output before its log tail is read: SGLang's
scheduler and detokenizer children die with their server (PR_SET_PDEATHSIG), within this."""


class ServerProcess:
    """One child process (server or router) with its log file; started in a new session so that
    `stop` ends its whole process tree (SGLang forks scheduler / detokenizer children)."""

    def __init__(self, name: str, command: list[str], url: str, log_path: Path, env: dict[str, str],
                 api_key: str | None = None, *, memory_saver: bool = False):
        self.name, self.command, self.url, self.log_path, self.env = name, command, url, log_path, env
        self.memory_saver = memory_saver
        """Runs with --enable-memory-saver: its allocator options must leave out expandable segments."""
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.secret = api_key
        """Filtered out of the process's output before it reaches the log (log_redact.py): SGLang logs its
        arguments, the key among them."""
        self.proc: subprocess.Popen | None = None
        self.log_copy: threading.Thread | None = None
        """The thread copying a keyed process's output to the log (None without a key: it writes the file)."""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # With a key the log is mode 0600 as well (a key printed in a form the filter does not know).
        private = self.secret is not None
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600 if private else 0o666)
        if private:
            os.fchmod(fd, 0o600)  # also a log an earlier, keyless run left readable
        out, pipe_read = fd, None
        if private:
            pipe_read, out = os.pipe()  # both close-on-exec: only the child's stdout / stderr hold the write end
        parent, prctl = os.getpid(), ctypes.CDLL(None, use_errno=True).prctl
        try:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.environment(dict(os.environ)), start_new_session=True,
                                         preexec_fn=lambda: _die_with_parent(prctl, parent))
        except BaseException:
            for f in {fd, out} | ({pipe_read} if pipe_read is not None else set()):
                os.close(f)
            raise
        os.close(out)
        if pipe_read is not None:  # the copy owns the pipe's read end and the log's descriptor from here
            self.log_copy = start_redacting_copy(pipe_read, fd, self.secret, self.name)

    def finish_log(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for a keyed process's log copy to reach the end of its output (every process of
        its group exited, so the pipe closed): the log then holds all it printed."""
        if self.log_copy is not None:
            self.log_copy.join(timeout_s)

    def environment(self, parent: dict[str, str]) -> dict[str, str]:
        """What the process starts with, launched from a process whose environment is `parent`."""
        return server_env(parent, self.env, memory_saver=self.memory_saver)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        if not self.alive():
            return False
        try:
            return httpx.get(f"{self.url}/health", headers=self.headers, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log "
                    f"tail:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy at {self.url} after {timeout_s:.0f} s; "
            f"log:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Ends the process group (the leader started its own session: pgid == pid), also when the leader is
        already dead and some of its children are not."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            _killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        _killpg(pgid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(grace_s)
        self.finish_log(grace_s)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, chars: int = 3000) -> str:
        """The log's last `chars` characters; of an exited process, once its last words reached the log (up to
        LOG_DRAIN_S later: a child of the process may hold its output open a moment longer)."""
        if self.proc is not None and not self.alive():
            self.finish_log(LOG_DRAIN_S)
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def stop_all(procs: list[ServerProcess], grace_s: float = 10.0) -> None:
    """Ends every process group of `procs` at once: SIGTERM to all, one shared `grace_s` for all to exit, then
    SIGKILL to what is left (also when a leader is dead and some of its children are not). One after the other,
    n processes would take up to n x grace_s, past Slurm's KillWait (30 s by default) for a node of 8 servers."""
    started = [p for p in procs if p.proc is not None]
    for p in started:
        if p.proc.poll() is None:
            _killpg(p.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(max(0.0, deadline - time.monotonic()))
    for p in started:
        _killpg(p.proc.pid, signal.SIGKILL)
        if p.proc.poll() is None:
            p.proc.wait(grace_s)
    deadline = time.monotonic() + grace_s
    for p in started:  # the group is dead: its pipe is closed, the copy only writes what it still holds
        p.finish_log(max(0.0, deadline - time.monotonic()))


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, sig)


def check_ports_free(config: ServerConfig) -> None:
    """Raises naming the port and --sglang-base-port when a port the group will listen on is taken.

    Without it a taken port shows up as a server (or router) that exits a minute later, after loading the
    model (at 32B: ~1-2 min of weight loading), with "Address already in use" deep in its log.
    """
    roles = [(config.base_port + i, f"sglang server {i}") for i in range(config.num_servers)]
    if config.router:
        roles.append((config.base_port + config.num_servers, "sglang router"))
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    for port, role in roles:
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
            try:
                s.bind((config.host, port))
            except OSError as e:
                raise RuntimeError(
                    f"port {port} on {config.host} ({role}: --sglang-base-port {config.base_port} + "
                    f"{port - config.base_port}) is not free ({e.strerror}); pick another --sglang-base-port "
                    f"with {len(roles)} free ports from there") from None


class ServerGroup:
    """The servers (and router) of one engine: launch, health, restart, stop."""

    def __init__(self, config: ServerConfig):
        import tempfile

        self.config = config
        self.stopped = False
        log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="sglang_logs_"))
        env = {**config.env}
        if config.device == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        self.key_file: Path | None = None
        """The 0600 file the servers and the router read the API key from, from start to stop."""
        self.servers = [
            ServerProcess(f"sglang server {i}", [], config.server_url(i), log_dir / f"sglang_{i}.log", env,
                          config.api_key, memory_saver=config.memory_saver)
            for i in range(config.num_servers)
        ]
        self.router = (
            ServerProcess("sglang router", [], config.router_url, log_dir / "router.log", env, config.api_key)
            if config.router else None
        )

    def start(self) -> None:
        """Writes the key file (when keyed), starts every server and then the router; returns once all answer
        /health. On any failure stops the group (which deletes the key file) and re-raises."""
        check_ports_free(self.config)
        try:
            if self.config.api_key is not None:
                self.key_file = write_server_key_file(self.config.api_key)
            key_file = str(self.key_file) if self.key_file is not None else None
            for i, server in enumerate(self.servers):
                server.command = self.config.server_command(i, key_file)
            if self.router is not None:
                self.router.command = self.config.router_command(key_file)
            for server in self.servers:  # start all first: they load in parallel
                server.start()
            for server in self.servers:
                server.wait_healthy(self.config.startup_timeout_s)
            if self.router is not None:
                self.router.start()
                self.router.wait_healthy(self.config.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def restart(self, i: int) -> None:
        """Stops what is left of server i and starts it again; returns once /health answers 200.
        Call it from a thread that outlives the server (see _die_with_parent)."""
        server = self.servers[i]
        server.stop()
        if self.stopped:
            raise RuntimeError(f"{server.name}: not restarted, the server group was stopped")
        server.start()
        server.wait_healthy(self.config.startup_timeout_s)

    def stop(self) -> None:
        """Ends the router and every server, then deletes the key file."""
        self.stopped = True
        try:
            stop_all(([self.router] if self.router else []) + self.servers)
        finally:
            if self.key_file is not None:
                remove_server_key_file(self.key_file)
                self.key_file = None
