"""A rollout node's SGLang servers (and on the first rollout node the router), kept up for the length of a job.

    python -m megatron_dapo.launch.rollout_node --hf-checkpoint M --sglang-num-servers S --sglang-tp-size T \\
        --sglang-host 0.0.0.0 --sglang-base-port P --sglang-api-key-file K [--router-worker-urls URL...]

examples/slurm/ runs it once per rollout node (srun, one task a node); examples/launch_sglang_servers.sh runs it by
hand. It
- starts the S servers with ServerConfig's commands (rollout/sglang/server.py): each in its own process group
  with PR_SET_PDEATHSIG, the API key handed over in a 0600 `--config` file, never on a command line, and filtered
  out of what they (and the router) print before it reaches their logs (rollout/sglang/log_redact.py);
- with --router-worker-urls (the first rollout node): waits until every worker of every rollout node answers
  (--sglang-server-wait-s; the error names the nodes that did not), then starts sglang-router in front of them
  on base port + S;
- restarts a server (or the router) that exits, at once: the trainer finds a restarted server by its weight
  version before the next update and re-syncs it (rollout/sglang/engine.py). More than --max-restarts restarts
  of one process within --restart-window-s (an hour: a multi-day run outlives a few unrelated crashes) end this
  one with exit 1, which ends the srun step (--kill-on-bad-exit) and so the job;
- on SIGTERM or SIGINT (scancel, srun forwarding a signal, the batch script when training is done) stops every
  process group it started and exits 0. SIGKILLed instead (Slurm's KillWait ran out), PR_SET_PDEATHSIG takes the
  servers with it: under any proctrack plugin nothing it started outlives it.

At 32B a restart reloads 65.5 GB from the shared filesystem: 1-3 min during which the router sends that server's
share to the others, against a 20-45 min step; at the next update the trainer re-syncs it (65.5 GB over the
node's NICs, ~3 s at 200 Gb/s, the same as any update).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron_dapo.launch.wait_servers import answering, describe_pending
from megatron_dapo.rollout.sglang.api_key import resolve_api_key
from megatron_dapo.rollout.sglang.server import ServerConfig, ServerGroup, ServerProcess, router_command, stop_all

STOP_GRACE_S = 3.0
"""How long the servers get to exit after SIGTERM before SIGKILL: inside Slurm's KillWait (30 s by default; the
test cluster's 5 s), after which Slurm SIGKILLs this process (PR_SET_PDEATHSIG then ends the servers anyway)."""


class Stop(BaseException):
    """Raised in the main thread by SIGTERM / SIGINT: unwinds whatever it is doing (start-up waits included)."""


def log(msg: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp} {socket.gethostname()}] {msg}", flush=True)


@dataclass
class Watched:
    """One supervised process: its restarts so far and, while it is starting, since when."""

    proc: ServerProcess
    restart_times: list[float] = field(default_factory=list)
    """When it was restarted within the current window (time.monotonic())."""
    starting_since: float | None = None


