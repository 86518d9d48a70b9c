"""The trainer runs with the NCCL_CUMEM_ENABLE SGLang gives its servers on one node (issue 37, defect 6).

SGLang 0.5.23 sets NCCL_CUMEM_ENABLE=0 in its servers where it is unset; NCCL's default is cuMem on wherever the
driver supports it; peers of one node that disagree fail or hang in the weight-sync group (weight_sync/nccl_env.py).
Checked here: the rule against SGLang's own `_set_envs_and_config` (run in .venv-sglang), the decision for each
kind of run, that train.py applies it before anything else starts, and the environment each launcher's trainer
(and the servers it launches) then runs with: the launchers all start `python -m megatron_dapo.train`, whose
environment they record here through a stand-in torchrun (tests/unit/launch/test_examples.py), the Slurm node scripts
through the same torchrun_node (examples/lib/launch.sh).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.server import ServerConfig, ServerGroup
from megatron_dapo.startup import engine_config
from megatron_dapo.weight_sync.nccl_env import CUMEM_VAR, is_local_host, match_sglang_cumem, sglang_cumem
from tests.sglang.real_server import SGLANG_PY
from tests.unit.launch.test_examples import launcher_args

BASE = ["--hf-checkpoint", "examples/models/qwen2.5-7B", "--prompt-data", "unused.jsonl", "--num-steps", "1",
        "--rollout-engine", "sglang"]
LOCAL = {"127.0.0.1", "actor0"}  # the hosts a stand-in is_local takes for this machine


def _engine(argv: list[str]):
    """The rollout engine's config of these flags, as start-up parses them (startup.engine_config)."""
    return engine_config(build_parser().parse_args(argv), None, api_key=None)


def _match(flags: list[str], environ: dict[str, str], *, cuda: bool = True) -> str | None:
    return match_sglang_cumem(_engine(BASE + flags), environ, cuda=cuda, is_local=lambda host: host in LOCAL)


@pytest.mark.parametrize("flags,cuda,want", [
    (["--sglang-gpus", "4,5,6,7"], True, "0"),  # the single-node launchers: servers launched on rank 0's node
    (["--sglang-gpus", "4,5,6,7", "--sglang-extra-args=--enable-symm-mem"], True, "1"),  # SGLang forces 1
    (["--sglang-server-urls", "http://127.0.0.1:30000"], True, "0"),  # attached, on this node
    (["--sglang-server-urls", "http://r0:30000", "http://actor0:30001"], True, "0"),  # one of them on this node
    (["--sglang-server-urls", "http://r0:30000", "http://r1:30000"], True, None),  # Slurm split: other nodes
    (["--colocate"], True, None),  # CUDA IPC handles, no NCCL group with the engines
    (["--sglang-gpus", "4,5,6,7", "--weight-sync-mode", "disk"], True, None),
    (["--sglang-server-urls", "http://127.0.0.1:30000"], False, None),  # CPU: gloo, no NCCL
], ids=["launched", "launched-symm-mem", "attached-local", "attached-one-local", "attached-remote", "colocate",
        "disk", "cpu"])
def test_the_trainer_takes_sglangs_value_where_it_shares_a_node_group(flags, cuda, want):
    env = {"PATH": "/bin"}
    line = _match(flags, env, cuda=cuda)
    assert env.get(CUMEM_VAR) == want
    assert (line is None) == (want is None)
    if want is not None:
        assert f"{CUMEM_VAR}={want} for the trainer" in line


def test_embedded_rollouts_leave_nccl_alone():
    env: dict[str, str] = {}
    assert match_sglang_cumem(_engine(BASE[:6] + ["--rollout-engine", "embedded"]), env,
                              cuda=True) is None and env == {}


def test_a_value_in_the_environment_is_kept_and_said_unless_sglang_overrides_it():
    env = {CUMEM_VAR: "1"}  # e.g. GB200 stacks that need cuMem: SGLang keeps it in servers that inherit it
    line = _match(["--sglang-gpus", "4,5,6,7"], env)
    assert env[CUMEM_VAR] == "1" and "NCCL_CUMEM_ENABLE=1 from the environment, kept" in line
    with pytest.raises(UserError, match=r"NCCL_CUMEM_ENABLE=0 in the environment, but SGLang 0.5.23 runs servers "
                                        r"started with --enable-symm-mem .* with NCCL_CUMEM_ENABLE=1"):
        _match(["--sglang-gpus", "4,5,6,7", "--sglang-extra-args=--enable-symm-mem"], {CUMEM_VAR: "0"})


def test_local_hosts_are_the_ones_a_socket_can_bind_here():
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host(socket.gethostname())
    assert not is_local_host("192.0.2.1")  # TEST-NET-1 (RFC 5737): no machine's address
    assert not is_local_host("no-such-host.invalid")


