"""The launch path without a cluster: node roles and derived addresses (megatron_dapo/launch/roles.py), the bounded
wait for the servers (wait_servers.py), the rollout-node supervisor (rollout_node.py) on stand-in servers, and the
Slurm scripts' DRY_RUN plans and refusals (examples/slurm/). tests/slurm/test_slurm_rehearsal.py runs the same scripts
on a real Slurm cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.launch import wait_servers
from megatron_dapo.launch.roles import JobRoles, describe, shell_assignments
from tests.ports import free_port_block
from tests.procs import processes
from tests.torchrun import REPO


def _roles(**kw) -> JobRoles:
    base = dict(mode="split", nodes=tuple(f"n{i}" for i in range(16)), actor_nodes=8, gpus_per_node=8, sglang_tp=4,
                master_addr="10.0.0.1")
    return JobRoles(**(base | kw))


def test_split_roles_at_dapo_32b_scale():
    """sbatch -N 16 with the 32B recipe: nodes 0-7 hold the 64 actor ranks, nodes 8-15 two TP-4 servers each, the
    router on node 8 (the first rollout node) at base + 2."""
    r = _roles()
    assert r.actor == tuple(f"n{i}" for i in range(8)) and r.rollout == tuple(f"n{i}" for i in range(8, 16))
    assert r.world_size == 64 and r.servers_per_node == 2
    urls = r.server_urls()
    assert len(urls) == 16 and urls[:3] == ["http://n8:30000", "http://n8:30001", "http://n9:30000"]
    assert r.server_urls("n15") == ["http://n15:30000", "http://n15:30001"]
    assert r.router_url == "http://n8:30002"
    table = describe(r)
    assert "node   4 n4: torchrun node_rank 4 (global ranks 32-39)" in table
    assert "node   8 n8: SGLang server(s) on port(s) 30000, 30001; router on port 30002" in table
    assert "rendezvous 10.0.0.1:29500; weight sync from 10.0.0.1:29650" in table


def test_colocated_roles_list_every_nodes_engines_in_global_rank_order():
    r = _roles(mode="colocated", nodes=("a", "b"), actor_nodes=2)
    assert r.actor == r.rollout == ("a", "b") and r.world_size == 16
    assert r.server_urls() == ["http://a:30000", "http://a:30001", "http://b:30000", "http://b:30001"]
    assert r.router_url is None  # the trainer addresses each engine itself
    assert "node   1 b: torchrun node_rank 1 (global ranks 8-15); SGLang server(s)" in describe(r)


def test_attached_roles_use_the_running_servers_and_every_node_for_the_actor():
    """SGLANG_URLS given to split.sbatch: the job's nodes are all actor nodes, the URLs (and router) are the given
    ones, and a node count that leaves nodes idle is refused."""
    urls = ("http://r0:30000", "http://r0:30001")
    r = _roles(nodes=tuple(f"n{i}" for i in range(8)), attached=urls, attached_router="http://r0:30002")
    assert r.rollout == () and r.server_urls() == list(urls) and r.router_url == "http://r0:30002"
    assert "its SGLang servers already running elsewhere" in describe(r)
    with pytest.raises(ValueError, match=r"every node of the job runs the actor: submit with `sbatch -N 8`"):
        _roles(attached=urls)
    with pytest.raises(ValueError, match="for split runs"):
        _roles(mode="colocated", actor_nodes=16, attached=urls)


@pytest.mark.parametrize("kw,match", [
    (dict(nodes=tuple(f"n{i}" for i in range(8))), r"needs more nodes than its ACTOR_NODES=8 .* `sbatch -N 9`"),
    (dict(sglang_tp=3), r"SGLANG_TP=3 .* must divide GPUS_PER_NODE=8"),
    (dict(servers=3), r"SERVERS_PER_NODE=3 servers of SGLANG_TP=4 GPUs do not fit"),
    (dict(mode="colocated"), r"colocated run's actor runs on every node: ACTOR_NODES=8 but the job has 16"),
    (dict(mode="hybrid"), r"MODE='hybrid'"),
    (dict(nodes=("a", "a")), r"names a node twice"),
    (dict(master_port=80), r"MASTER_PORT=80"),
], ids=["too-few-nodes", "tp-not-dividing", "servers-overflow", "colocated-count", "mode", "duplicate", "port"])
def test_roles_refuse_what_cannot_run_naming_the_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        _roles(**kw)


def test_shell_assignments_evaluate_to_the_same_roles():
    r = _roles(nodes=("a", "b", "c"), actor_nodes=2, gpus_per_node=4, sglang_tp=1, servers=2)
    script = (shell_assignments(r)
              + '\necho "${ACTOR_HOSTS[*]}|${ROLLOUT_HOSTS[*]}|${SERVER_URLS[*]}|$ROUTER_URL|$WORLD_SIZE"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "a b|c|http://c:30000 http://c:30001|http://c:30002|8"


def test_wait_names_the_nodes_whose_servers_never_answer():
    up = {"http://n8:30000", "http://n8:30001", "http://n9:30000"}
    urls = sorted(up) + ["http://n9:30001", "http://n10:30000"]
    with pytest.raises(TimeoutError, match=r"node n9 \(http://n9:30001\); node n10 \(http://n10:30000\)"):
        wait_servers.wait_for_servers(urls, 0.3, probe=lambda u: u in up, poll_s=0.05, log=lambda m: None)
    calls = []
    waited = wait_servers.wait_for_servers(sorted(up), 5, probe=lambda u: calls.append(u) or len(calls) > 3,
                                           poll_s=0.01, log=lambda m: None)
    assert calls == sorted(up) * 2  # no server answered the first round, all the second: it returned then
    assert waited >= 0.01  # the seconds it waited: one poll interval at least (a sleep is never shorter)
    with pytest.raises(RuntimeError, match="launcher exited while waiting for node n8"):
        wait_servers.wait_for_servers(sorted(up), 60, alive=lambda: False, probe=lambda u: False, log=lambda m: None)


def test_wait_cli_exits_1_with_the_hint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.launch.wait_servers", "http://127.0.0.1:9",
                          "--timeout-s", "0.5", "--log-hint", "see LOGS"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "not answering /health after 0 s: node 127.0.0.1 (http://127.0.0.1:9); see LOGS" in out.stderr


# ---- the rollout-node supervisor on stand-in servers (tests/sglang/fake_server.py) ---------------------------

def _fake_python(tmp_path: Path, lifetime: int = 120) -> Path:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nFAKE_SGLANG_LIFETIME={lifetime} exec {sys.executable} '
                       f'{REPO}/tests/sglang/fake_server.py "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _key_file(tmp_path: Path) -> Path:
    key = tmp_path / "key"
    key.write_text("job-key-0123456789\n")
    key.chmod(0o600)
    return key


def _wait_for(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def _group_members(pgids: set[int]) -> list[int]:
    return [pid for pid, f in processes() if int(f[2]) in pgids and f[0] != "Z"]


def _supervisor(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_dapo.launch.rollout_node", "--hf-checkpoint", "/m",
           "--sglang-num-servers", "2", "--sglang-base-port", str(port), "--sglang-host", "0.0.0.0",
           "--sglang-api-key-file", str(_key_file(tmp_path)), "--sglang-device", "cpu",
           "--sglang-python", str(_fake_python(tmp_path)), "--sglang-server-wait-s", "30",
           "--log-dir", str(tmp_path / "logs"), *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 30) -> str:
    """Lines of `proc` up to one containing `needle` (AssertionError with what was read if it exits first)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"no {needle!r} in:\n{''.join(seen)}")


