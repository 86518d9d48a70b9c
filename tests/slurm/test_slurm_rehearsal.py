"""The CPU rehearsal: examples/slurm/split.sbatch itself, submitted with sbatch to a real Slurm cluster of three node
namespaces on this machine (tools/slurm_cluster.py, proctrack/pgid: the plugin that kills least, so what is left
after a job is what the launchers failed to stop).

- The dense job (examples/recipes/cpu-rehearsal.sh, `sbatch -N 3`): two actor nodes of 2 gloo ranks (TP 2 x PP 2,
  one pipeline stage a node as in the 32B layout, one torchrun per node, rendezvous on node 0), a rollout node with
  two real CPU SGLang servers behind the router, weights synced over gloo from both pipeline stages' source ranks
  (node 0 and node 1) to the rollout node after every step. Once step 1 is logged the test SIGKILLs server 0's
  process group on the rollout node: the node's supervisor restarts it, the trainer finds it restarted before the
  next update and re-syncs it; after step 3 both servers score one sequence alike (the restarted one holds the
  current weights). The job ends by itself after 4 steps; nothing it started is left on any node, and the API key
  was on no command line.
- The fully async job: the dense job's nodes with MAX_STALENESS=2 (--max-staleness 2, rollout/streaming.py); server
  0 is killed while the rollout generates ahead of training, the run trains every step through it.
- The colocated job (examples/recipes/cpu-rehearsal-colocated.sh with examples/slurm/colocated.sbatch, 2 nodes), with
  REHEARSAL_ALL=1 only (~2.5 min).
- The MoE job (examples/recipes/cpu-rehearsal-moe.sh, `sbatch -N 2`): a tiny Qwen3-MoE, the actor at EP 2 on one
  node, one server on the other; after step 2 the test runs `scancel`: every process on every node is gone within
  Slurm's KillWait.

Needs root, network namespaces and the slurm + munge packages (`python tools/slurm_cluster.py install`; `make test`
installs them where it can) and .venv-sglang; skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, train_env
from tests.e2e.test_run_secrets import files_holding
from tests.procs import processes

sys.path.insert(0, str(REPO / "tools"))
import slurm_cluster  # noqa: E402

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
REASON = slurm_cluster.check()
pytestmark = [
    pytest.mark.slurm, pytest.mark.sglang, pytest.mark.slow, pytest.mark.rehearsal,
    pytest.mark.skipif(REASON is not None, reason=f"no local Slurm: {REASON}"),
    pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm")).up(nodes=3, proctrack="pgid", cpus_per_node=2)
    try:
        yield c
    finally:
        left = c.down()
        assert not left, f"the cluster's teardown had to kill what a job left: {left}"


def _wait(pred, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := pred()):
            return got
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def _submit(cluster, nodes: int, recipe: str, model: Path, run_dir: Path, env: dict[str, str],
            script: str = "split.sbatch") -> tuple[int, Path]:
    """sbatch from the repository root (the job cds to SLURM_SUBMIT_DIR); (job id, the batch script's output)."""
    out = run_dir.parent / f"{run_dir.name}-slurm.out"
    res = cluster.run(["sbatch", "--parsable", "-N", str(nodes), "-o", str(out), f"examples/slurm/{script}",
                       recipe, str(model), str(run_dir)], cwd=REPO, env=cluster.env(train_env() | env),
                      capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().split(";")[0]), out


def _queued(cluster, job: int) -> bool:
    res = cluster.run(["squeue", "-h", "-j", str(job)], capture_output=True, text=True, timeout=30)
    return bool(res.stdout.strip())


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _job_dir(run_dir: Path, job: int) -> Path:
    return run_dir / f"slurm-{job}"


def _server_pgid(cluster, node: str, port: int) -> int | None:
    """The process group of the SGLang server listening on `port` on `node` (its leader's pid: the supervisor starts
    each server with setsid), among the processes of that node's network namespace only."""
    stat = dict(processes())
    for ns, pid, _ in cluster.leftover_pids():
        if ns != node or pid not in stat or int(stat[pid][2]) != pid:
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sglang.launch_server" in argv and str(port).encode() in argv:
            return pid
    return None


def _play_the_kill(cluster, run_dir: Path, job_dir: Path, errors: list[str]) -> None:
    """Once step 1 is logged: SIGKILL server 0's process group on the rollout node and tell the rehearsal's reward
    (tests/rewards.py: length_parity_held) `killed`; `back` once the node's supervisor logs it answering again;
    `resynced` once the trainer logs its re-sync. The reward holds the steps in between (a restarted CPU server
    takes ~40-100 s, a tiny step seconds; at 32B a restart is 1-3 min against a 20-45 min step)."""
    try:
        _wait(lambda: any(r["step"] >= 1 for r in _records(run_dir)), 600, "step 1 logged")
        pgid = _wait(lambda: _server_pgid(cluster, cluster.info()["nodes"][2], 30000), 30, "server 0's process")
        os.killpg(pgid, signal.SIGKILL)
        (run_dir / "killed").touch()
        logs = lambda pattern: [p for p in job_dir.glob(pattern)]  # noqa: E731
        _wait(lambda: any("sglang server 0 back after" in p.read_text() for p in logs("rollout-*.log")), 300,
              "the rollout node's supervisor restarting server 0")
        (run_dir / "back").touch()
        _wait(lambda: any(re.search(r"lost: back after .* re-synced to weight version", p.read_text())
                          for p in logs("actor-*.log")), 300, "the trainer re-syncing server 0")
        (run_dir / "resynced").touch()
    except BaseException as err:  # reported by the test, not lost in a thread
        errors.append(repr(err))


COMPARE = """
import json, sys
import httpx, torch
from transformers import AutoModelForCausalLM
key_file, model_dir, urls = sys.argv[1], sys.argv[2], sys.argv[3:]
headers = {"Authorization": "Bearer " + open(key_file).read().strip()}
ids = [(7 * i + 3) % 80 for i in range(24)]
body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
        "logprob_start_len": 0}
served = [torch.tensor([lp for lp, _, _ in httpx.post(u + "/generate", json=body, headers=headers, timeout=120).json()
                        ["meta_info"]["input_token_logprobs"][1:]]) for u in urls]
with torch.no_grad():
    logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits[0, :-1]
base = logits.double().log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].float()
between, moved = (served[0] - served[1]).abs().max().item(), (served[1] - base).abs().max().item()
print(json.dumps({"between": between, "moved": moved}))
"""
"""Run in the cluster's login namespace: the same 24 token ids scored by both servers of the rollout node (the
weights last pushed) and by the base checkpoint (HF); max |diff| between the servers and from the base."""


def _compare_servers(cluster, key_file: Path, model: Path, node: str) -> dict:
    urls = [f"http://{node}:30000", f"http://{node}:30001"]
    res = cluster.run([sys.executable, "-c", COMPARE, str(key_file), str(model), *urls], cwd=REPO,
                      env=cluster.env(train_env()), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _read_key(key_file: Path) -> str | None:
    """The job's key once its file holds one (secrets.token_hex(32): 64 hex digits), else None."""
    try:
        key = key_file.read_text().strip()
    except OSError:
        return None
    return key if re.fullmatch(r"[0-9a-f]{64}", key) else None


def _command_lines_with(key: str) -> list[str]:
    """Every process whose command line holds `key`: pid, parent pid and the command line, the key shown as <KEY>."""
    found = []
    for pid, fields in processes():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if key.encode() in cmdline:
            argv = cmdline.replace(key.encode(), b"<KEY>").decode(errors="replace").split("\0")
            found.append(f"pid {pid} (parent {fields[1]}): {argv}")
    return found


def test_split_job_trains_across_nodes_and_recovers_a_killed_server(cluster, tiny_base, tmp_path):
    run_dir = tmp_path / "dense"
    run_dir.mkdir()
    (run_dir / "pause").write_text("3")  # step 4 scores once the servers are compared with step 3's weights
    t0 = time.monotonic()
    job, out = _submit(cluster, 3, "cpu-rehearsal", tiny_base / "model", run_dir,
                       {"REHEARSAL_HOLD_DIR": str(run_dir), "NUM_STEPS": "4"})
    job_dir = _job_dir(run_dir, job)
    key_file = job_dir / "sglang-api-key"
    # job.sh creates the file (its shell's redirection) before python writes the key into it: an empty read here
    # once made every command line "hold" the empty key
    key = _wait(lambda: _read_key(key_file), 120, "the job's API key in its file")
    assert key_file.stat().st_mode & 0o777 == 0o600
    errors: list[str] = []
    killer = threading.Thread(target=_play_the_kill, args=(cluster, run_dir, job_dir, errors), daemon=True)
    killer.start()
    leaks: list[str] = []
    compared = None
    rollout_node = cluster.info()["nodes"][2]
    while _queued(cluster, job) and time.monotonic() - t0 < 900:
        leaks += _command_lines_with(key)
        if compared is None and (run_dir / "resynced").exists() and len(_records(run_dir)) >= 3:
            compared = _compare_servers(cluster, key_file, tiny_base / "model", rollout_node)
            (run_dir / "pause").unlink()
        time.sleep(2)
    wall = time.monotonic() - t0
    killer.join(5)
    batch = out.read_text()
    assert not _queued(cluster, job), f"job {job} still queued after {wall:.0f} s:\n{batch[-3000:]}"
    assert not errors, errors
    assert "== training finished" in batch, batch[-3000:]
    # derived, not typed: three nodes, two of them actor nodes, the third the rollout node behind its router
    nodes = cluster.info()["nodes"]
    assert f"node   2 {nodes[2]}: SGLang server(s) on port(s) 30000, 30001; router on port 30002" in batch
    assert f"node   1 {nodes[1]}: torchrun node_rank 1 (global ranks 2-3)" in batch
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the restarted server, re-synced, serves what the other one does (the router may not have sent it work yet),
    # and both moved away from the base checkpoint
    assert compared is not None and compared["between"] < 1e-4 and compared["moved"] > 10 * max(compared["between"],
                                                                                                 1e-6), compared
    assert records[0]["rollout/servers_lost"] == 0
    assert sum(r["rollout/servers_lost"] for r in records) >= 1
    assert sum(r["rollout/server_returns"] for r in records) == 1
    assert sum(r["sync/servers_recovered"] for r in records) == 1
    for r in records:  # every step synced both stages' weights across nodes, and the servers then served them
        assert all(not (isinstance(v, float) and math.isnan(v)) for v in r.values()), r
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r  # fp32 noise; a stale or half-updated server: ~1e-2
        assert r["sync/stage0_s"] > 0 and r["sync/stage1_s"] > 0, r  # node 0's and node 1's source ranks
        assert r["train/grad_norm"] > 0 and r["sync/gbytes"] > 0
    rollout_log = next(job_dir.glob("rollout-*.log")).read_text()
    assert "sglang server 0" in rollout_log and "restart 1 of 3" in rollout_log
    assert not leaks, f"the API key was on a process's command line: {leaks[:5]}"
    assert not key_file.exists()  # removed when the job ended
    # nor in any file the job wrote ($JOB_DIR: the nodes' logs, the servers' and the router's; the run's records;
    # the batch output); SGLang printed its arguments into the servers' logs with the key's place marked
    assert files_holding(tmp_path, (key,)) == []
    server_logs = list(job_dir.glob("sglang-*/sglang_*.log"))
    assert len(server_logs) == 2 and all("'api_key': '<redacted>'" in p.read_text() for p in server_logs), server_logs
    assert _wait(lambda: not cluster.leftover_pids(), 30, "no process left on any node", poll_s=1) is True
    print(f"dense rehearsal: {wall:.0f} s from sbatch to the job leaving the queue")


def test_fully_async_job_trains_through_a_server_killed_mid_stream(cluster, tiny_base, tmp_path):
    """The dense job's nodes with MAX_STALENESS=2 (--max-staleness 2): the rollout node's servers generate ahead
    of training while both actor nodes push their stages at each cut. Once step 2 is logged, server 0's process
    group gets SIGKILL while the rollout is generating the next batches: its requests are retried on server 1, every
    step is trained, every trained token stays within 2 versions, and nothing is left on any node."""
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    t0 = time.monotonic()
    job, out = _submit(cluster, 3, "cpu-rehearsal", tiny_base / "model", run_dir,
                       {"NUM_STEPS": "6", "MAX_STALENESS": "2"})
    _wait(lambda: len(_records(run_dir)) >= 2 or not _queued(cluster, job), 600,
          f"step 2 logged (the job's output: {out})")
    pgid = _wait(lambda: _server_pgid(cluster, cluster.info()["nodes"][2], 30000), 30, "server 0's process")
    os.killpg(pgid, signal.SIGKILL)
    killed_after = len(_records(run_dir))
    _wait(lambda: not _queued(cluster, job), 900, f"job {job} finished")
    wall = time.monotonic() - t0
    batch = out.read_text()
    assert "== training finished" in batch, batch[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert killed_after < 6, "the run ended before the kill"
    assert sum(r["rollout/servers_lost"] for r in records) >= 1
    for r in records:
        shares = {int(k.rsplit("/", 1)[1]): v for k, v in r.items() if k.startswith("rollout/staleness/")}
        assert sum(shares.values()) == pytest.approx(1.0) and max(d for d, v in shares.items() if v > 0) <= 2, r
        assert r["sync/stage0_s"] > 0 and r["sync/stage1_s"] > 0, r  # both actor nodes pushed their stage
    assert max(r["async/staleness"] for r in records) >= 1  # generated ahead of training
    assert _wait(lambda: not cluster.leftover_pids(), 30, "no process left on any node", poll_s=1) is True
    print(f"fully async rehearsal: {wall:.0f} s from sbatch to the job leaving the queue")


OPT_IN = "the colocated job (~2.5 min) runs with REHEARSAL_ALL=1: make test stays within its budget"


@pytest.mark.skipif(os.environ.get("REHEARSAL_ALL") != "1", reason=OPT_IN)
@pytest.mark.designed_skip(OPT_IN)
def test_colocated_job_trains_with_an_engine_on_every_node(cluster, tiny_base, tmp_path):
    """examples/slurm/colocated.sbatch with examples/recipes/cpu-rehearsal-colocated.sh on 2 nodes: each node's
    engine (one real CPU SGLang server at TP 2) and its 2 actor ranks (TP 2 x DP 2 over the nodes), weights handed
    over by shared memory to the node's own engine; 3 steps at fp32-noise mismatch, nothing left after."""
    run_dir = tmp_path / "colocated"
    job, out = _submit(cluster, 2, "cpu-rehearsal-colocated", tiny_base / "model", run_dir, {"NUM_STEPS": "3"},
                       script="colocated.sbatch")
    _wait(lambda: not _queued(cluster, job), 900, f"the colocated job {job} to end")
    assert "== training finished" in out.read_text(), out.read_text()[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-3 and r["train/grad_norm"] > 0, r
    assert _wait(lambda: not cluster.leftover_pids(), 30, "no process left on any node", poll_s=1) is True


def _make_tiny_moe(base_model: Path, out: Path) -> Path:
    """A tiny all-MoE Qwen3-MoE (2 layers x 8 experts, top-2; SGLang 0.5.23 serves no mixed dense/MoE layout) with
    the base's tokenizer, random weights (routers drawn N(0, 0.2): HF's zero init would tie every route), saved with
    HF's per-expert names."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = json.loads((base_model / "config.json").read_text())
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=dense["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                            max_position_embeddings=dense["max_position_embeddings"], rope_theta=10000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=dense.get("bos_token_id"),
                            eos_token_id=dense.get("eos_token_id"), pad_token_id=dense.get("pad_token_id"))
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or ".experts." in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    for f in base_model.iterdir():  # the tokenizer and generation config
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out


def test_moe_job_syncs_every_expert_and_scancel_leaves_no_process_on_any_node(cluster, tiny_base, tmp_path):
    from safetensors import safe_open

    model = _make_tiny_moe(tiny_base / "model", tmp_path / "moe-model")
    run_dir = tmp_path / "moe"
    t0 = time.monotonic()
    job, out = _submit(cluster, 2, "cpu-rehearsal-moe", model, run_dir,
                       {"NUM_STEPS": "20", "PROMPT_DATA": str(tiny_base / "train.jsonl")})
    _wait(lambda: len(_records(run_dir)) >= 2, 600, f"two steps logged (the job's output: {out})")
    config = json.loads((run_dir / "run_config.json").read_text())
    assert config["expert_model_parallel_size"] == 2
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is not iterable)
        numel = sum(math.prod(f.get_slice(n).get_shape()) for n in names)
    for r in _records(run_dir)[:2]:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-3, r
        assert r["sync/gbytes"] * 1e9 == pytest.approx(numel * 4), r  # fp32: every tensor of the model, once
    assert cluster.leftover_pids()  # the servers, torchrun and its ranks are running on both nodes
    t_cancel = time.monotonic()
    res = cluster.run(["scancel", str(job)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    _wait(lambda: not _queued(cluster, job), 60, f"job {job} gone after scancel")
    gone = _wait(lambda: not cluster.leftover_pids(), 30, "no process left on any node after scancel", poll_s=0.5)
    stop_s = time.monotonic() - t_cancel
    assert gone is True
    rollout_log = next(_job_dir(run_dir, job).glob("rollout-*.log")).read_text()
    assert "SIGTERM: stopping this node's servers" in rollout_log and "stopped" in rollout_log
    print(f"MoE rehearsal: {t_cancel - t0:.0f} s to two steps, {stop_s:.1f} s from scancel to no process left")
