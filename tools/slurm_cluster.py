"""A real Slurm cluster on this one machine: a controller and N compute nodes, each in its own network and
hostname namespace, for tests that submit real sbatch scripts (Debian's slurm 22.05 + munge packages).

    python tools/slurm_cluster.py check                     # exit 2 + one line of reason if it cannot run here
    python tools/slurm_cluster.py install                   # apt-get the packages if missing (root only)
    python tools/slurm_cluster.py up --dir D --nodes 2 [--proctrack pgid|linuxproc|cgroup] [--cpus-per-node 2]
    python tools/slurm_cluster.py run --dir D -- sbatch --wait job.sh
    python tools/slurm_cluster.py pids --dir D              # what jobs left behind in the node namespaces
    python tools/slurm_cluster.py down --dir D [--keep-logs]

Layout (all derived from a short id, a hash of D, so that two clusters made at once never collide):
  namespace + hostname `<id>c`   the controller and the "login" node: munged, slurmctld, a bridge `br0` holding
                                 10.X.Y.1/24, one veth end per node; client commands (`run`) execute here, so
                                 nothing of the cluster listens on the host's own network.
  namespace + hostname `<id>nI`  compute node I: slurmd, its jobs, `eth0` = 10.X.Y.(10+I)/24.
The /24 exists only inside these namespaces (no forwarding, no NAT); the bridge sits in a fresh namespace, so
no host firewall (a Docker FORWARD DROP policy) sees its traffic. /etc/hosts gets one line per name, tagged
`# slurm_cluster <id>`, so jobs resolve node names; `down` removes exactly those lines.

Daemons start as `nsenter --net=/run/netns/X unshare --uts sh -c 'hostname X; exec DAEMON -D ...'` (not
`ip netns exec`: it remounts /sys and slurmd then finds no cgroup filesystem). Each runs in the foreground in a
new session, so its pid is the one we started and a test's Ctrl-C does not reach it.

Measured on the 2-core CI machine (Debian 12, slurm 22.05.8, other work running): `up` of 2 nodes 0.3-1.7 s with
the packages present (~0.4 s when the machine is quiet), `down` 0.1-0.4 s, `srun -N2 true` from the login node
0.13-0.2 s. A batch job is started by backfill within bf_interval=1 s of its submission. What a finished job costs
depends on --proctrack: a job that ran a step leaves the queue ~0.9 s after submit with linuxproc or cgroup, ~3.8 s
with pgid (slurmstepd polls the process group, 1 s then 2 s). `sbatch --wait` polls 2 s, then 8 s later: a 3 s
job returns after ~10 s, so callers that care poll `squeue -h -j ID` instead (tests/slurm/test_slurm_cluster.py: Job).

What scancel leaves (a step that starts a child with `setsid`, its stdio redirected): pgid: the setsid child
survives the job; linuxproc and cgroup kill it. A survivor that still holds the step's stdout/stderr keeps the job
COMPLETING for 60 s ("Abandoning IO 60 secs after job shutdown initiated"). `pids` lists such leftovers, `down`
kills them and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DAEMON_BINARIES = ("munged", "slurmctld", "slurmd")
CLIENT_BINARIES = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
TOOLS = ("ip", "nsenter", "unshare")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROCTRACK = ("pgid", "linuxproc", "cgroup")
SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
HOSTS = Path("/etc/hosts")
SLURMCTLD_PORT = 6817  # each node has its own network namespace: the default ports never collide
NETNS_DIR = Path("/run/netns")
# Unix socket paths must fit 108 bytes: slurmd's step sockets (SlurmdSpoolDir/<node>_<job>.<step>) and munge's
# are named through a short link /run/slurm_cluster/<id> -> D, so that any D (a deep pytest tmp_path) works.
SHORT_DIR = Path("/run/slurm_cluster")
STATE_ENTRIES = ("etc", "munge", "state", "run", "cluster.json")  # what `down` deletes under D (logs: log/)


def cluster_id(directory: str | os.PathLike) -> str:
    """`sc` + 6 hex digits of sha1(absolute D): the prefix of every name (namespace, hostname, hosts tag)."""
    return "sc" + hashlib.sha1(str(Path(directory).resolve()).encode()).hexdigest()[:6]


def subnet(cid: str) -> str:
    """The cluster's private /24 prefix, `10.X.Y`, X in 128..255 and Y from the id's hash (16 bits)."""
    h = int(cid[2:], 16)
    return f"10.{128 + (h >> 16) % 128}.{(h >> 8) % 256}"


def _path(path: str | None = None) -> str:
    """PATH plus the sbin directories: the daemons live in /usr/sbin, which a root shell's PATH may lack."""
    dirs = (path if path is not None else os.environ.get("PATH", "")).split(os.pathsep)
    return os.pathsep.join([d for d in dirs if d] + [d for d in SBIN if d not in dirs])


