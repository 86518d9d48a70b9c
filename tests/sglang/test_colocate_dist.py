"""Colocated mode end to end on CPU, 2 ranks (torchrun, gloo) against a real SGLang 0.5.23 CPU server at TP 2:
the same two DAPO updates of a TP 2 actor, pushed in separate-server mode (rank 0's SGLangEngine, tensor mode)
and in colocated mode (PhaseSwitcher + ColocatedPusher: the server releases and resumes its memory around each
training phase, each rank hands its own shared-memory bucket to the server TP rank of its index), give the same
greedy generations (tokens equal, log-probs within 1e-5) and bit-identical actor weights (offload/onload exact
under TP 2).

SGLang 0.5.23's CPU backend accepts /release_memory_occupation and /resume_memory_occupation (tags weights,
kv_cache, cuda_graph) and answers 200, but frees nothing (no torch_memory_saver on CPU): generation after a
resume sees the old weights until the push. So this exercises the protocol and its order, not the memory; the
GPU part is tools/gpu_smoke.py's colocated phase switch. Needs .venv-sglang; skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.sglang.server import ServerGroup
from tests.dist.actor_common import make_samples, tiny_hf_model
from tests.ports import free_port_block
from tests.sglang.real_server import MARKS, cpu_server_config, sglang_train_cmd
from tests.torchrun import REPO, free_port, subprocess_env

pytestmark = [*MARKS, pytest.mark.slow]


def _colocated(run: Path) -> tuple[str, ...]:
    """What the colocated runs add to sglang_train_cmd: --colocate, a checkpoint in run/ckpt every 2 steps."""
    return ("--colocate", "--save", str(run / "ckpt"), "--save-interval", "2")


def test_colocated_run_equals_separate_server_run(tmp_path):
    hf = tiny_hf_model(seed=3)
    hf.save_pretrained(tmp_path / "model")
    arch = ModelArch.from_hf(hf.config)
    torch.save({"arch": dataclasses.asdict(arch), "hf_state_dict": hf.state_dict(),
                "steps": [make_samples(6, seed=20 + k) for k in range(2)],
                "prompts": [[5, 6, 7 + i] for i in range(3)]}, tmp_path / "in.pt")
    cfg = cpu_server_config(tmp_path, tp_per_server=2,
                            env={"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    group = ServerGroup(cfg)
    group.start()
    try:
        # Output to a file, not a pipe: torch_shm_manager (the CPU shared-memory strategy's daemon) inherits the
        # ranks' stdout and lives as long as the server maps its buckets, so a pipe would not close before
        # the server stops (tests/torchrun.run_torchrun would wait for ever).
        log = tmp_path / "torchrun.log"
        with open(log, "w") as out:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                   "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                                   str(REPO / "tests/dist/colocated_run.py"), str(tmp_path / "in.pt"), str(tmp_path),
                                   cfg.server_url(0)], env=subprocess_env(), cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=600)
        assert proc.returncode == 0, log.read_text()[-8000:]
    finally:
        group.stop()
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["weights_equal"]
    assert len(result["separate"]) == len(result["colocated"]) == 2
    for step, (separate, colocated) in enumerate(zip(result["separate"], result["colocated"], strict=True), start=1):
        assert len(separate) == len(colocated) == 3
        for (tokens_a, logps_a, version_a), (tokens_b, logps_b, version_b) in zip(separate, colocated, strict=True):
            assert tokens_a == tokens_b and version_a == version_b == step
            torch.testing.assert_close(torch.tensor(logps_b), torch.tensor(logps_a), atol=1e-5, rtol=0)
    # the two steps' generations differ: the updates reached the server (a stale server would repeat itself)
    assert [s[1] for s in result["colocated"][0]] != [s[1] for s in result["colocated"][1]]
    for m in result["switch"]:
        assert m["offloaded_bytes"] > 0 and m["colocate/actor_offloaded_gib"] > 0
        print(f"phase switch: to training {m['colocate/to_training_s']:.3f} s (onload {m['colocate/onload_s']:.4f} "
              f"s), to generation {m['colocate/to_generation_s']:.3f} s (offload {m['colocate/offload_s']:.4f} s) "
              f"+ push {m['sync/seconds']:.3f} s; offloaded {m['offloaded_bytes']} B; RSS {m['rss_gib_training']:.3f}"
              f" GiB training, {m['rss_gib_generation']:.3f} GiB generation")


def test_train_colocate_follows_the_actor(tiny_base, tmp_path):
    """`python -m megatron_dapo.train --colocate` with a launched CPU server: every step switches phases (the
    metrics say how long) and the server serves the pushed weights (rollout-vs-actor log-prob mismatch at fp32
    noise on steps 2 and 3; a stale server would differ by an update)."""
    import json

    from tests.conftest import train_env
    from tests.rewards import PARITY_REWARD

    cmd = sglang_train_cmd(tiny_base, tmp_path / "log", PARITY_REWARD, free_port_block(2), *_colocated(tmp_path))
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # a resume: the checkpoint (saved in the training phase, before the push) is pushed to a fresh server with the
    # actor offloaded, and step 4's rollouts come from the resumed weights
    cmd[cmd.index("--num-steps") + 1] = "4"
    cmd[cmd.index("--sglang-base-port") + 1] = str(free_port_block(2))
    cmd[cmd.index("--log-dir") + 1] = str(tmp_path / "log2")
    out = subprocess.run(cmd + ["--load", str(tmp_path / "ckpt")], cwd=REPO, env=train_env(), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    # the new log directory gets step 3's record from the checkpoint it resumed (SavedRecord), then step 4's
    recovered, resumed = [json.loads(line) for line in (tmp_path / "log2" / "metrics.jsonl").read_text().splitlines()]
    assert recovered["step"] == 3 and recovered["train/pg_loss"] == records[2]["train/pg_loss"], recovered
    assert resumed["step"] == 4 and resumed["mismatch/logprob_abs_diff_mean"] < 1e-4, resumed
    for r in records:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r
        assert r["colocate/to_training_s"] > 0 and r["colocate/to_generation_s"] > 0
        assert r["colocate/actor_offloaded_gib"] > 0 and r["sync/gbytes"] > 0
    assert records[1]["train/pg_loss"] != records[0]["train/pg_loss"]


def test_sigterm_in_a_colocated_rollout_releases_the_engine_and_saves_in_the_training_phase(tiny_base, tmp_path):
    """SIGTERM inside step 2's rollout (the generation phase, the SGLang server holding its memory): the rollout is
    abandoned, its requests aborted, the server released and the actor onloaded (a save runs in the training
    phase), step 1 saved; the run exits 143 and a resume from step 1 runs steps 2-3 on the pushed weights."""
    import json

    from tests.conftest import train_env
    from tests.rewards import SIGNALLED_REWARD

    cmd = sglang_train_cmd(tiny_base, tmp_path / "log", SIGNALLED_REWARD, free_port_block(2), *_colocated(tmp_path))
    out = subprocess.run(cmd, cwd=REPO, env=train_env() | {"DAPO_TEST_SIGNAL": "SIGTERM:18"}, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 143, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[megatron-dapo] SIGTERM: abandoned the rollout of step 2" in out.stdout, out.stdout[-3000:]
    assert f"[megatron-dapo] SIGTERM: saved step 1 to {tmp_path / 'ckpt'}" in out.stdout, out.stdout[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_0000001"]
    cmd[cmd.index("--sglang-base-port") + 1] = str(free_port_block(2))
    out = subprocess.run(cmd + ["--load", str(tmp_path / "ckpt")], cwd=REPO, env=train_env(), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the server serves the actor's weights: the resumed push went through
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r
