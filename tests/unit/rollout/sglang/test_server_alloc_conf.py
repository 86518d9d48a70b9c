"""Engines with --enable-memory-saver start without expandable segments (issue 24, defect 1).

torch_memory_saver refuses `expandable_segments:True` at its first region ("expandable_segments is not supported
yet"), and the trainer's launchers export it for the actor: the servers' environment, built by the colocated
launcher (examples/launch_sglang_servers.sh) and by ServerGroup (servers train.py launches), must drop it and keep
every other allocator option. The bash launchers run with a stand-in `python` / `torchrun` on PATH that record
the command and environment each process would have started with.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.server import ServerConfig, ServerGroup, server_env, without_expandable_segments
from tests.torchrun import REPO

RECORDER = """#!/usr/bin/env python3
import json, os, sys
out = os.path.join({out!r}, f"{{os.path.basename(sys.argv[0])}}.{{os.getpid()}}.json")
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open(out + ".tmp", "w"))
os.rename(out + ".tmp", out)
"""


def _run_launcher(tmp_path: Path, script: str, args: list[str], env: dict[str, str], servers: int) -> dict:
    """Runs `script` with a recording `torchrun` and SGLang interpreter (SGLANG_PY: the servers the rollout-node
    supervisor starts); {'python': [records], 'torchrun': [records]}."""
    bin_dir, out = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    out.mkdir()
    for name in ("python", "torchrun"):
        stub = bin_dir / name
        stub.write_text(RECORDER.format(out=str(out)))
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    run_env |= {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SGLANG_PY": str(bin_dir / "python"),
                "SGLANG_DEVICE": "cpu", **env}
    subprocess.run(["bash", script, *args], cwd=REPO, env=run_env, check=True, capture_output=True, timeout=60)
    deadline = time.monotonic() + 60  # the servers are started in the background
    while len(list(out.glob("python.*.json"))) < servers and time.monotonic() < deadline:
        time.sleep(0.1)
    records: dict[str, list] = {"python": [], "torchrun": []}
    for f in sorted(out.glob("*.json")):
        records[f.name.split(".")[0]].append(json.loads(f.read_text()))
    assert len(records["python"]) == servers
    return records


COLOCATED_ENV = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://n0:30000 http://n0:30001",
                 "SGLANG_API_KEY": "test-key-0123456789"}


@pytest.mark.parametrize("given,engines", [
    pytest.param({}, None, id="launcher-default"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
                  "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8, expandable_segments:True"},
                 {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512",
                  "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"}, id="other-options-kept"),
])
def test_colocated_launcher_starts_engines_without_expandable_segments(tmp_path, given, engines):
    records = _run_launcher(tmp_path, "examples/run_qwen2.5_32b_colocated.sh", ["/models/fake", str(tmp_path / "run")],
                            COLOCATED_ENV | given, servers=2)
    (trainer,) = records["torchrun"]
    assert trainer["env"]["PYTORCH_CUDA_ALLOC_CONF"] == given.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                  "expandable_segments:True")
    for engine in records["python"]:
        assert engine["argv"][:2] == ["-m", "sglang.launch_server"] and "--enable-memory-saver" in engine["argv"]
        seen = {k: engine["env"].get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        assert seen == (engines or {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": None})


def test_server_launcher_without_memory_saver_keeps_the_allocator_options(tmp_path):
    records = _run_launcher(tmp_path, "examples/launch_sglang_servers.sh", ["/models/fake", "1", "1", "30000"],
                            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "SGLANG_RUN_DIR": str(tmp_path)},
                            servers=1)
    assert records["python"][0]["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_without_expandable_segments_keeps_the_other_options_in_order():
    assert without_expandable_segments("expandable_segments:True") == ""
    assert without_expandable_segments("max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:4") \
        == "max_split_size_mb:128,roundup_power2_divisions:4"
    assert without_expandable_segments("expandable_segments:False") == "expandable_segments:False"


def test_launched_servers_environment_follows_memory_saver(tmp_path):
    parent = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
              "PYTORCH_ALLOC_CONF": "expandable_segments:True", "RANK": "3", "HOME": "/home/u"}
    saver = ServerConfig(model_path="/m", num_servers=2, extra_args=("--mem-fraction-static", "0.7",
                                                                      "--enable-memory-saver"),
                         log_dir=str(tmp_path), env={"CUDA_VISIBLE_DEVICES": "4,5"})
    plain = ServerConfig(model_path="/m", log_dir=str(tmp_path))
    assert saver.memory_saver and not plain.memory_saver
    for server in ServerGroup(saver).servers:
        env = server.environment(parent)
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_ALLOC_CONF" not in env
        assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["HOME"] == "/home/u" and "RANK" not in env
    (server,) = ServerGroup(plain).servers
    assert server.environment(parent)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:512"
    assert server_env(parent, {}) == {k: v for k, v in parent.items() if k != "RANK"}


def test_colocated_training_launches_servers_with_memory_saver():
    """train.py --colocate adds --enable-memory-saver to the launched servers' flags: ServerConfig sees it."""
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.rollout.build import memory_server_args
    from megatron_dapo.startup import engine_config

    args = build_parser().parse_args(["--hf-checkpoint", "/m", "--prompt-data", "d", "--num-steps", "1",
                                      "--mem-fraction-static", "0.6", "--colocate"])
    extra = memory_server_args(engine_config(args, None, api_key=None), cuda=True)
    assert ServerConfig(model_path="/m", extra_args=extra).memory_saver