def _which(binary: str) -> str | None:
    return shutil.which(binary, path=_path())


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a short host command (ip, ...); on failure the error names the command and its stderr."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (reads /proc/<pid>/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _is_scriptd(pid: int, daemons: set[int]) -> bool:
    """slurmctld (22.05) forks `slurmscriptd` (its helper for prolog/epilog scripts): part of the daemon."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]) in daemons and Path(f"/proc/{pid}/comm").read_text().strip() == "slurmscriptd"
    except (OSError, IndexError, ValueError):
        return False


def _reap(pid: int) -> None:
    """Collect pid's exit status when it is our child (the Python API starts daemons with Popen)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _stop(pids: list[int], timeout: float) -> list[int]:
    """SIGTERM every pid at once and wait up to `timeout` s for them to be gone (by pid: daemons delete their pid
    files early in shutdown); SIGKILL the rest. Returns the pids that needed the SIGKILL."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        if not any(_alive(pid) for pid in pids):
            return []
        time.sleep(0.02)
    stubborn = [pid for pid in pids if _alive(pid)]
    for pid in stubborn:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
    return stubborn


def _mem_mib() -> int:
    """The machine's memory in MiB (/proc/meminfo): what each node claims, so that `--mem` requests that would fit
    the machine are accepted (Slurm's default RealMemory is 1 MiB). Nothing enforces it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1


def _wait_listening(pid: int, port: int, deadline: float) -> None:
    """Wait until `pid` listens on TCP `port`: /proc/<pid>/net/tcp lists the sockets of pid's network namespace
    (state 0A = LISTEN), so this needs no client in the namespace. Polled every 10 ms; returns early if pid
    exits (the caller's wait then reports it with the logs)."""
    want = f":{port:04X}"
    while time.monotonic() < deadline and _alive(pid):
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[1].endswith(want) and fields[3] == "0A":
                        return
        time.sleep(0.01)


def _netns_pids(ns: str) -> list[int]:
    """Every pid in network namespace `ns` (`ip netns pids`: a scan of /proc/*/ns/net, ~10 ms)."""
    p = _sh("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _edit_hosts(cid: str, lines: list[str]) -> None:
    """Replace this cluster's tagged lines of /etc/hosts with `lines` (none: remove them). Edited in place under
    an flock (the file may be a bind mount, and two clusters may edit it at once)."""
    tag = f"# slurm_cluster {cid}"
    with open(HOSTS, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        kept = [ln for ln in f.read().splitlines() if not ln.endswith(tag)]
        new = kept + [f"{ln}  {tag}" for ln in lines]
        f.seek(0)
        f.write("\n".join(new) + "\n")
        f.truncate()


def check() -> str | None:
    """None when this machine can run a cluster, else the reason (one line). Costs ~50 ms: a probe namespace is
    made and deleted, and `unshare --uts true` is run."""
    if os.geteuid() != 0:
        return "not root (network namespaces, /etc/hosts and the daemons need root)"
    missing = [b for b in TOOLS + DAEMON_BINARIES + CLIENT_BINARIES if _which(b) is None]
    if missing:
        return f"missing {' '.join(missing)} (tools/slurm_cluster.py install: apt-get install {' '.join(PACKAGES)})"
    probe = f"scprobe{os.getpid()}"
    p = _sh("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"ip netns add fails: {p.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    p = _sh("unshare", "--uts", "true", check=False)
    if p.returncode != 0:
        return f"unshare --uts fails: {p.stderr.strip()}"
    return None


def install() -> str:
    """apt-get the packages when a binary is missing (~9 s from empty apt lists); a no-op (~1 ms) when present.
    Returns what it did. Debian's postinst scripts would start munge/slurm through invoke-rc.d: a policy-rc.d
    that answers 101 (the standard "do not start") is in place for the install, and any munged/slurm* process
    that appears during it is stopped by pid all the same."""
    if all(_which(b) for b in DAEMON_BINARIES + CLIENT_BINARIES):
        return "present"
    if os.geteuid() != 0 or _which("apt-get") is None:
        return "not installed: needs root and apt-get"
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    before = set(_daemon_pids())
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "PATH": _path()}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:  # empty or stale lists: update once, then retry
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if own_policy:
            policy.unlink()
        _stop(sorted(set(_daemon_pids()) - before), 5)
    if p.returncode != 0:
        return f"apt-get install failed: {p.stderr.strip().splitlines()[-1:]}"
    return "installed"


def _daemon_pids() -> list[int]:
    """munged/slurmctld/slurmd processes started the init-script way (in the background). Clusters of this tool
    run theirs in the foreground (-D / -F), so one that comes up during an install is never mistaken for one."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if (Path(f"/proc/{entry}/comm").read_text().strip() in DAEMON_BINARIES
                        and not {b"-D", b"-F"} & set(argv)):
                    pids.append(int(entry))
    return pids


class Cluster:
    """One local cluster whose state lives under `directory` (config in D/etc, munge key + socket in D/munge,
    daemon state and slurmd spools in D/state, pid files in D/run, logs in D/log, the description in
    D/cluster.json); the daemons see D as /run/slurm_cluster/<id> (socket path length).

        with Cluster(tmp_path).up(nodes=2) as c:
            c.run(["srun", "-N2", "hostname"], capture_output=True, text=True)
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory).resolve()
        self.id = cluster_id(self.dir)
        self.controller = f"{self.id}c"
        self.conf = self.dir / "etc" / "slurm.conf"
        self.short = SHORT_DIR / self.id

    # --- bring up -------------------------------------------------------------------------------------------

    def up(self, nodes: int = 2, proctrack: str = "pgid", cpus_per_node: int = 2, timeout: float = 60) -> Cluster:
        """Tear down whatever this D had, then start munged, slurmctld and `nodes` slurmd, and wait until sinfo
        shows every node idle. With the packages present, 2 nodes on the 2-core CI machine: ~0.3-0.4 s when it is
        quiet (namespaces and veths ~0.07 s, munged ~0.02 s, slurmctld listening ~0.03-0.2 s, slurmd start and
        registration ~0.12 s), up to ~1.7 s measured under load, hence the bounded wait (`timeout` s) whose error
        names the nodes not idle and the daemons that exited, with their output."""
        if not 1 <= nodes <= 200:
            raise ValueError(f"--nodes must be in 1..200, got {nodes}")
        if proctrack not in PROCTRACK:
            raise ValueError(f"--proctrack must be one of {', '.join(PROCTRACK)}, got {proctrack!r}")
        if cpus_per_node < 1:
            raise ValueError(f"--cpus-per-node must be >= 1, got {cpus_per_node}")
        if reason := check():
            raise RuntimeError(f"cannot run a Slurm cluster here: {reason}")
        for ns, pid, cmd in self.down():
            print(f"slurm_cluster: killed a leftover of the previous cluster in {self.dir}: {ns} {pid} {cmd}",
                  file=sys.stderr)
        net = subnet(self.id)
        names = [f"{self.id}n{i}" for i in range(nodes)]
        addrs = {self.controller: f"{net}.1", **{n: f"{net}.{10 + i}" for i, n in enumerate(names)}}
        info = {
            "id": self.id, "dir": str(self.dir), "subnet": f"{net}.0/24", "proctrack": proctrack,
            "controller": self.controller, "login_namespace": self.controller, "nodes": names,
            "addresses": addrs, "namespaces": [self.controller, *names], "slurm_conf": str(self.conf),
            "env": {"SLURM_CONF": str(self.conf)}, "pids": {},
        }
        for sub in ("etc", "munge", "state", "run", "log", *(f"state/{n}" for n in names)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._write_json(info)  # written first so that a failed `up` can still be torn down by pid
        SHORT_DIR.mkdir(parents=True, exist_ok=True)
        self.short.symlink_to(self.dir, target_is_directory=True)
        try:
            self._network(names, addrs)
            _edit_hosts(self.id, [f"{a} {n}" for n, a in addrs.items()])
            self._write_config(names, addrs, proctrack, cpus_per_node)
            info["pids"]["munged"] = self._start_munged()
            self._write_json(info)
            info["pids"]["slurmctld"] = self._spawn(self.controller, "slurmctld", ["slurmctld", "-D", "-c"])
            self._write_json(info)
            # slurmd registers as it starts and a client's first try backs off ~1 s: start both once it listens
            _wait_listening(info["pids"]["slurmctld"], SLURMCTLD_PORT, deadline=time.monotonic() + timeout)
            for n in names:
                info["pids"][n] = self._spawn(n, f"slurmd-{n}", ["slurmd", "-D", "-N", n])
            self._write_json(info)
            self._wait_idle(names, info, timeout)
        except BaseException:
            self.down(keep_logs=True)
            raise
        return self

    def _write_json(self, info: dict) -> None:
        tmp = self.dir / "cluster.json.tmp"
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        tmp.replace(self.dir / "cluster.json")

    def _network(self, names: list[str], addrs: dict[str, str]) -> None:
        """Namespaces, the bridge (in the controller's namespace) and one veth pair per node: ~12 `ip` calls of
        a few ms each per node."""
        c = self.controller
        for ns in (c, *names):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", c, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", c, "addr", "add", f"{addrs[c]}/24", "dev", "br0")
        _sh("ip", "-n", c, "link", "set", "br0", "up")
        for i, n in enumerate(names):
            _sh("ip", "-n", c, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", n)
            _sh("ip", "-n", c, "link", "set", f"v{i}", "master", "br0", "up")
            _sh("ip", "-n", n, "addr", "add", f"{addrs[n]}/24", "dev", "eth0")
            _sh("ip", "-n", n, "link", "set", "eth0", "up")

    def _write_config(self, names: list[str], addrs: dict[str, str], proctrack: str, cpus: int) -> None:
        d, etc = self.short, self.dir / "etc"
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={addrs[n]} CPUs={cpus} RealMemory={_mem_mib()} State=UNKNOWN"
            for n in names)
        (etc / "slurm.conf").write_text(f"""\
# Written by tools/slurm_cluster.py for the local cluster {self.id}; {d} -> {self.dir}
ClusterName={self.id}
SlurmctldPort={SLURMCTLD_PORT}
SlurmctldHost={self.controller}({addrs[self.controller]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# munged runs by hand with its own socket: clients and daemons find it here
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state/slurmctld
SlurmdSpoolDir={d}/state/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# every node claims CPUs={cpus} and the machine's memory whatever the machine has (so --mem requests fit)
SlurmdParameters=config_overrides
# an impossible request (-N3 on 2 nodes) fails at submit instead of pending for ever
EnforcePartLimits=ALL
MailProg=/bin/true
KillWait=5
# heterogeneous jobs are started by backfill only: every second, not every 30 s
SchedulerParameters=bf_interval=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{node_lines}
PartitionName={self.id} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        # slurmd reads cgroup.conf whatever the plugins; the defaults (autodetect) suit proctrack/cgroup on v1
        (etc / "cgroup.conf").write_text("# Written by tools/slurm_cluster.py: defaults.\n")

    def _start_munged(self) -> int:
        """munged with its own key, socket, pid and seed file under D/munge (mode 0755: munged refuses a socket
        directory others can write), in the controller's namespace so that `down`'s sweep finds it. ~50 ms."""
        m = self.short / "munge"
        m.chmod(0o755)
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        pid = self._spawn(self.controller, "munged", [
            "munged", "-F", "--force", f"--key-file={key}", f"--socket={m}/munge.socket",
            f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"])
        deadline = time.monotonic() + 10
        while not (m / "munge.socket").exists():
            if not _alive(pid) or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail('munged')}")
            time.sleep(0.01)
        return pid

    def _spawn(self, ns: str, log: str, argv: list[str]) -> int:
        """Start a daemon in the foreground inside namespace `ns` with hostname `ns`; its own session, output
        to D/log/<log>.out. nsenter, unshare and sh all exec, so the pid returned is the daemon's."""
        with open(self.dir / "log" / f"{log}.out", "ab") as out:
            p = subprocess.Popen(
                ["nsenter", f"--net={NETNS_DIR / ns}", "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                 ns, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env(), start_new_session=True, cwd=self.dir)
        return p.pid

    def _wait_idle(self, names: list[str], info: dict, timeout: float) -> None:
        """Poll `sinfo` (15-40 ms a call) every 0.1 s until every node is idle; stop early when a daemon exits."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [k for k, pid in info["pids"].items() if not _alive(pid)]
            if dead:
                break
            p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
            states = dict(ln.split() for ln in p.stdout.splitlines() if len(ln.split()) == 2)
            if all(states.get(n) == "idle" for n in names):
                return
            time.sleep(0.1)
        else:
            dead = [k for k, pid in info["pids"].items() if not _alive(pid)]
        not_up = [f"{n}={states.get(n, 'absent')}" for n in names if states.get(n) != "idle"]
        logs = "\n".join(f"--- {k}:\n{self._tail(k if k in ('munged', 'slurmctld') else f'slurmd-{k}')}"
                         for k in info["pids"])
        why = f"daemons exited: {' '.join(dead)}" if dead else f"not up after {timeout:.0f} s"
        raise RuntimeError(f"cluster {self.id} in {self.dir}: {why}; nodes not idle: {' '.join(not_up)}\n{logs}")

    def _tail(self, name: str, lines: int = 15) -> str:
        """The last lines a daemon wrote: its stderr (D/log/<name>.out: the daemons run in the foreground, so it
        holds everything, errors before the log file opens included), else its log file."""
        for suffix in (".out", ".log"):
            with contextlib.suppress(OSError):
                if text := (self.dir / "log" / f"{name}{suffix}").read_text(errors="replace"):
                    return "\n".join(text.splitlines()[-lines:])
        return "(no output)"

    # --- use ------------------------------------------------------------------------------------------------

    def info(self) -> dict | None:
        """D/cluster.json, or None when there is no cluster in D."""
        try:
            return json.loads((self.dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment a client command needs: `base` (os.environ by default) without any SLURM_* it may
        carry from an enclosing job, plus SLURM_CONF."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), "PATH": _path(env.get("PATH", ""))}

    def login_argv(self, cmd: list[str]) -> list[str]:
        """`cmd` as run on the login node: the controller's network namespace and its hostname (so that srun's
        own name resolves to an address the nodes can reach). Costs ~5 ms over running `cmd` directly."""
        return ["nsenter", f"--net={NETNS_DIR / self.controller}", "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.controller, *cmd]

    def run(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run(cmd, **kwargs) on the login node with the client environment (kwargs' env, if any, is
        the base it is built from)."""
        kwargs["env"] = self.env(kwargs.get("env"))
        return subprocess.run(self.login_argv(list(cmd)), **kwargs)

    def leftover_pids(self) -> list[tuple[str, int, str]]:
        """(namespace, pid, command line) of every process in the cluster's namespaces that is not one of its
        daemons: what jobs left behind (slurmstepd included while a job runs). ~10 ms per namespace."""
        info = self.info() or {}
        daemons = set(info.get("pids", {}).values())
        return [(ns, pid, _cmdline(pid)) for ns in self._namespaces() for pid in _netns_pids(ns)
                if pid not in daemons and not _is_scriptd(pid, daemons)]

    def _namespaces(self) -> list[str]:
        """This cluster's namespaces that exist, found by name (works without cluster.json: a crashed `up`)."""
        p = _sh("ip", "netns", "list", check=False)
        names = [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]
        return [n for n in names if n == self.controller or re.fullmatch(rf"{self.id}n\d+", n)]

    # --- tear down ------------------------------------------------------------------------------------------

    def down(self, keep_logs: bool = False) -> list[tuple[str, int, str]]:
        """Stop the daemons by pid (SIGTERM, wait up to 10 s each, SIGKILL), then SIGKILL whatever still lives in
        the namespaces, delete them (the bridge and veths go with them), the hosts lines, the cgroups slurmd
        made and the state under D (D/log too unless keep_logs). Returns what had to be killed by force (a
        job's leftovers). Idempotent; ~0.3 s for 2 idle nodes (slurmctld's shutdown is most of it)."""
        info = self.info() or {}
        pids = info.get("pids", {})
        # the slurmds first (all at once), then the controller, then munged, which both need
        for keys in ([k for k in pids if k not in ("slurmctld", "munged")], ["slurmctld"], ["munged"]):
            ours = [pids[k] for k in keys if k in pids and _alive(pids[k])
                    and _cmdline(pids[k]).split(" ")[0].rsplit("/", 1)[-1] in DAEMON_BINARIES]  # pid not reused
            for pid in _stop(ours, 10):
                print(f"slurm_cluster: daemon pid {pid} ignored SIGTERM for 10 s: killed", file=sys.stderr)
        forced = []
        for _ in range(50):  # a process may fork while we kill: repeat until the namespaces are empty
            left = [(ns, pid) for ns in self._namespaces() for pid in _netns_pids(ns)]
            if not left:
                break
            for ns, pid in left:
                if (ns, pid) not in {(f[0], f[1]) for f in forced}:
                    forced.append((ns, pid, _cmdline(pid)))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for _, pid in left:
                deadline = time.monotonic() + 2
                while _alive(pid) and time.monotonic() < deadline:
                    _reap(pid)
                    time.sleep(0.01)
        for ns in self._namespaces():
            _sh("ip", "netns", "del", ns, check=False)
        _edit_hosts(self.id, [])
        if self.short.is_symlink():
            self.short.unlink()
        self._remove_cgroups()
        for entry in (*STATE_ENTRIES, "cluster.json.tmp", *(() if keep_logs else ("log",))):
            path = self.dir / entry
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return forced

    def _remove_cgroups(self) -> None:
        """proctrack/cgroup (v1) makes /sys/fs/cgroup/<subsystem>/slurm_<node>/... per node (multiple-slurmd
        builds name it after the node); remove ours, deepest first, once their processes are gone."""
        root = Path("/sys/fs/cgroup")
        with contextlib.suppress(OSError):
            for top in root.glob(f"*/slurm_{self.id}n*"):
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    top.rmdir()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="exit 0 if this machine can run the cluster, else print why and exit 2")
    sub.add_parser("install", help="apt-get install the slurm + munge packages if missing (root only)")
    p_up = sub.add_parser("up", help="(re)start a cluster whose state lives in --dir")
    p_up.add_argument("--dir", required=True)
    p_up.add_argument("--nodes", type=int, default=2)
    p_up.add_argument("--proctrack", choices=PROCTRACK, default="pgid")
    p_up.add_argument("--cpus-per-node", type=int, default=2)
    p_up.add_argument("--timeout", type=float, default=60, help="seconds to wait for every node to be idle")
    p_run = sub.add_parser("run", help="run a command on the login node: run --dir D -- CMD...")
    p_run.add_argument("--dir", required=True)
    p_run.add_argument("cmd", nargs=argparse.REMAINDER)
    p_pids = sub.add_parser("pids", help="processes in the cluster's namespaces other than its daemons")
    p_pids.add_argument("--dir", required=True)
    p_down = sub.add_parser("down", help="stop everything and delete the state (no cluster: no-op)")
    p_down.add_argument("--dir", required=True)
    p_down.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args(argv)

    if args.command == "check":
        reason = check()
        if reason:
            print(reason)
            return 2
        return 0
    if args.command == "install":
        print(f"slurm_cluster install: {install()}")
        return 0
    cluster = Cluster(args.dir)
    if args.command == "up":
        t0 = time.monotonic()
        cluster.up(nodes=args.nodes, proctrack=args.proctrack, cpus_per_node=args.cpus_per_node,
                   timeout=args.timeout)
        info = cluster.info()
        print(f"cluster {cluster.id} up in {time.monotonic() - t0:.2f} s: nodes {' '.join(info['nodes'])}; "
              f"SLURM_CONF={cluster.conf}; tools/slurm_cluster.py run --dir {args.dir} -- CMD")
        return 0
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            ap.error("run: no command (run --dir D -- CMD...)")
        if cluster.info() is None:
            ap.error(f"run: no cluster in {args.dir} (up first)")
        # exec: the caller's signals (a timeout's SIGTERM) reach the command itself, its exit status is ours
        os.execvpe("nsenter", cluster.login_argv(cmd), cluster.env())
    if args.command == "pids":
        for ns, pid, cmd in cluster.leftover_pids():
            print(f"{ns} {pid} {cmd}")
        return 0
    t0 = time.monotonic()
    forced = cluster.down(keep_logs=args.keep_logs)
    for ns, pid, cmd in forced:
        print(f"killed by force: {ns} {pid} {cmd}")
    print(f"cluster {cluster.id} down in {time.monotonic() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