def test_supervisor_restarts_a_killed_server_and_stops_everything_on_sigterm(tmp_path):
    """Two servers and the router (in front of both): server 0's process group SIGKILLed is restarted at once and
    answers again; SIGTERM ends the supervisor with exit 0, its log saying so before "stopped", and no process of
    any group it started (restarted one included) is left, nor the key's 0600 copy; the key is on no command
    line."""
    port = free_port_block(3)
    workers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    sup = _supervisor(tmp_path, port, "--router-worker-urls", *workers)
    try:
        _read_until(sup, f"router on port {port + 2} in front of 2 server(s)")
        pgids = {pid for pid, f in processes() if int(f[1]) == sup.pid}
        assert len(pgids) == 3  # two servers and the router, each its own process group
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in pgids]
        assert not any(b"job-key-0123456789" in c for c in cmdlines)
        server0 = next(p for p, c in zip(pgids, cmdlines, strict=True) if f"--port\x00{port}\x00".encode() in c)
        os.killpg(server0, signal.SIGKILL)
        log = _read_until(sup, "sglang server 0 back after")
        assert f"sglang server 0 (http://0.0.0.0:{port}) exited with -9: restart 1 of 3 within 3600 s" in log
        pgids |= {pid for pid, f in processes() if int(f[1]) == sup.pid}
        sup.send_signal(signal.SIGTERM)
        # 60 s only bounds a hang (the servers exit at SIGTERM; STOP_GRACE_S is 3 s): how fast is not the point.
        rest = sup.communicate(timeout=60)[0]
        assert sup.returncode == 0, rest
        assert 0 <= rest.find("SIGTERM: stopping this node's servers") < rest.find("] stopped"), rest
        assert _wait_for(lambda: not _group_members(pgids), 10), _group_members(pgids)
        assert not list(Path("/tmp").glob(f"sglang_key-*-{sup.pid}-*"))
    finally:
        sup.kill()
        sup.wait()


