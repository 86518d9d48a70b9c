"""The trainer at PP2 with a real SGLang 0.5.23 server (CPU) and distributed weight sync: every update goes out
from both pipeline stages' source ranks (weight_sync/stage_sync.py), each over its own gloo group with the server.

The rollout-vs-actor log-prob mismatch staying at fp32 noise on steps 2 and 3 shows the server serves exactly the
actor's updated weights, both stages' halves of them (a stale or half-updated server differs by the size of an
update). Needs .venv-sglang (`make sglang-env`); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_dapo.rollout.sglang.server import ServerGroup
from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD
from tests.sglang.real_server import cpu_server_config
from tests.torchrun import free_port
from tests.unit.weight_sync.test_stage_sync import free_ports

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
sys.path.insert(0, str(REPO / "tools"))
import slurm_cluster  # noqa: E402

REHEARSAL_RUNS = (SGLANG_PY.exists() and slurm_cluster.check() is None
                  and os.environ.get("SKIP_REHEARSAL", "") in ("", "0"))
"""tests/slurm/test_slurm_rehearsal.py runs here and covers this test and more: PP2 per-stage sync from two actor nodes
to two real servers on a third, the mismatch of every step below 1e-3. Where it cannot run (no root, no namespaces,
no Slurm packages, SKIP_REHEARSAL=1), this test does; ~75 s of make test saved where it can."""
COVERED = "covered by tests/slurm/test_slurm_rehearsal.py, which runs here"
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`"),
    pytest.mark.skipif(REHEARSAL_RUNS, reason=COVERED),
    pytest.mark.designed_skip(COVERED),
]


def test_pp2_training_steps_sync_each_stage_to_a_real_server(tiny_base, tmp_path):
    sync_port, server_port = free_ports(2)
    # Attach mode (the 32B launcher's): the server starts here, outside torchrun. A server launched by a torchrun
    # rank inherits TORCHELASTIC_USE_AGENT_STORE / MASTER_PORT / RANK and hangs in its own distributed init.
    servers = ServerGroup(cpu_server_config(tiny_base, base_port=server_port, log_dir=str(tmp_path / "sglang")))
    servers.start()
    try:
        _train(tiny_base, tmp_path, sync_port, [s.url for s in servers.servers])
    finally:
        servers.stop()


def _train(tiny_base, tmp_path, sync_port: int, urls: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "megatron_dapo.train",
           "--hf-checkpoint", str(tiny_base / "model"), "--pipeline-model-parallel-size", "2",
           "--prompt-data", str(tiny_base / "train.jsonl"), "--num-steps", "3", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "12",
           "--overlong-buffer-length", "10", "--lr", "1e-3", "--log-dir", str(tmp_path / "log"), "--no-wandb",
           "--no-progress", "--seed", "7", "--rollout-engine", "sglang",
           "--sglang-server-urls", *urls, "--weight-sync-mode", "distributed",
           "--weight-sync-master-port", str(sync_port),
           "--max-prompt-length", "16"]
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r
        assert r["sync/stage0_s"] > 0 and r["sync/stage1_s"] > 0, r  # both stages sent their own weights
        assert r["train/grad_norm"] > 0
    assert records[1]["train/pg_loss"] != records[0]["train/pg_loss"]
