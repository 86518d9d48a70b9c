"""Start-up validation of `python -m megatron_dapo.train`: every bad input stops before the model is built.

Unit tests of the pure checks (megatron_dapo/trainer/validation.py), of the trainer's check_flags/load_inputs
on a model directory that has a config and a tokenizer but no weights (so reaching the model would
fail differently), and subprocess runs of the entry point that must exit with status 2 and one line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo import train as train_mod
from megatron_dapo.arguments import build_parser
from megatron_dapo.checkpoint.hf_export import EXPORT_MARKER
from megatron_dapo.data import prompt_set
from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.startup import check_flags
from megatron_dapo.trainer import build
from megatron_dapo.trainer.validation import (
    check_batch_arithmetic,
    check_context,
    check_vocab,
    data_parallel_size,
    share_verdict,
)
from tests.torchrun import REPO, free_port, subprocess_env

CHAR_VOCAB = 80  # len(build_char_tokenizer())


def make_model_dir(root: Path, **config) -> Path:
    """config.json + character tokenizer, no weights: building or loading the model would fail."""
    model = root / "model"
    model.mkdir(parents=True)
    build_char_tokenizer(str(model))
    base = dict(model_type="qwen2", vocab_size=CHAR_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    (model / "config.json").write_text(json.dumps(base | config))
    return model


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return make_model_dir(tmp_path)


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(8)]  # DAPO schema: no template added, a few tokens each
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load_inputs(args, *, with_data: bool):
    """trainer/build.load_inputs as train.py calls it: on the configs start-up parsed from these flags."""
    run, _ = check_flags(args)
    return build.load_inputs(run.inputs, run.arch, run.layout, with_data=with_data)


def parse(model_dir: Path, data: Path, *extra: str):
    return build_parser().parse_args(["--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--num-steps",
                                      "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                                      "--max-prompt-length", "16", "--max-response-length", "8",
                                      "--overlong-buffer-length", "4", *extra])


# ---- batch arithmetic ------------------------------------------------------------------------------
@pytest.mark.parametrize("rbs, n, gbs, dp, expected", [
    pytest.param(512, 16, 512, 8, 512, id="dapo-32b"),
    pytest.param(4, 4, 8, 2, 8, id="two-minibatches-dp2"),
    pytest.param(2, 2, 0, 1, 4, id="whole-step"),
])
def test_batch_arithmetic_accepts_even_splits(rbs, n, gbs, dp, expected):
    assert check_batch_arithmetic(rollout_batch_size=rbs, n_samples_per_prompt=n, global_batch_size=gbs,
                                  dp=dp) == expected


@pytest.mark.parametrize("rbs, n, gbs, dp, message", [
    pytest.param(2, 2, 3, 1, r"4 responses per step is not a multiple of --global-batch-size 3: the last update of "
                             r"each step would train on 1", id="gbs-3-of-4"),
    pytest.param(4, 4, 6, 3, r"16 responses per step is not a multiple of --global-batch-size 6", id="gbs-6-of-16"),
    pytest.param(4, 4, 8, 3, r"--global-batch-size 8 does not split evenly over 3 data-parallel ranks",
                 id="gbs-vs-dp"),
    pytest.param(3, 3, 0, 2, r"the step's 9 responses .* does not split evenly over 2", id="whole-step-vs-dp"),
    pytest.param(0, 4, 0, 1, r"--rollout-batch-size must be an integer >= 1", id="rbs-0"),
    pytest.param(4, 4, -8, 1, r"--global-batch-size must be an integer >= 0", id="gbs-negative"),
])
def test_batch_arithmetic_rejects_remainders(rbs, n, gbs, dp, message):
    with pytest.raises(UserError, match=message):
        check_batch_arithmetic(rollout_batch_size=rbs, n_samples_per_prompt=n, global_batch_size=gbs, dp=dp)


def test_data_parallel_size_names_the_layout_flags():
    assert data_parallel_size(128, tp=8, pp=2) == 8
    with pytest.raises(UserError, match=r"6 processes .* --tensor-model-parallel-size 4 x "
                                        r"--pipeline-model-parallel-size 1"):
        data_parallel_size(6, tp=4, pp=1)


# ---- context and vocabulary ------------------------------------------------------------------------
def test_context_check():
    check_context(max_prompt_length=2048, max_response_length=20480, context=32768, allow_exceed=False)
    check_context(max_prompt_length=120, max_response_length=8, context=128, allow_exceed=False)  # exactly fits
    with pytest.raises(UserError, match=r"--max-prompt-length 2048 \+ --max-response-length 20480 = 22528 tokens "
                                        r"exceeds the model's context of 4096 .*--allow-exceed-context"):
        check_context(max_prompt_length=2048, max_response_length=20480, context=4096, allow_exceed=False)
    check_context(max_prompt_length=2048, max_response_length=20480, context=4096, allow_exceed=True)


def test_vocab_check():
    check_vocab(tokenizer_size=151665, vocab_size=152064, tokenizer_dir="t", hf_checkpoint="m")  # Qwen2.5
    with pytest.raises(UserError, match=r"tokenizer of tok has 151665 tokens but the model of m has vocab_size "
                                        r"151000: token ids 151000..151664 .*--tokenizer.*--hf-checkpoint"):
        check_vocab(tokenizer_size=151665, vocab_size=151000, tokenizer_dir="tok", hf_checkpoint="m")


def test_share_verdict_single_process_raises_the_error_itself():
    share_verdict(None)
    err = UserError("bad")
    with pytest.raises(UserError) as info:
        share_verdict(err)
    assert info.value is err and info.value.echo


# ---- the trainer's checks on real files (no model is built) ---------------------------------------
def test_tokenizer_larger_than_the_model_vocab_fails_at_start_up(tmp_path, prompts):
    model = make_model_dir(tmp_path, vocab_size=CHAR_VOCAB - 10)
    with pytest.raises(UserError, match=rf"has {CHAR_VOCAB} tokens but the model of {model} has vocab_size "
                                        rf"{CHAR_VOCAB - 10}"):
        load_inputs(parse(model, prompts), with_data=False)


def test_prompt_plus_response_over_the_context_fails_at_start_up(tmp_path, prompts):
    model = make_model_dir(tmp_path, max_position_embeddings=20)
    with pytest.raises(UserError, match=r"--max-prompt-length 16 \+ --max-response-length 8 = 24 tokens exceeds "
                                        r"the model's context of 20"):
        load_inputs(parse(model, prompts), with_data=False)
    inputs = load_inputs(parse(model, prompts, "--allow-exceed-context"), with_data=True)
    assert len(inputs.train_prompts) == 8 and inputs.arch.max_position_embeddings == 20


@pytest.mark.parametrize("text, where", [
    # the second comma of line 2 sits in column len(' "vocab_size": 80,') + 1 = 19
    pytest.param('{"model_type": "qwen2",\n "vocab_size": 80,,}', r"line 2 column 19", id="double-comma"),
    pytest.param("", r"line 1 column 1", id="empty"),
])
def test_config_json_that_is_not_json_names_the_file(model_dir, prompts, text, where):
    (model_dir / "config.json").write_text(text)
    path = re.escape(str(model_dir / "config.json"))
    with pytest.raises(UserError, match=rf"^--hf-checkpoint {path} is not valid JSON \(.*: {where}\)"):
        check_flags(parse(model_dir, prompts))  # config.json is parsed once, at start-up (startup.model_arch)
    with pytest.raises(UserError, match=rf"^{path} is not valid JSON \(.*: {where}\)"):
        ModelArch.from_hf(model_dir)
    (model_dir / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(UserError, match=rf"^{path} is not UTF-8 text \(byte offset 0"):
        ModelArch.from_hf(model_dir)
    (model_dir / "config.json").write_text('{"model_type": "not-a-registered-family"}')  # no package name has a '-'
    with pytest.raises(UserError, match=rf"^{path}: model_type 'not-a-registered-family' is not supported"):
        ModelArch.from_hf(model_dir)


def test_global_batch_size_3_of_4_responses_fails_in_check_flags(model_dir, prompts, capsys):
    args = parse(model_dir, prompts, "--global-batch-size", "3")
    with pytest.raises(UserError, match="--global-batch-size 3"):
        check_flags(args)
    argv = ["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--num-steps", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "3"]
    with pytest.raises(SystemExit) as info:
        train_mod.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert error_lines(err) == ["error: --rollout-batch-size 2 x --n-samples-per-prompt 2 = 4 responses per step is "
                                "not a multiple of --global-batch-size 3: the last update of each step would train "
                                "on 1; pick a --global-batch-size that divides 4"], err
    assert "Traceback" not in err
    with pytest.raises(UserError):  # --debug: the exception and its traceback instead
        train_mod.main([*argv, "--debug"])


@pytest.mark.parametrize("world, flags, config, message", [
    pytest.param(3, ("--tensor-model-parallel-size", "3"), {}, r"num_attention_heads \(4\) is not divisible by "
                 r"--tensor-model-parallel-size \(3\)", id="tp3-heads"),
    pytest.param(4, ("--tensor-model-parallel-size", "4"), {}, r"num_key_value_heads \(2\) is not divisible by "
                 r"--tensor-model-parallel-size \(4\); GQA query groups .*", id="tp4-kv-heads"),
    pytest.param(3, ("--pipeline-model-parallel-size", "3"), {"num_hidden_layers": 4}, r"num_hidden_layers \(4\) is "
                 r"not divisible by --pipeline-model-parallel-size \(3\)", id="pp3-layers"),
])
def test_model_that_does_not_split_over_the_layout_fails_in_load_inputs(tmp_path, prompts, monkeypatch, world,
                                                                         flags, config, message):
    """Checked with the inputs (rank 0's verdict, shared before any model is built), not in the actor."""
    model = make_model_dir(tmp_path, **config)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse(model, prompts, *flags)
    check_flags(args)  # the flags alone are fine: world % (TP x PP) == 0
    with pytest.raises(UserError, match=rf"^the model of --hf-checkpoint {model} does not split over this layout: "
                                        rf"{message}$"):
        load_inputs(args, with_data=False)


MOE_CONFIG = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
"""A mixture-of-experts config.json (no weights) for the expert-flag checks."""


@pytest.mark.parametrize("world, flags, message", [
    pytest.param(1, ["--expert-model-parallel-size", "2"], r"--expert-model-parallel-size \(2\) x "
                 r"--expert-tensor-parallel-size \(1\) = 2 must divide the 1 ranks of a pipeline stage", id="ep2-of-1"),
    pytest.param(2, ["--expert-model-parallel-size", "4"], r"--expert-model-parallel-size \(4\) x "
                 r"--expert-tensor-parallel-size \(1\) = 4 must divide the 2 ranks of a pipeline stage", id="ep4-of-2"),
    pytest.param(2, ["--expert-tensor-parallel-size", "4"], r"--expert-model-parallel-size \(1\) x "
                 r"--expert-tensor-parallel-size \(4\) = 4 must divide the 2 ranks", id="etp4-of-2"),
    pytest.param(1, ["--expert-tensor-parallel-size", "0"],
                 r"--expert-tensor-parallel-size must be a positive integer, got 0", id="etp0"),
    pytest.param(1, ["--sequence-parallel"], r"--sequence-parallel needs --tensor-model-parallel-size > 1",
                 id="sp-tp1"),
])
def test_a_layout_that_does_not_fit_the_ranks_fails_in_check_flags(tmp_path, prompts, monkeypatch, world, flags,
                                                                     message):
    """check_flags (every rank, before init_parallel) refuses the layout: the message reached the user as the
    traceback of init_parallel's (or rank 0's load_inputs') ValueError, 11-19 frames, single process and torchrun."""
    model = make_model_dir(tmp_path, **MOE_CONFIG)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(UserError, match=f"^{message}"):
        check_flags(parse(model, prompts, *flags))


@pytest.mark.parametrize("flags, named", [
    pytest.param(["--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff", id="aux-loss"),
    pytest.param(["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor", id="capacity"),
    pytest.param(["--moe-routing-replay"], "--moe-routing-replay", id="replay"),
    pytest.param(["--moe-aux-loss-coeff", "0", "--moe-expert-capacity-factor", "2"],
                 "--moe-aux-loss-coeff / --moe-expert-capacity-factor", id="both"),
])
def test_moe_flags_on_a_dense_model_are_refused_naming_them(model_dir, prompts, flags, named):
    """Every flag of the parser's "mixture of experts" group, like the expert-parallel ones: they were ignored on a
    dense model (--moe-routing-replay was refused with its own message)."""
    plural = "s" if " / " in named else ""
    with pytest.raises(UserError, match=rf"^{re.escape(named)} apply to mixture-of-experts models; qwen2 has no "
                                        rf"experts \(drop the flag{plural}\)$"):
        check_flags(parse(model_dir, prompts, *flags))
    moe = make_model_dir(model_dir.parent / "moe", **MOE_CONFIG)
    run, _ = check_flags(parse(moe, prompts, *flags))  # an MoE model takes them
    run.actor.check_model(ModelArch.from_hf(moe))


def test_every_moe_flag_is_checked_on_a_dense_model():
    """The flags of the parser's "mixture of experts" group are the ones ActorConfig.check_model names (a new one
    must be added there, or it would be ignored on a dense model in silence)."""
    from megatron_dapo.actor.config import ActorConfig

    group = next(g for g in build_parser()._action_groups if g.title == "mixture of experts")
    flags = {a.option_strings[0] for a in group._group_actions}
    config = ActorConfig(moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=1.0, moe_routing_replay=True)
    with pytest.raises(ValueError) as info:
        config.check_model(ModelArch.from_hf(make_tiny_config()))
    assert set(re.findall(r"--[a-z-]+", str(info.value))) == flags


def make_tiny_config() -> dict:
    return dict(model_type="qwen2", vocab_size=CHAR_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize("flags, message", [
    pytest.param(["--gpu-memory-gib", "0", "--colocate"],
                 "--gpu-memory-gib must be a finite number of GiB > 0, got 0.0", id="gpu-0"),
    pytest.param(["--gpu-memory-gib", "nan"], "--gpu-memory-gib must be a finite number of GiB > 0, got nan",
                 id="gpu-nan"),
    pytest.param(["--world-size", "0"], r"--world-size must be >= 1 \(the actor GPUs to plan for\), got 0",
                 id="world-0"),
])
def test_planner_flags_are_checked_at_a_runs_start(model_dir, prompts, flags, message):
    """A colocated run sizes SGLang's share from --gpu-memory-gib: a ZeroDivisionError at 0 as the engines started."""
    with pytest.raises(UserError, match=f"^{message}$"):
        check_flags(parse(model_dir, prompts, *flags))


def test_config_dataclass_errors_become_one_line_errors(model_dir, prompts):
    with pytest.raises(UserError, match="--num-steps must be >= 1"):
        check_flags(build_parser().parse_args(["--hf-checkpoint", str(model_dir), "--prompt-data",
                                               str(prompts), "--num-steps", "0"]))


def test_flags_named_in_errors_exist(tmp_path, model_dir, prompts):
    """Every --flag in the messages these checks produce is a flag of the parser."""
    messages = []
    for call in (
        lambda: check_batch_arithmetic(rollout_batch_size=3, n_samples_per_prompt=3, global_batch_size=0, dp=2),
        lambda: check_batch_arithmetic(rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=3, dp=1),
        lambda: check_context(max_prompt_length=10, max_response_length=10, context=8, allow_exceed=False),
        lambda: check_vocab(tokenizer_size=9, vocab_size=8, tokenizer_dir="t", hf_checkpoint="m"),
        lambda: data_parallel_size(3, tp=2, pp=1),
        lambda: prompt_set.load_prompt_set(str(prompts), build_char_tokenizer(), prompt_format="raw",
                                          max_prompt_length=2, on_long_prompt="error", flag="--prompt-data"),
        lambda: prompt_set.load_prompt_set(str(prompts), build_char_tokenizer(), prompt_format="raw",
                                          max_prompt_length=2, flag="--eval-prompt-data"),
    ):
        with pytest.raises(UserError) as info:
            call()
        messages.append(str(info.value))
    out = tmp_path / "export"
    out.mkdir()
    (out / "x").write_text("x")
    from megatron_dapo.checkpoint.hf_export import check_export_target

    with pytest.raises(UserError) as info:
        check_export_target(out)
    messages.append(str(info.value))
    known = set(build_parser()._option_string_actions)
    named = {flag for m in messages for flag in re.findall(r"--[a-z][a-z0-9-]*", m)}
    assert len(named) >= 10 and named <= known, named - known


# ---- the entry point: exit status 2, one line, before any model is built ---------------------------
def run_train(argv: list[str], *, torchrun: int = 0) -> tuple[subprocess.CompletedProcess, float]:
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", "--master_addr=127.0.0.1",
                     f"--master_port={free_port()}"]
    t0 = time.perf_counter()
    out = subprocess.run([*launcher, "-m", "megatron_dapo.train", *argv], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    return out, time.perf_counter() - t0


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line_before_the_model(tmp_path, model_dir, prompts):
    """Non-UTF-8 data, then a non-empty --export-hf: each stops at start-up (the model dir has no weights)."""
    bad = tmp_path / "bad.jsonl"
    good_line = (json.dumps({"prompt": "1+1=", "label": "2"}) + "\n").encode()
    bad.write_bytes(good_line + b'{"prompt": "caf\xe9", "label": "2"}\n')
    base = ["--hf-checkpoint", str(model_dir), "--num-steps", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--max-prompt-length", "16", "--max-response-length", "8",
            "--overlong-buffer-length", "4",
            "--log-dir", str(tmp_path / "log"), "--no-wandb", "--no-progress"]
    out, seconds = run_train([*base, "--prompt-data", str(bad)])
    offset = len(good_line) + len(b'{"prompt": "caf')
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out.stderr) == [f"error: --prompt-data {bad}: row 1: line 2, byte offset {offset}: not valid "
                                       f"UTF-8 (invalid continuation byte: e9); re-encode the file as UTF-8"]
    assert "Traceback" not in out.stderr and not (tmp_path / "log").exists()
    print(f"non-UTF-8 data: exit 2 after {seconds:.1f} s")

    export = tmp_path / "precious"
    export.mkdir()
    (export / "thesis.tex").write_text("years of work")
    out, seconds = run_train([*base, "--prompt-data", str(prompts), "--export-hf", str(export)])
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out.stderr) == [
        f"error: --export-hf {export} is a non-empty directory that is not an earlier export of this trainer (it has "
        f"no {EXPORT_MARKER}); it would be replaced, so pass a new or empty directory instead"]
    assert (export / "thesis.tex").read_text() == "years of work" and "Traceback" not in out.stderr
    print(f"non-empty --export-hf: exit 2 after {seconds:.1f} s")


@pytest.mark.slow
def test_under_torchrun_rank0_verdict_is_shown_once(tmp_path, model_dir):
    """DP=2: only rank 0 reads the data; its error is printed once and both ranks stop before the model."""
    bad = tmp_path / "bad.json"
    data = b'[{"prompt": "1+1=", "label": "2"},\n {"prompt": "\xff", "label": "3"}]'
    bad.write_bytes(data)
    out, seconds = run_train(["--hf-checkpoint", str(model_dir), "--prompt-data", str(bad), "--num-steps", "1",
                              "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-prompt-length",
                              "16", "--max-response-length", "8", "--overlong-buffer-length", "4", "--no-wandb",
                              "--no-progress",
                              "--log-dir", str(tmp_path / "log")], torchrun=2)
    assert out.returncode != 0
    lines = error_lines(out.stdout + out.stderr)
    offset = data.index(b"\xff")
    assert lines == [f"error: --prompt-data {bad}: line 2, byte offset {offset}: not valid UTF-8 (invalid start "
                     f"byte: ff); re-encode the file as UTF-8"], out.stderr[-3000:]
    # torchrun's launcher prints its own ChildFailedError traceback; no rank prints one
    assert "megatron_dapo/" not in out.stdout + out.stderr and "UserError" not in out.stdout + out.stderr
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2" in out.stderr  # the root cause torchrun names
    print(f"torchrun DP=2 bad data: exit after {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("nproc, flags, config, message", [
    pytest.param(3, ["--tensor-model-parallel-size", "3"], {}, "num_attention_heads (4) is not divisible by "
                 "--tensor-model-parallel-size (3)", id="tp3"),
    pytest.param(2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
                 {"num_hidden_layers": 4}, "num_hidden_layers (4) is not divisible by --pipeline-model-parallel-size "
                 "(2) x --num-layers-per-virtual-pipeline-stage (3)", id="pp2-vpp3"),
])
def test_under_torchrun_a_layout_the_model_does_not_split_over_is_one_line(tmp_path, prompts, nproc, flags, config,
                                                                            message):
    model = make_model_dir(tmp_path, **config)
    out, seconds = run_train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-steps", "1",
                              "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-prompt-length",
                              "16", "--max-response-length", "8", "--overlong-buffer-length", "4", "--no-wandb",
                              "--no-progress", "--log-dir", str(tmp_path / "log"), *flags], torchrun=nproc)
    assert out.returncode != 0
    assert error_lines(out.stdout + out.stderr) == [
        f"error: the model of --hf-checkpoint {model} does not split over this layout: {message}"], out.stderr[-3000:]
    assert "megatron_dapo/" not in out.stdout + out.stderr  # no rank's traceback (torchrun prints its own)
    print(f"torchrun {flags}: exit after {seconds:.1f} s")