def test_supervisor_gives_up_after_max_restarts_with_exit_1(tmp_path):
    """--max-restarts 0: the first server exit ends the node (exit 1: srun --kill-on-bad-exit then ends the job),
    naming the server and the flag, and its other server is stopped."""
    port = free_port_block(2)
    sup = _supervisor(tmp_path, port, "--max-restarts", "0")
    try:
        _read_until(sup, "2 server(s) answer")
        pgids = {pid for pid, f in processes() if int(f[1]) == sup.pid}
        os.killpg(min(pgids), signal.SIGKILL)
        rest = sup.communicate(timeout=30)[0]
        assert sup.returncode == 1
        assert "exited with -9 after 0 restart(s) within 3600 s (--max-restarts 0, --restart-window-s)" in rest
        assert _wait_for(lambda: not _group_members(pgids), 10)
    finally:
        sup.kill()
        sup.wait()


def _kill_server0(sup: subprocess.Popen, port: int) -> None:
    """SIGKILL the process group of the supervisor's server on `port`."""
    pgid = next(p for p, f in processes() if int(f[1]) == sup.pid
                and f"--port\x00{port}\x00".encode() in Path(f"/proc/{p}/cmdline").read_bytes())
    os.killpg(pgid, signal.SIGKILL)


def test_supervisor_counts_restarts_within_its_window(tmp_path):
    """--max-restarts 1: a server killed, restarted and killed again within --restart-window-s (an hour, which
    the test cannot outlast) ends the node (exit 1); with a 2 s window, a server killed again once the window has
    passed is restarted again (a long run outlives unrelated crashes)."""
    port = free_port_block(2)
    (tmp_path / "hour").mkdir()
    sup = _supervisor(tmp_path / "hour", port, "--max-restarts", "1", "--restart-window-s", "3600")
    try:
        _read_until(sup, "2 server(s) answer")
        _kill_server0(sup, port)
        assert "restart 1 of 1 within 3600 s" in _read_until(sup, "sglang server 0 back after")
        _kill_server0(sup, port)
        rest = sup.communicate(timeout=60)[0]
        assert sup.returncode == 1 and "after 1 restart(s) within 3600 s" in rest, rest
    finally:
        sup.kill()
        sup.wait()
    (tmp_path / "short").mkdir()
    port = free_port_block(2)
    sup = _supervisor(tmp_path / "short", port, "--max-restarts", "1", "--restart-window-s", "2")
    try:
        _read_until(sup, "2 server(s) answer")
        _kill_server0(sup, port)
        assert "restart 1 of 1 within 2 s" in _read_until(sup, "sglang server 0 back after")
        # The window must pass on the supervisor's clock (the same CLOCK_MONOTONIC): it noted the restart before
        # printing the lines read above, and a sleep never ends early, so the next exit comes > 2 s after it.
        time.sleep(2.0)
        _kill_server0(sup, port)
        assert "restart 1 of 1 within 2 s" in _read_until(sup, "sglang server 0 back after")
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
        assert sup.returncode == 0
    finally:
        sup.kill()
        sup.wait()


def test_supervisor_refuses_a_wide_bind_without_a_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.launch.rollout_node", "--hf-checkpoint", "/m",
                          "--sglang-host", "0.0.0.0", "--log-dir", str(tmp_path), "--check-only"], cwd=REPO,
                         env={k: v for k, v in os.environ.items() if k != "SGLANG_API_KEY"}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "without an API key" in out.stderr and "--sglang-api-key-file" in out.stderr


# ---- examples/slurm/ without Slurm: DRY_RUN and the refusals --------------------------------------------------

