"""The launchers in examples/ stay true to the trainer's flags.

Each GPU launcher runs with a stand-in `torchrun` on PATH (the CPU one with a stand-in $PY) that records its
arguments; the part after `-m megatron_dapo.train` must parse with the real parser and build valid configs.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.startup import build_configs
from tests.torchrun import REPO

GPU_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES")
FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
json.dump(sys.argv[1:], open({out!r}, "w"))
json.dump(dict(os.environ), open({out!r} + ".env", "w"))
"""


def launcher_args(tmp_path: Path, script: str, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """(torchrun's own args, the trainer's args) of one launcher run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "argv.json"
    fake = bin_dir / "torchrun"
    fake.write_text(FAKE_TORCHRUN.format(out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    subprocess.run(["bash", script, "/models/fake", str(tmp_path / "run")], cwd=REPO, env=run_env, check=True,
                   capture_output=True, timeout=60)
    argv = json.loads(out.read_text())
    split = argv.index("megatron_dapo.train")
    return argv[: split - 1], argv[split + 1:]


CONTEXT_BOUND = {"examples/run_moonlight_16b_a3b_multinode.sh": (6144, 1024)}
"""Launchers whose responses (and AIME evaluation) stop short of DAPO's 20480 (overlong buffer 4096): the model's
context minus the 2048 prompt tokens, and the buffer scaled with it."""
MOE_LAYOUTS = {  # (TP, SP, PP, first / last stage layers, EP, ETP), actor nodes
    "examples/run_qwen3_30b_a3b_multinode.sh": ((1, False, 1, None, None, 8, 1), "4"),  # experts over a node's 8 GPUs
    "examples/run_moonlight_16b_a3b_multinode.sh": ((1, False, 1, None, None, 8, 1), "2"),
    "examples/run_deepseek_v3_671b_multinode.sh": ((8, True, 12, 7, 4, 16, 1), "24"),  # 61 layers: 7 + 10 x 5 + 4
}


@pytest.mark.parametrize(
    "script,env,nproc",
    [
        ("examples/run_qwen3_8b_single_node.sh", {}, "4"),
        ("examples/run_llama3.1_8b_single_node.sh", {}, "4"),
        ("examples/run_qwen3_32b_multinode.sh",
         {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"},
         "8"),
        ("examples/run_qwen2.5_7b_single_node.sh", {}, "4"),
        ("examples/run_qwen2.5_32b_multinode.sh",
         {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"},
         "8"),
        ("examples/run_qwen3_30b_a3b_multinode.sh",
         {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"},
         "8"),
        ("examples/run_moonlight_16b_a3b_multinode.sh",
         {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"},
         "8"),
        ("examples/run_deepseek_v3_671b_multinode.sh",
         {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000 http://r1:30000"},
         "8"),
    ],
    ids=["qwen3-8b-single-node", "llama3.1-8b-single-node", "qwen3-32b-multinode", "7b-single-node", "32b-multinode",
         "qwen3-30b-a3b-multinode", "moonlight-16b-a3b-multinode", "deepseek-v3-671b-multinode"],
)
def test_gpu_launchers_parse_and_validate(tmp_path, script, env, nproc):
    torchrun_args, train_args = launcher_args(tmp_path, script, env)
    assert torchrun_args[torchrun_args.index("--nproc_per_node") + 1] == nproc
    args = build_parser().parse_args(train_args)
    assert args.hf_checkpoint == "/models/fake"
    assert (args.clip_ratio_low, args.clip_ratio_high, args.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert args.dynamic_sampling and args.reward_fn == "math_dapo"
    actor_cfg, _, trainer_cfg = build_configs(args)  # every config dataclass accepts the launcher's values
    # DAPO Sec. 4.1: warm-up over 20 rollout steps; AIME avg@32 at temperature 1.0, top-p 0.7, 20480 tokens
    assert (actor_cfg.lr_warmup_steps, actor_cfg.lr_decay_style) == (20, "constant")
    eval_sampling = trainer_cfg.eval_sampling
    max_response, overlong_buffer = CONTEXT_BOUND.get(script, (20480, 4096))
    assert (eval_sampling.temperature, eval_sampling.top_p, eval_sampling.max_new_tokens) == (1.0, 0.7, max_response)
    assert trainer_cfg.eval_n_samples == 32
    if "32b" in script:
        # DAPO's published setting
        assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (512, 16, 512)
        assert (args.max_response_length, args.overlong_buffer_length, args.lr) == (20480, 4096, 1e-6)
        assert args.sglang_server_urls == ["http://r0:30000", "http://r1:30000"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (8, 2)
    if script in MOE_LAYOUTS:  # DAPO's setting on the MoE models, at the layout their recipe's plan gives
        assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (512, 16, 512)
        assert args.lr == 1e-6 and args.max_prompt_length == 2048
        assert (args.max_response_length, args.overlong_buffer_length) == (max_response, overlong_buffer)
        layout, nodes = MOE_LAYOUTS[script]
        assert (args.tensor_model_parallel_size, args.sequence_parallel, args.pipeline_model_parallel_size,
                args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                args.expert_model_parallel_size, args.expert_tensor_parallel_size) == layout
        assert torchrun_args[torchrun_args.index("--nnodes") + 1] == nodes


@pytest.mark.parametrize("script,env", [
    ("examples/run_qwen3_8b_single_node.sh", {}),
    ("examples/run_llama3.1_8b_single_node.sh", {}),
    ("examples/run_qwen3_32b_multinode.sh",
     {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"}),
    ("examples/run_qwen2.5_7b_single_node.sh", {}),
    ("examples/run_qwen2.5_32b_multinode.sh",
     {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"}),
    ("examples/run_qwen3_30b_a3b_multinode.sh",
     {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"}),
    ("examples/run_moonlight_16b_a3b_multinode.sh",
     {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"}),
    ("examples/run_deepseek_v3_671b_multinode.sh",
     {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "SGLANG_URLS": "http://r0:30000"}),
], ids=["qwen3-8b-single-node", "llama3.1-8b-single-node", "qwen3-32b-multinode", "7b-single-node",
        "32b-multinode", "qwen3-30b-a3b-multinode", "moonlight-16b-a3b-multinode", "deepseek-v3-671b-multinode"])
def test_gpu_launchers_set_the_cuda_environment(tmp_path, monkeypatch, script, env):
    """Expandable segments and one CUDA connection (Megatron-LM's settings for sequence-parallel overlap)
    reach the trainer, and the servers' placement passes the CUDA-only checks of make_rollout_engine."""
    from megatron_dapo.rollout.sglang.setup import launched_server_gpus, physical_gpu
    from megatron_dapo.weight_sync.transports import weight_sync_mode

    for key in GPU_ENV:
        monkeypatch.delenv(key, raising=False)
    _, train_args = launcher_args(tmp_path, script, env)
    seen = json.loads((tmp_path / "argv.json.env").read_text())
    assert seen.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    assert seen.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    args = build_parser().parse_args(train_args)
    attach = bool(args.sglang_server_urls)
    if not attach:
        launched_server_gpus(cuda=True, sglang_gpus=args.sglang_gpus, colocate=args.colocate)
    rank0_gpu = physical_gpu(0, seen.get("CUDA_VISIBLE_DEVICES"))
    mode = weight_sync_mode(requested=args.weight_sync_mode, attach=attach, cuda=True,
                            colocate=args.colocate, trainer_gpu=rank0_gpu,
                            server_gpus=None if attach else args.sglang_gpus)
    assert mode == "distributed"  # the servers run on GPUs of their own in both launchers


FAKE_PY = """#!/usr/bin/env python3
import json, sys
with open({out!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def test_smollm2_cpu_launcher_parses_and_validates(tmp_path):
    """examples/run_smollm2_cpu.sh with a stand-in $PY that records each call: the converter runs only when the
    base directory has no config.json, and the trainer's args parse and build valid configs."""
    out = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY.format(out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    subprocess.run(["bash", "examples/run_smollm2_cpu.sh", str(tmp_path / "run"), str(tmp_path / "base")], cwd=REPO,
                   env=dict(os.environ, PY=str(fake)), check=True, capture_output=True, timeout=60)
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert calls[0][:3] == ["-m", "checkpoint_convert", "gguf-to-hf"]
    train_args = next(c for c in calls if c[:2] == ["-m", "megatron_dapo.train"])[2:]
    args = build_parser().parse_args(train_args)
    assert (args.hf_checkpoint, args.reward_fn, args.rollout_engine) == (str(tmp_path / "base"), "last_number",
                                                                        "embedded")
    assert args.dynamic_sampling and (args.clip_ratio_low, args.clip_ratio_high) == (0.2, 0.28)
    _, _, trainer_cfg = build_configs(args)
    assert (trainer_cfg.eval_sampling.greedy, trainer_cfg.eval_n_samples, trainer_cfg.num_steps) == (True, 1, 12)
    assert any(c[0] == "tools/eval.py" for c in calls)


def test_tool_demo_launcher_runs_both_arms_with_flags_that_validate(tmp_path):
    """examples/run_tool_demo.sh with a stand-in $PY that records each call: it builds the tool task's base when the
    base directory has none, trains twice from it, the first arm with --tool-template code_fence (its ToolUseConfig
    validates) and the second without, then draws both."""
    from megatron_dapo.startup import tool_use_config

    out = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY.format(out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    subprocess.run(["bash", "examples/run_tool_demo.sh", str(tmp_path / "out"), str(tmp_path / "base")], cwd=REPO,
                   env=dict(os.environ, PY=str(fake)), check=True, capture_output=True, timeout=60)
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert calls[0][:3] == ["tools/make_tiny_base.py", "--task", "tool"]
    arms = [build_parser().parse_args(c[2:]) for c in calls if c[:2] == ["-m", "megatron_dapo.train"]]
    assert [a.tool_template for a in arms] == ["code_fence", None]
    tools = tool_use_config(arms[0])
    assert (tools.template, tools.turns.max_turns, tools.turns.schedule) == ("code_fence", 2, "continuous")
    assert tool_use_config(arms[1]) is None
    for a in arms:
        build_configs(a)
        assert (a.num_steps, a.seed, a.hf_checkpoint) == (20, 1234, str(tmp_path / "base" / "model"))
    assert calls[-1][0] == "tools/plot_tool_demo.py"