@pytest.mark.slow
def test_truncated_hf_weights_are_one_line_naming_the_file(tmp_path, prompts):
    """--hf-checkpoint's safetensors are read when the actor is built: a damaged file is one `error:` line."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = make_model_dir(tmp_path)
    config = json.loads((model / "config.json").read_text())
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)  # a download cut short
    out, _ = run_train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-steps", "1",
                        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-prompt-length", "16",
                        "--max-response-length", "8", "--overlong-buffer-length", "4", "--no-wandb", "--no-progress",
                        "--log-dir", str(tmp_path / "log")])
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out.stderr) == [f"error: --hf-checkpoint: {weights}: header describes {size} bytes, file has "
                                       f"{size - 100} (truncated/corrupt)"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


# ---- --hf-checkpoint's weights against its config.json (the actor's initial load) ----------------------------
@pytest.fixture(scope="module")
def one_rank():
    """A world of one process with megatron's parallel state, for building a real tiny actor."""
    from megatron_dapo.actor import destroy_parallel, init_parallel

    init_parallel(seed=0)
    yield
    destroy_parallel()


@pytest.mark.parametrize("model_type, config, says", [
    pytest.param("qwen2", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                 r"\(model_type 'llama'\): 12 tensor\(s\) this model has no place for \(a load would drop them\): "
                 r"model\.layers\.0\.self_attn\.k_proj\.bias, .*, \.\.\. \(9 more\): does config\.json describe these "
                 r"weights\?", id="qwen2-weights-as-llama"),
    pytest.param("qwen3_moe", {"num_experts": 4, "num_local_experts": 4},
                 r"\(model_type 'qwen3_moe'\): 4 tensor\(s\) of another shape: model\.layers\.0\.mlp\.gate\.weight "
                 r"\[8, 64\] \(config\.json implies \[4, 64\]\), .*; 48 tensor\(s\) this model has no place for "
                 r"\(a load would drop them\): model\.layers\.0\.mlp\.experts\.4\.down_proj\.weight, .*: does "
                 r"config\.json describe these weights\?",
                 id="more-experts-than-config"),
])
def test_initial_hf_load_names_what_config_json_does_not_describe(tmp_path, one_rank, model_type, config, says):
    """The trainer's --hf-checkpoint load checks every tensor as hf-to-mcore does, one line: the Qwen2 biases under a
    llama config.json were dropped and training started; the extra experts were a ValueError's traceback."""
    from megatron_dapo.actor import ActorConfig, MegatronActor
    from megatron_dapo.distributed.parallel import ParallelLayout
    from tests.unit.checkpoint_convert.test_convert import make_tiny_hf

    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=True, model_type=model_type)
    path = hf / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    actor = MegatronActor(ModelArch.from_hf(hf), ActorConfig(lr=1e-3), ParallelLayout())
    with pytest.raises(UserError, match=rf"^--hf-checkpoint: {re.escape(str(hf))} does not match its config\.json "
                                        rf"{says}$") as info:
        build.load_hf_into_actor(actor, str(hf))
    assert info.value.echo  # rank 0 prints it
