"""tools/slurm_cluster.py: a real Slurm 22.05 cluster on this machine (controller + nodes in their own network and
hostname namespaces) behaves like a multi-node cluster for what examples/slurm/ relies on.

One module cluster (2 nodes, 4 CPUs per node so that the batch jobs below run side by side) is brought up once;
the batch jobs are all submitted when it comes up and each test waits for its own, so the module costs about one
job's time. It uses proctrack/linuxproc: works wherever /proc does, and a job that ran steps completes ~0.9 s after
submit, against ~3.8 s under proctrack/pgid (its slurmstepd polls the process group with a 1 s, then 2 s back-off).
test_up_twice_... uses pgid on purpose: what a step's setsid child does on scancel there. 8-13 s in all on the
2-core CI machine (measured with other work running). Skipped, with the reason, where `tools/slurm_cluster.py
check` fails (not root, no slurm/munge packages, no `ip netns`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import processes, running
from tests.torchrun import REPO

sys.path.insert(0, str(REPO / "tools"))
import slurm_cluster  # noqa: E402
from slurm_cluster import Cluster  # noqa: E402

REASON = slurm_cluster.check()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(REASON is not None, reason=f"no local Slurm: {REASON}")]

TOOL = Path(slurm_cluster.__file__)
PORT = 28080  # any port: each node has its own network namespace, nothing else listens there

# The pattern of examples/slurm/: steps on disjoint nodes started in the background of one batch script. Each
# step touches its own file and waits for the other's, so both finish only if they ran at the same time.
RENDEZVOUS = """\
meet() { touch "$DIR/$1"; for i in $(seq 150); do [ -e "$DIR/$2" ] && { echo "$1 on $(hostname) met $2"; return; }; \
sleep 0.1; done; echo "$1 on $(hostname) alone"; return 1; }
export -f meet; export DIR=@DIR@
srun @A@ bash -c 'meet a b' &
srun @B@ bash -c 'meet b a' &
wait
"""

HTTP = f"""\
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
srun --nodes=1 --ntasks=1 --relative=0 {sys.executable} -m http.server {PORT} --directory @DIR@ &
server=$!
srun --nodes=1 --ntasks=1 --relative=1 {sys.executable} -c "
import socket, time, urllib.request
for _ in range(150):
    try:
        body = urllib.request.urlopen('http://${{nodes[0]}}:{PORT}/hello.txt', timeout=2).read().decode()
        print(socket.gethostname(), 'got', body); break
    except OSError:
        time.sleep(0.1)
"
kill $server; wait
"""

JOBS = {
    # name: (sbatch options, script body; @DIR@ is the job's own directory)
    "nodelist": (["-N2"], 'echo "list=$SLURM_JOB_NODELIST batch_on=$(hostname)"; scontrol show hostnames '
                          '"$SLURM_JOB_NODELIST"; srun -N2 -n2 bash -c \'echo "task $SLURM_PROCID $SLURM_NODEID '
                          '$(hostname)"\' | sort'),
    "http": (["-N2"], HTTP),
    "disjoint": (["-N2"], RENDEZVOUS.replace("@A@", "--nodes=1 --ntasks=1 --relative=0")
                 .replace("@B@", "--nodes=1 --ntasks=1 --relative=1")),
    # 22.05: a step gets all of the job's CPUs on its nodes, so a second step on the same node waits ("Requested
    # nodes are busy") unless it says --overlap (or the job has the CPUs and the steps say --exact)
    "same_node_overlap": (["-N1"], RENDEZVOUS.replace("@A@", "-N1 -n1 --overlap").replace("@B@", "-N1 -n1 --overlap")),
}


class Job:
    """A submitted batch job: its id, output file, and a bounded wait for it to leave the queue."""

    def __init__(self, cluster: Cluster, name: str, options: list[str], body: str):
        self.cluster, self.dir = cluster, cluster.dir / "jobs" / name
        self.dir.mkdir(parents=True)
        (self.dir / "hello.txt").write_text("hello")
        script = self.dir / "job.sh"
        script.write_text("#!/bin/bash\n" + body.replace("@DIR@", str(self.dir)))
        self.out = self.dir / "out.txt"
        p = cluster.run(["sbatch", "--parsable", f"--output={self.out}", f"--chdir={self.dir}", *options,
                         str(script)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        self.id = p.stdout.strip().split(";")[0]

    def wait(self, timeout: float = 60) -> tuple[str, str]:
        """(final JobState, the job's output) once the job has left squeue."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            q = self.cluster.run(["squeue", "-h", "-j", self.id, "-o", "%T"], capture_output=True, text=True)
            if not q.stdout.strip():
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"job {self.id} still queued after {timeout} s: {q.stdout.strip()}")
        show = self.cluster.run(["scontrol", "show", "job", self.id], capture_output=True, text=True).stdout
        state = m.group(1) if (m := re.search(r"JobState=(\S+)", show)) else "?"
        return state, self.out.read_text() if self.out.exists() else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("slurm")).up(nodes=2, proctrack="linuxproc", cpus_per_node=4)
    yield c
    c.down()


@pytest.fixture(scope="module")
def jobs(cluster) -> dict[str, Job]:
    return {name: Job(cluster, name, options, body) for name, (options, body) in JOBS.items()}


def _info(cluster: Cluster) -> dict:
    info = cluster.info()
    assert info is not None
    return info