def _job(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | env
    return subprocess.run(["bash", f"examples/slurm/{script}", *args], cwd=REPO, env=run_env, capture_output=True,
                          text=True, timeout=120)


def test_split_sbatch_dry_run_prints_the_roles_and_a_plan_that_fits():
    out = _job("split.sbatch", "qwen2.5-32b", DRY_RUN="1", NODES="16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "split run on 16 nodes: 8 actor node(s) x 8 ranks = 64 actor ranks, 8 rollout node(s) x 2" in out.stdout
    assert "node   8 node008: SGLang server(s) on port(s) 30000, 30001; router on port 30002" in out.stdout
    assert "layout: TP8 x PP2 x CP1 x DP4 = 64 GPUs" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("plan: peak ")


@pytest.mark.parametrize("recipe,nodes", [("qwen2.5-32b", 8), ("deepseek-v3-671b", 24)],
                         ids=["qwen2.5-32b", "deepseek-v3-671b"])
def test_split_sbatch_attached_to_running_servers_plans_the_actor_on_every_node(recipe, nodes):
    """DeepSeek-V3 671B runs only so: its servers span several nodes, which the job does not start."""
    out = _job("split.sbatch", recipe, DRY_RUN="1", NODES=str(nodes),
               SGLANG_URLS="http://r0:30000 http://r0:30001", SGLANG_ROUTER_URL="http://r0:30002")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (f"split run on {nodes} nodes: {nodes} actor node(s) x 8 ranks = {nodes * 8} actor ranks, its SGLang "
            "servers already") in out.stdout
    assert "attached to 2 server(s) already running: http://r0:30000 http://r0:30001" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("plan: peak ")


def test_colocated_sbatch_dry_run_plans_both_phases_on_every_node():
    out = _job("colocated.sbatch", "qwen2.5-32b-colocated", "--dry-run", NODES="16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "colocated run on 16 nodes: 16 actor node(s) x 8 ranks = 128 actor ranks" in out.stdout
    assert "layout: TP8 x PP2 x CP1 x DP8 = 128 GPUs" in out.stdout


@pytest.mark.parametrize("script,args,env,match", [
    ("split.sbatch", ["qwen2.5-32b"], {"DRY_RUN": "1", "NODES": "8"}, "`sbatch -N 9` or more"),
    ("split.sbatch", ["qwen2.5-32b-colocated"], {"DRY_RUN": "1"},
     "is a colocated run: submit examples/slurm/colocated"),
    ("split.sbatch", ["qwen9"], {"DRY_RUN": "1"}, "RECIPE 'qwen9' is not one of: cpu-rehearsal"),
    ("split.sbatch", ["qwen2.5-32b"], {}, "not inside a Slurm job"),
    ("split.sbatch", ["deepseek-v3-671b"], {"NODES": "28"},
     "start multi-node SGLang servers apart (e.g. --tp 32 --nnodes 4) and pass their URLs in SGLANG_URLS"),
], ids=["too-few-nodes", "wrong-mode", "unknown-recipe", "outside-slurm", "671b-servers-not-attached"])
def test_sbatch_scripts_refuse_naming_the_fix(script, args, env, match):
    out = _job(script, *args, **env)
    assert out.returncode == 2 and match in out.stderr, out.stderr


@pytest.mark.parametrize("script,roles,peak", [
    ("run_qwen3_30b_a3b_multinode.sh", "split run on 8 nodes: 4 actor node(s) x 8 ranks = 32 actor ranks", "58."),
    ("run_moonlight_16b_a3b_multinode.sh", "split run on 4 nodes: 2 actor node(s) x 8 ranks = 16 actor ranks", "46."),
    ("run_deepseek_v3_671b_multinode.sh", "split run on 25 nodes: 24 actor node(s) x 8 ranks = 192 actor ranks",
     "70."),
], ids=["qwen3-30b-a3b", "moonlight-16b-a3b", "deepseek-v3-671b"])
def test_per_node_launcher_dry_run_needs_no_node_environment(script, roles, peak):
    """The plans the recipes' headers quote (the peak's whole GiB), from the shipped config.json."""
    out = subprocess.run(["bash", f"examples/{script}", "--dry-run"], cwd=REPO,
                         env={k: v for k, v in os.environ.items()
                              if k not in ("NODE_RANK", "MASTER_ADDR", "SGLANG_URLS", "ACTOR_NODES", "ROLLOUT_NODES")},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert roles in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith(f"plan: peak {peak}")


def test_single_node_launcher_dry_run_through_a_model_wrapper():
    """--dry-run reaches the 7B launcher through the Llama wrapper (the arguments forwarded, not taken for HF_CKPT):
    the node's roles and the plan at 4 actor ranks, from the shipped config.json."""
    out = subprocess.run(["bash", "examples/run_llama3.1_8b_single_node.sh", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "single node: actor ranks 0-3 on GPUs 0-3 (torchrun), 2 SGLang servers at TP 2 on GPUs 4-7" in out.stdout
    assert "examples/models/llama3.1-8B/config.json" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("plan: peak 62.")


# ---- examples/slurm/ inside a stand-in Slurm job: what the job refuses and what each step gets -----------------

FAKE_SCONTROL = '#!/bin/sh\n[ "$1" = show ] && [ "$2" = hostnames ] && echo "$3" | tr "," "\\n"\n'
RECORDER = """#!{python}
import json, os, sys
out = os.path.join({out!r}, f"{{os.path.basename(sys.argv[0])}}.{{os.getpid()}}.json")
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open(out, "w"))
"""


def _in_job(tmp_path: Path, script: str, args: list[str], nodes: int, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                           list[dict]]:
    """Runs examples/slurm/SCRIPT as Slurm would inside job 4242 on `nodes` nodes (SLURM_* as sbatch sets them),
    with a stand-in `scontrol` and an `srun` that records each step (its arguments and environment) and ends at
    once; (the job's result, the steps' records)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    out.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "srun").write_text(RECORDER.format(python=sys.executable, out=str(out)))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run_env |= {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NODELIST": ",".join(f"gpu{i:03d}" for i in range(nodes)), "MASTER_ADDR": "127.0.0.1",
                "SERVER_WAIT_S": "30", **env}
    res = subprocess.run(["bash", f"examples/slurm/{script}", *args], cwd=REPO, env=run_env, capture_output=True,
                         text=True, timeout=180)
    return res, [json.loads(f.read_text()) for f in sorted(out.glob("srun.*.json"))]


@pytest.mark.parametrize("script,recipe,env,said", [
    ("split.sbatch", "qwen2.5-32b", {"CUDA_VISIBLE_DEVICES": ""},
     "the job asked Slurm for no GPU, and torch sees 0 on node 0"),
    ("colocated.sbatch", "qwen2.5-32b-colocated", {"CUDA_VISIBLE_DEVICES": ""},
     "the job asked Slurm for no GPU, and torch sees 0 on node 0"),
    ("split.sbatch", "qwen3-30b-a3b", {"SLURM_GPUS_ON_NODE": "4"}, "SLURM_GPUS_ON_NODE=4"),
], ids=["split-none", "colocated-none", "split-too-few"])
def test_a_gpu_recipe_without_its_gpus_is_refused_at_the_start_with_the_line_to_add(tmp_path, script, recipe, env,
                                                                                    said):
    """Submitted without --gpus-per-node (or --gres), the trainer would silently fall back to CPU, gloo and fp32
    and fail late: the job ends first, before the plan, the key or any step, naming the #SBATCH line."""
    res, steps = _in_job(tmp_path, script, [recipe, "/models/fake", str(tmp_path / "run")], 16, **env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert said in res.stderr and "the trainer would fall back to CPU, gloo and fp32" in res.stderr
    assert f"Add `#SBATCH --gpus-per-node=8` to examples/slurm/{script}" in res.stderr
    assert "`--gres=gpu:8`" in res.stderr
    assert not steps and not (tmp_path / "run").exists()


def test_the_cpu_rehearsal_needs_no_gpu_request(tmp_path):
    """The rehearsal's recipes run SGLang on CPU (SGLANG_DEVICE=cpu) and gloo ranks: no GPU asked, none refused;
    the job goes on to its plan."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((REPO / "examples/models/qwen2.5-7B/config.json").read_text())
    res, _ = _in_job(tmp_path, "split.sbatch", ["cpu-rehearsal", str(model), str(tmp_path / "run"), "--dry-run"], 3,
                     CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gpus-per-node" not in res.stderr and "== memory plan" in res.stdout


def test_routing_replay_in_a_slurm_job_starts_the_servers_that_return_routed_experts(tmp_path):
    """MOE_ROUTING_REPLAY=1 with the Qwen3-30B-A3B recipe (--moe-routing-replay): the rollout step's servers get
    --enable-return-routed-experts (derived from the trainer's flags: examples/lib/launch.sh server_flags), down to
    the supervisor's --sglang-extra-args, which ServerConfig puts on every sglang.launch_server command line. The
    stand-in srun ends the rollout step at once, so the job ends there (exit 1, the servers never answer)."""
    from megatron_dapo.launch.rollout_node import build_parser as rollout_parser
    from megatron_dapo.rollout.sglang.server import ServerConfig

    res, steps = _in_job(tmp_path, "split.sbatch", ["qwen3-30b-a3b", "/models/fake", str(tmp_path / "run")], 8,
                         SLURM_GPUS_ON_NODE="8", MOE_ROUTING_REPLAY="1")
    assert res.returncode == 1 and "launcher exited while waiting" in res.stderr, res.stderr[-2000:]
    (rollout,) = steps
    assert rollout["argv"][-1] == "examples/slurm/rollout_node.sh"
    assert rollout["env"]["SGLANG_SERVER_ARGS"] == "--enable-return-routed-experts"
    assert "== SGLang servers' extra flags: --enable-return-routed-experts" in res.stdout
    # the rollout node's script itself, with that step's environment, a recording $PY, as node rollout 0
    py = tmp_path / "py"
    py.write_text(RECORDER.format(python=sys.executable, out=str(tmp_path)))
    py.chmod(0o755)
    subprocess.run(["bash", "examples/slurm/rollout_node.sh"], cwd=REPO, check=True, timeout=60,
                   env=rollout["env"] | {"PY": str(py), "SLURM_PROCID": "0"})
    (rec,) = [json.loads(f.read_text()) for f in tmp_path.glob("py.*.json")]
    a = rollout_parser().parse_args(rec["argv"][2:])
    assert rec["argv"][:2] == ["-m", "megatron_dapo.launch.rollout_node"]
    config = ServerConfig(model_path=a.hf_checkpoint, extra_args=tuple(a.sglang_extra_args.split()))
    assert "--enable-return-routed-experts" in config.server_command(0)


@pytest.mark.parametrize("nodes", ["0", "abc", "-3", "1 2", "16x", "100000", "PPID[$(touch {marker})]"],
                         ids=["zero", "word", "negative", "two-words", "suffix", "too-many", "expression"])
@pytest.mark.parametrize("script,recipe", [("split.sbatch", "qwen2.5-32b"),
                                           ("colocated.sbatch", "qwen2.5-32b-colocated")], ids=["split", "colocated"])
def test_nodes_that_is_not_a_node_count_is_refused_naming_nodes(tmp_path, script, recipe, nodes):
    """Issue 38.13: `DRY_RUN=1 NODES=0` / `NODES=abc` ended in bash's "unbound variable" (NODES went into the
    node loop's arithmetic, which also evaluates an expression, `$(...)` included); now one line names NODES, and
    nothing of the value runs."""
    marker = tmp_path / "ran"
    out = _job(script, recipe, DRY_RUN="1", NODES=nodes.format(marker=marker))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: NODES=") and len(out.stderr.splitlines()) == 1, out.stderr
    assert "must be a whole number from 1 to 99999" in out.stderr and not marker.exists()
    assert out.stdout == ""  # refused before the roles or the plan


@pytest.mark.parametrize("name,value", [("ACTOR_NODES", "x"), ("ROLLOUT_NODES", "0")])
def test_the_recipes_node_counts_from_the_environment_are_checked_too(name, value):
    out = _job("split.sbatch", "qwen2.5-32b", DRY_RUN="1", **{name: value})
    assert out.returncode == 2 and out.stderr.startswith(f"error: {name}='{value}' must be a whole number"), out.stderr


def test_nodes_with_a_leading_zero_is_its_number():
    out = _job("colocated.sbatch", "qwen2.5-32b-colocated", DRY_RUN="1", NODES="08")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "colocated run on 8 nodes: 8 actor node(s) x 8 ranks = 64 actor ranks" in out.stdout


def _spaced_python(tmp_path: Path) -> Path:
    """The trainer's interpreter at a path with a space: a directory "with space/venv" linking to this venv (a venv's
    python finds its packages from its own path, so the link is to the directory, not to the binary)."""
    spaced = tmp_path / "with space"
    spaced.mkdir()
    (spaced / "venv").symlink_to(Path(sys.executable).parent.parent)
    return spaced / "venv" / "bin" / Path(sys.executable).name


def _recording_python(tmp_path: Path) -> Path:
    """A stand-in $PY at a path with a space that records its argv and environment into tmp_path/py.<pid>.json."""
    py = tmp_path / "recording py" / "py"
    py.parent.mkdir()
    py.write_text(RECORDER.format(python=sys.executable, out=str(tmp_path)))
    py.chmod(0o755)
    return py


def test_a_python_path_with_a_space_reaches_the_rollout_nodes_whole(tmp_path):
    """Issue 38.13: PY (and so SGLANG_PY) at a path with a space, and a run directory with one: the job's own lines
    (split.sbatch in a stand-in Slurm job, then its rollout step's script with that step's environment) give the
    supervisor --sglang-python as one word; `read -a` of one flat string split it in two before."""
    from megatron_dapo.launch.rollout_node import build_parser as rollout_parser

    py, run_dir = _spaced_python(tmp_path), tmp_path / "run dir"
    res, steps = _in_job(tmp_path, "split.sbatch", ["qwen2.5-32b", "/models/fake", str(run_dir)], 16,
                         SLURM_GPUS_ON_NODE="8", PY=str(py))
    assert res.returncode == 1 and "launcher exited while waiting" in res.stderr, res.stderr[-2000:]
    (rollout,) = steps
    assert f"--output={run_dir}/slurm-4242/rollout-%N.log" in rollout["argv"]
    assert rollout["env"]["SGLANG_PY"] == rollout["env"]["PY"] == str(py)
    recorder = _recording_python(tmp_path)
    subprocess.run(["bash", "examples/slurm/rollout_node.sh"], cwd=REPO, check=True, timeout=60,
                   env=rollout["env"] | {"PY": str(recorder), "SLURM_PROCID": "0"})
    (rec,) = [json.loads(f.read_text()) for f in tmp_path.glob("py.*.json")]
    assert rec["argv"][:2] == ["-m", "megatron_dapo.launch.rollout_node"]
    a = rollout_parser().parse_args(rec["argv"][2:])
    assert a.sglang_python == str(py) and a.hf_checkpoint == "/models/fake"
    assert a.sglang_tp_size == 4 and a.sglang_num_servers == 2 and a.sglang_device == "cuda" and a.max_restarts == 3
    assert a.sglang_api_key_file == f"{run_dir}/slurm-4242/sglang-api-key"
    assert a.log_dir.startswith(f"{run_dir}/slurm-4242/sglang-") and len(a.router_worker_urls) == 16


def test_a_python_path_with_a_space_reaches_the_colocated_nodes_whole(tmp_path):
    """The colocated job's node script, the same way: its engines' supervisor gets the whole path, and its
    torchrun (a stand-in TORCHRUN) gets the trainer's arguments as the job built them."""
    from megatron_dapo.launch.rollout_node import build_parser as rollout_parser

    py = _spaced_python(tmp_path)
    res, steps = _in_job(tmp_path, "colocated.sbatch", ["qwen2.5-32b-colocated", "/models/fake", str(tmp_path / "run")],
                         16, SLURM_GPUS_ON_NODE="8", PY=str(py))
    assert res.returncode == 0, res.stderr[-2000:]  # the stand-in srun's step "finished"
    (node,) = steps
    recorder = _recording_python(tmp_path)
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(RECORDER.format(python=sys.executable, out=str(tmp_path)))
    torchrun.chmod(0o755)
    subprocess.run(["bash", *node["argv"][node["argv"].index("bash") + 1:]], cwd=REPO, check=True, timeout=60,
                   env=node["env"] | {"PY": str(recorder), "TORCHRUN": str(torchrun), "SLURM_PROCID": "0",
                                      "SLURM_STEP_NUM_NODES": "16"})
    calls = [json.loads(f.read_text()) for f in tmp_path.glob("py.*.json")]
    (engines,) = [c for c in calls if c["argv"][:2] == ["-m", "megatron_dapo.launch.rollout_node"]]
    assert rollout_parser().parse_args(engines["argv"][2:]).sglang_python == str(py)
    (trainer,) = [json.loads(f.read_text()) for f in tmp_path.glob("torchrun.*.json")]
    assert trainer["argv"][trainer["argv"].index("-m") + 1] == "megatron_dapo.train"
    assert trainer["argv"][trainer["argv"].index("--hf-checkpoint") + 1] == "/models/fake"


def test_routing_replay_reaches_the_trainer_and_the_by_hand_servers_are_told(tmp_path):
    """The by-hand launcher of the same recipe: the trainer gets --moe-routing-replay, and its --dry-run names the
    flag the servers started apart (examples/launch_sglang_servers.sh) need."""
    from tests.unit.launch.test_examples import launcher_args

    _, train_args = launcher_args(tmp_path, "examples/run_qwen3_30b_a3b_multinode.sh",
                                  {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000",
                                   "MOE_ROUTING_REPLAY": "1"})
    assert "--moe-routing-replay" in train_args
    out = subprocess.run(["bash", "examples/run_qwen3_30b_a3b_multinode.sh", "--dry-run"], cwd=REPO,
                         env=dict(os.environ, MOE_ROUTING_REPLAY="1"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("SGLang servers' extra flags: --enable-return-routed-experts (start them with "
            "SGLANG_EXTRA_ARGS=\"--enable-return-routed-experts\" examples/launch_sglang_servers.sh)") in out.stdout


def test_servers_started_by_hand_take_the_lone_flag(tmp_path):
    """examples/launch_sglang_servers.sh with SGLANG_EXTRA_ARGS=--enable-return-routed-experts (what the by-hand
    --dry-run names): one flag and no space, which argparse took for an option of rollout_node's own when passed
    as a separate word (exit 2 before any server); passed as --sglang-extra-args=VALUE it reaches every server."""
    from tests.unit.rollout.sglang.test_server_alloc_conf import _run_launcher

    records = _run_launcher(tmp_path, "examples/launch_sglang_servers.sh",
                            ["/models/fake", "1", "1", str(free_port_block(2))],
                            {"SGLANG_EXTRA_ARGS": "--enable-return-routed-experts", "SGLANG_RUN_DIR": str(tmp_path)},
                            servers=1)
    argv = records["python"][0]["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"] and "--enable-return-routed-experts" in argv


def test_attached_servers_without_routed_experts_are_refused_before_the_run_starts():
    """The by-hand and fleet paths (servers started apart): the trainer asks each attached server's /server_info
    and names every one that runs without --enable-return-routed-experts; one that does not say is left to the
    first response."""
    import httpx

    from megatron_dapo.errors import UserError
    from megatron_dapo.rollout.sglang.setup import check_attached_routes

    infos = {"http://r0:30000": {"enable_return_routed_experts": True},
             "http://r0:30001": {"enable_return_routed_experts": False}, "http://r1:30000": {"tp_size": 4},
             "http://r1:30001": {"enable_return_routed_experts": False}}

    def get(url, timeout, headers):
        base = url.rsplit("/", 1)[0]
        return httpx.Response(200, json=infos[base]) if url.endswith("/server_info") else httpx.Response(404)

    with pytest.raises(UserError, match=r"--moe-routing-replay needs every SGLang server started with "
                                        r"--enable-return-routed-experts, and http://r0:30001, http://r1:30001 run"):
        check_attached_routes(list(infos), get=get)
    check_attached_routes(["http://r0:30000", "http://r1:30000"], get=get)  # on, and silent: no error


SERVER_INFO_PROBE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
for flags in json.loads(sys.argv[1]):
    info = prepare_server_args(["--model-path", "/m", "--device", "cpu", *flags]).resolved_dict()
    print(json.dumps({"enable_return_routed_experts": info["enable_return_routed_experts"]}))
"""


@pytest.mark.sglang
@pytest.mark.skipif(not (REPO / ".venv-sglang/bin/python").exists(), reason="no .venv-sglang: run `make sglang-env`")
def test_the_attach_check_reads_what_sglang_reports():
    """SGLang 0.5.23's /server_info is its resolved server arguments (utils/common.py build_server_info): the field
    the attach check reads is there, False without the flag and True with it."""
    out = subprocess.run([str(REPO / ".venv-sglang/bin/python"), "-c", SERVER_INFO_PROBE,
                          json.dumps([[], ["--enable-return-routed-experts"]])], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, SGLANG_USE_CPU_ENGINE="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert [json.loads(line) for line in out.stdout.splitlines()] == [{"enable_return_routed_experts": False},
                                                                      {"enable_return_routed_experts": True}]


@pytest.mark.parametrize("given,trainer,want", [
    ("", ["--moe-routing-replay"], "--enable-return-routed-experts"),
    ("", ["--moe-routing-rep"], "--enable-return-routed-experts"),  # argparse's abbreviation: the trainer takes it
    ("--mem-fraction-static 0.77 --enable-return-routed-experts", ["--moe-routing-replay"],
     "--mem-fraction-static 0.77 --enable-return-routed-experts"),  # once
    ("--mem-fraction-static 0.77", [], "--mem-fraction-static 0.77"),
], ids=["replay", "abbreviated", "already-given", "no-replay"])
def test_server_args_follow_the_trainers_parser(given, trainer, want):
    from megatron_dapo.launch.server_args import server_args

    base = ["--hf-checkpoint", "/m", "--prompt-data", "p.jsonl", "--num-steps", "1"]
    assert server_args(given, base + trainer) == want


def test_server_args_cli_takes_flags_that_look_like_options():
    """What examples/lib/launch.sh runs: the servers' flags so far (starting with --) after `=`, then `--`."""
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.launch.server_args",
                          "--server-args=--mem-fraction-static 0.77 --enable-memory-saver", "--", "--hf-checkpoint",
                          "/m", "--prompt-data", "p.jsonl", "--num-steps", "1", "--moe-routing-replay"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "--mem-fraction-static 0.77 --enable-memory-saver --enable-return-routed-experts"