class RolloutNode:
    """The servers (and router) of this node; `run` supervises them until stopped."""

    def __init__(self, config: ServerConfig, *, router_workers: list[str], router_port: int | None,
                 max_restarts: int, server_wait_s: float, restart_window_s: float = 3600.0):
        self.config, self.max_restarts, self.server_wait_s = config, max_restarts, server_wait_s
        self.restart_window_s = restart_window_s
        self.group = ServerGroup(config)
        self.router_workers = router_workers
        self.router_port = router_port
        self.router: ServerProcess | None = None
        self.watched: list[Watched] = []

    def start(self) -> None:
        """Starts the servers and waits for them (ServerGroup.start), then the router once every worker of every
        node answers."""
        t0 = time.monotonic()
        self.group.start()
        log(f"{len(self.group.servers)} server(s) answer after {time.monotonic() - t0:.0f} s: "
            + ", ".join(s.url for s in self.group.servers))
        self.watched = [Watched(s) for s in self.group.servers]
        if self.router_workers:
            pending = list(self.router_workers)
            deadline = time.monotonic() + self.server_wait_s
            while pending := [u for u in pending if not answering(u)]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router's workers do not answer /health after {self.server_wait_s:.0f} "
                                       f"s (--sglang-server-wait-s): {describe_pending(pending)}")
                time.sleep(1.0)
            key_args = ["--api-key-file", str(self.group.key_file)] if self.group.key_file is not None else []
            command = router_command(self.config.python, self.config.host, self.router_port, self.router_workers,
                                     key_args)
            url = f"http://{self.config.host}:{self.router_port}"
            self.router = ServerProcess("sglang router", command, url, self.group.servers[0].log_path.parent
                                        / "router.log", self.group.servers[0].env, self.config.api_key)
            self.router.start()
            self.router.wait_healthy(self.config.startup_timeout_s)
            log(f"router on port {self.router_port} in front of {len(self.router_workers)} server(s)")
            self.watched.append(Watched(self.router))

    def supervise_once(self) -> None:
        """One pass: restart what exited, note what came back. RuntimeError once a process used up its restarts."""
        for w in self.watched:
            if w.starting_since is not None and w.proc.healthy():
                log(f"{w.proc.name} back after {time.monotonic() - w.starting_since:.0f} s ({w.proc.url})")
                w.starting_since = None
            if w.proc.alive():
                continue
            code, now = w.proc.proc.returncode, time.monotonic()
            w.restart_times = [t for t in w.restart_times if now - t < self.restart_window_s]
            if len(w.restart_times) >= self.max_restarts:
                raise RuntimeError(f"{w.proc.name} ({w.proc.url}) exited with {code} after {len(w.restart_times)} "
                                   f"restart(s) within {self.restart_window_s:.0f} s (--max-restarts "
                                   f"{self.max_restarts}, --restart-window-s); log tail:\n{w.proc.log_tail()}")
            w.restart_times.append(now)
            log(f"{w.proc.name} ({w.proc.url}) exited with {code}: restart {len(w.restart_times)} of "
                f"{self.max_restarts} within {self.restart_window_s:.0f} s")
            w.proc.stop()  # what is left of its process group
            w.proc.start()  # from this (main) thread, which outlives it: PR_SET_PDEATHSIG
            w.starting_since = time.monotonic()

    def stop(self) -> None:
        """Ends the router and every server at once (stop_all), then deletes the key file."""
        stop_all(([self.router] if self.router is not None else []) + self.group.servers, grace_s=STOP_GRACE_S)
        self.group.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.launch.rollout_node",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint", required=True, help="the HF model directory the servers load first")
    p.add_argument("--sglang-num-servers", type=int, default=1, help="servers on this node")
    p.add_argument("--sglang-tp-size", type=int, default=1, help="GPUs per server; server i on GPUs [i*tp, (i+1)*tp)")
    p.add_argument("--sglang-base-port", type=int, default=30000, help="server i on base + i")
    p.add_argument("--sglang-host", default="0.0.0.0", help="bind address (0.0.0.0 needs an API key)")
    p.add_argument("--sglang-api-key-file", default=None,
                   help="0600 file holding the job's API key (else $SGLANG_API_KEY, else none)")
    p.add_argument("--sglang-allow-no-api-key", action="store_true",
                   help="bind beyond loopback without a key (a trusted network only)")
    p.add_argument("--sglang-extra-args", default="", help="more sglang.launch_server flags, one string")
    p.add_argument("--sglang-python", default=sys.executable, help="the interpreter with sglang installed")
    p.add_argument("--sglang-device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--sglang-server-wait-s", type=float, default=900.0,
                   help="how long a server (and the router's workers) may take to answer /health")
    p.add_argument("--router-worker-urls", nargs="+", default=[],
                   help="start sglang-router on base + num-servers in front of these (every node's servers)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of one server within --restart-window-s before the node gives up")
    p.add_argument("--restart-window-s", type=float, default=3600.0, help="the window --max-restarts counts in")
    p.add_argument("--log-dir", required=True, help="sglang_<i>.log and router.log go here")
    p.add_argument("--check-only", action="store_true", help="validate the flags and the API key, start nothing")
    return p


def _raise_stop(signum: int, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.max_restarts < 0 or a.restart_window_s <= 0:
        build_parser().error(f"--max-restarts must be >= 0 and --restart-window-s > 0, got {a.max_restarts} and "
                             f"{a.restart_window_s}")
    try:
        key = resolve_api_key(None, a.sglang_api_key_file, os.environ)
        config = ServerConfig(model_path=a.hf_checkpoint, num_servers=a.sglang_num_servers,
                              tp_per_server=a.sglang_tp_size, base_port=a.sglang_base_port, host=a.sglang_host,
                              device=a.sglang_device, extra_args=tuple(a.sglang_extra_args.split()),
                              startup_timeout_s=a.sglang_server_wait_s, router=False, python=a.sglang_python,
                              log_dir=a.log_dir, api_key=key, allow_no_api_key=a.sglang_allow_no_api_key)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if a.check_only:
        return 0
    router_port = a.sglang_base_port + a.sglang_num_servers if a.router_worker_urls else None
    node = RolloutNode(config, router_workers=a.router_worker_urls, router_port=router_port,
                       max_restarts=a.max_restarts, server_wait_s=a.sglang_server_wait_s,
                       restart_window_s=a.restart_window_s)
    assert threading.current_thread() is threading.main_thread()  # signals and PR_SET_PDEATHSIG need it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)
    code = 0
    try:
        node.start()
        while True:
            node.supervise_once()
            time.sleep(1.0)
    except Stop as why:
        log(f"{why}: stopping this node's servers")
    except (RuntimeError, TimeoutError) as err:
        log(f"error: {err}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second scancel signal must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        node.stop()
        log("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