SGLANG_PROBE = """
import json, os, sys
from sglang.srt.entrypoints.engine import _set_envs_and_config
from sglang.srt.server_args import prepare_server_args
base = dict(os.environ)
for given, flags in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update(base)
    if given is not None:
        os.environ["NCCL_CUMEM_ENABLE"] = given
    _set_envs_and_config(prepare_server_args(["--model-path", "/m", "--device", "cpu", *flags]))
    print(json.dumps(os.environ.get("NCCL_CUMEM_ENABLE")))
"""


@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`")
def test_sglang_cumem_is_what_sglang_0_5_23_sets():
    """SGLang's own `_set_envs_and_config` (what every server runs before its schedulers start) against
    sglang_cumem, for the states a server can be in: unset, or set explicitly (what servers the trainer launches
    inherit from it), with and without the flags that make SGLang choose 1. (Unset with --enable-kv-cache-sharding
    SGLang picks 1: servers the trainer launches never find it unset.)"""
    cases = [(given, flags) for given in (None, "0", "1")
             for flags in ([], ["--enable-symm-mem"], ["--enable-kv-cache-sharding"])
             if not (given is None and flags == ["--enable-kv-cache-sharding"])]
    env = {k: v for k, v in os.environ.items() if k != CUMEM_VAR} | {"SGLANG_USE_CPU_ENGINE": "1"}
    out = subprocess.run([str(SGLANG_PY), "-c", SGLANG_PROBE, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in out.stdout.splitlines()]
    assert got == [sglang_cumem(given, flags) for given, flags in cases], list(zip(cases, got, strict=True))


def test_train_sets_it_before_anything_starts(monkeypatch):
    """train.py decides right after the flags are checked: before rank 0 prepares anything (prepare_rank0 runs
    before any process group, engine or server exists)."""
    from megatron_dapo import train as train_mod

    seen = {}

    class Reached(Exception):
        pass

    def prepare_rank0(run):
        seen["env"] = os.environ.get(CUMEM_VAR)
        raise Reached

    monkeypatch.setenv(CUMEM_VAR, "x")
    monkeypatch.delenv(CUMEM_VAR)  # restored (unset) after the test, whatever train() sets
    monkeypatch.setattr(train_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train_mod.build, "prepare_rank0", prepare_rank0)
    args = build_parser().parse_args(BASE + ["--sglang-gpus", "4,5,6,7"])
    with pytest.raises(Reached):
        train_mod.train(args)
    assert seen["env"] == "0"


# ---- the environment each launcher's trainer runs with ----------------------------------------------------------

REMOTE = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"}
ON_NODE = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://127.0.0.1:30000"}


@pytest.mark.parametrize("script,env,want", [
    ("examples/run_qwen2.5_7b_single_node.sh", {}, "0"),
    ("examples/run_qwen3_8b_single_node.sh", {}, "0"),
    ("examples/run_qwen2.5_32b_multinode.sh", REMOTE, None),
    ("examples/run_qwen3_30b_a3b_multinode.sh", REMOTE, None),
    ("examples/run_qwen3_30b_a3b_multinode.sh", ON_NODE, "0"),
    ("examples/run_qwen2.5_32b_colocated.sh", dict(REMOTE, LAUNCH_ENGINES="0"), None),
], ids=["7b-single-node", "qwen3-8b-single-node", "32b-multinode", "30b-a3b-multinode", "30b-a3b-servers-on-node",
        "32b-colocated"])
def test_each_launchers_trainer_runs_with_its_servers_value(tmp_path, monkeypatch, script, env, want):
    """The trainer's environment (the launcher's torchrun's, then what train.py sets on CUDA); where the trainer
    launches its servers, theirs too (ServerGroup: they inherit it, and SGLang keeps a value it finds set)."""
    monkeypatch.delenv(CUMEM_VAR, raising=False)
    _, train_args = launcher_args(tmp_path, script, env)
    trainer_env = json.loads((tmp_path / "argv.json.env").read_text())
    assert CUMEM_VAR not in trainer_env  # no launcher sets it: train.py decides, for every launcher alike
    args = build_parser().parse_args(train_args)
    match_sglang_cumem(engine_config(args, None, api_key=None), trainer_env, cuda=True)
    assert trainer_env.get(CUMEM_VAR) == want
    if not args.sglang_server_urls and not args.colocate:  # servers launched by rank 0 (rollout/build.py)
        group = ServerGroup(ServerConfig(model_path=args.hf_checkpoint, num_servers=args.sglang_num_servers,
                                         tp_per_server=args.sglang_tp_size, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
                                         log_dir=str(tmp_path / "logs")))
        assert group.servers[0].environment(trainer_env)[CUMEM_VAR] == want == sglang_cumem(want, [])