def test_srun_runs_on_both_nodes_under_their_names(cluster):
    p = cluster.run(["srun", "-N2", "hostname"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split()) == _info(cluster)["nodes"]


def test_job_nodelist_and_task_ids(cluster, jobs):
    n0, n1 = _info(cluster)["nodes"]
    state, out = jobs["nodelist"].wait()
    assert state == "COMPLETED", out
    lines = out.splitlines()
    assert lines[0] == f"list={cluster.id}n[0-1] batch_on={n0}"  # the batch script runs on the first node
    assert lines[1:3] == [n0, n1]
    assert lines[3:] == [f"task 0 0 {n0}", f"task 1 1 {n1}"]


def test_server_on_node0_reachable_from_node1_by_name(cluster, jobs):
    state, out = jobs["http"].wait()
    n1 = _info(cluster)["nodes"][1]
    assert f"{n1} got hello" in out, out


@pytest.mark.parametrize("name", ["disjoint", "same_node_overlap"])
def test_two_steps_of_one_batch_script_run_at_once(jobs, name):
    state, out = jobs[name].wait()
    assert state == "COMPLETED", out
    assert "a on" in out and "met b" in out and "met a" in out, out


def test_impossible_request_is_refused_at_submit(cluster):
    p = cluster.run(["sbatch", "-N3", "--wrap", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "Node count specification invalid" in p.stderr


def test_run_passes_stdin_stdout_and_exit_code(cluster):
    p = subprocess.run([sys.executable, str(TOOL), "run", "--dir", str(cluster.dir), "--", "sh", "-c",
                        'cat; hostname; echo "$SLURM_CONF"; exit 3'], input="in\n", capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stdout.split() == ["in", cluster.controller, str(cluster.conf)]


def test_up_twice_scancel_leftover_and_down_leave_nothing(tmp_path, cluster):
    """A second cluster next to the module's (distinct names and /24; a deep D: the socket paths go through the
    short link), `up` twice, then what proctrack/pgid leaves after scancel (a step's setsid child survives), and
    `down` removes all of it."""
    with Cluster(tmp_path / "a-deliberately-long-directory-name" / "for-the-socket-paths") as c:
        c.up(nodes=1, proctrack="pgid")
        c.up(nodes=1, proctrack="pgid")  # tears the first one down
        info = _info(c)
        assert c.id != cluster.id and info["subnet"] != _info(cluster)["subnet"]
        srun = c.run(["srun", "hostname"], capture_output=True, text=True, timeout=60)
        assert srun.stdout.split() == info["nodes"], srun.stderr

        pidfile = tmp_path / "setsid.pid"  # a step starts a server-like child in its own session (setsid)
        (tmp_path / "child.sh").write_text(f"echo $$ > {pidfile}; exec sleep 600\n")
        # its stdio off the step's pipes, else the step waits 60 s for them to close ("Abandoning IO")
        (tmp_path / "step.sh").write_text(f"setsid bash {tmp_path}/child.sh </dev/null >/dev/null 2>&1 & sleep 600\n")
        (tmp_path / "job.sh").write_text(f"#!/bin/bash\nsrun bash {tmp_path}/step.sh\n")
        job = c.run(["sbatch", "--parsable", "-o", "/dev/null", str(tmp_path / "job.sh")], capture_output=True,
                    text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            queue = c.run(["squeue", "-h", "-o", "%T %r"], capture_output=True, text=True).stdout
            assert time.monotonic() < deadline, f"the step did not start its child: {queue}"
            time.sleep(0.1)
        survivor = int(pidfile.read_text())
        c.run(["scancel", job.stdout.strip()], check=True, timeout=60)
        while queue := c.run(["squeue", "-h", "-o", "%T"], capture_output=True, text=True).stdout.strip():
            assert time.monotonic() < deadline, f"job not gone 30 s after scancel: {queue}"
            time.sleep(0.1)
        assert running(survivor)  # the job is gone, its setsid child is not
        assert [pid for _, pid, _ in c.leftover_pids()] == [survivor]

        forced = c.down()
        assert [pid for _, pid, _ in forced] == [survivor]
        assert not running(survivor)
        assert not any(pid in info["pids"].values() and fields[0] != "Z" for pid, fields in processes())
        assert not [cmd for pid, _ in processes() if c.id in (cmd := slurm_cluster._cmdline(pid))]
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert c.id not in netns
        assert c.id not in Path("/etc/hosts").read_text()
        assert not c.short.exists() and not (c.dir / "cluster.json").exists()
        assert c.down() == []  # idempotent


def test_up_that_fails_names_the_node_shows_its_log_and_cleans_up(tmp_path, monkeypatch):
    spawn = Cluster._spawn

    def broken_slurmd(self, ns, log, argv):  # a slurmd that cannot find its NodeName exits at once
        return spawn(self, ns, log, [*argv[:-1], "nosuchnode"] if argv[0] == "slurmd" else argv)

    monkeypatch.setattr(Cluster, "_spawn", broken_slurmd)
    c = Cluster(tmp_path / "broken")
    with pytest.raises(RuntimeError) as err:
        c.up(nodes=1, timeout=30)
    node = f"{c.id}n0"
    assert f"daemons exited: {node}; nodes not idle: {node}=" in str(err.value)
    assert "nosuchnode" in str(err.value)  # slurmd's own words, from its log tail
    assert c.id not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert c.id not in Path("/etc/hosts").read_text()
    assert (c.dir / "log" / f"slurmd-{node}.out").exists()  # logs kept for the post-mortem


def test_check_gives_one_line_and_exit_2_when_it_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    assert slurm_cluster.main(["check"]) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("not root")
    assert slurm_cluster.main(["install"]) == 0  # present: a no-op (not root would only say why)
