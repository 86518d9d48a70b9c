"""Issue 38 probes of what a user hands the system: weights under the wrong config.json (items 6, 12), damaged GGUF
files (item 8), expert-parallel sizes that do not fit the ranks (item 9), the planner's GPU size and world size
(item 10), a reward function that returns a string and an SGLang server whose /generate hangs (item 12), and the
mixture-of-experts flags on a dense model (item 16).

Every input is built in the case's own directory: tiny models by transformers
(tests/unit/checkpoint_convert/test_convert.py make_tiny_hf: Qwen2 with q/k/v biases, or Qwen3-MoE with 8 experts) with
the character tokenizer, or a config.json alone where the run must stop before it reads weights; GGUF files by the
`gguf` package's writer; the hanging server is tests/sglang/fake_server.py --hang-generate, started by the case and gone
after its --lifetime.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.probes.case import PY, Case, Outcome, module, one_line_error
from tests.torchrun import REPO, free_port

MOE = dict(model_type="qwen3_moe", vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
           tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
"""config.json of a small mixture-of-experts model (no weights: the expert-parallel checks come before them)."""


# ---- inputs ---------------------------------------------------------------------------------------------------------
def _prompts(w: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(8)]
    (w / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def _config_only(config: dict) -> Callable[[Path], None]:
    """w/model: config.json and the character tokenizer, no weights (the run must stop before it reads any)."""

    def setup(w: Path) -> None:
        from megatron_dapo.data.synthetic import build_char_tokenizer

        (w / "model").mkdir()
        (w / "model" / "config.json").write_text(json.dumps(config))
        build_char_tokenizer(str(w / "model"))
        _prompts(w)

    return setup


def _weights(family: str, **edits) -> Callable[[Path], None]:
    """w/model: a tiny random model of `family` (a model_type) saved by transformers, then config.json's fields
    `edits` changed."""

    def setup(w: Path) -> None:
        from megatron_dapo.data.synthetic import build_char_tokenizer
        from tests.unit.checkpoint_convert.test_convert import make_tiny_hf

        model = w / "model"
        make_tiny_hf(model, tied=True, model_type=family)
        build_char_tokenizer(str(model))
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **edits}))
        _prompts(w)

    return setup


def _train(w: Path, *extra: str) -> list[str]:
    """One step of `python -m megatron_dapo.train` on w/model (embedded engine unless `extra` says otherwise)."""
    return [*module("megatron_dapo.train"), *_train_flags(w), *extra]


def _train_flags(w: Path) -> list[str]:
    return ["--hf-checkpoint", str(w / "model"), "--prompt-data", str(w / "train.jsonl"), "--num-steps", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-dynamic-sampling",
            "--max-prompt-length", "16", "--max-response-length", "8", "--overlong-buffer-length", "4",
            "--log-dir", str(w / "log"), "--no-wandb", "--no-progress"]


def _nothing_at(name: str) -> Callable[[Outcome], str | None]:
    def check(out: Outcome) -> str | None:
        return f"{name} was written" if (out.workdir / name).exists() else None

    return check


# ---- 38.8: GGUF files -------------------------------------------------------------------------------------------
def _gguf(w: Path, architecture: str = "llama") -> Path:
    """w/model.gguf: two F32 tensors of `architecture`, no tokenizer, by the gguf package's writer."""
    import gguf
    import numpy as np

    path = w / "model.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_cut(fraction: float) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        data = _gguf(w).read_bytes()
        (w / "model.gguf").write_bytes(data[:int(len(data) * fraction)])

    return setup


def _gguf_bytes(data: bytes) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        (w / "model.gguf").write_bytes(data)

    return setup


def _gguf_to_hf(w: Path) -> list[str]:
    return [*module("checkpoint_convert"), "gguf-to-hf", "--gguf", str(w / "model.gguf"), "--save", str(w / "hf")]


def _gguf_error(pattern: str) -> Callable[[Outcome], str | None]:
    return one_line_error(r"^checkpoint_convert gguf-to-hf: error: --gguf .*/model\.gguf" + pattern, status=1,
                          also=_nothing_at("hf"))


# ---- 38.9: under torchrun ---------------------------------------------------------------------------------------
def _torchrun(w: Path, *extra: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "-m", "megatron_dapo.train", *_train_flags(w), *extra]


def _one_line_under_torchrun(pattern: str) -> Callable[[Outcome], str | None]:
    """Every rank stops, one `error:` line for the world, no rank's traceback (torchrun's launcher prints its own
    ChildFailedError report, naming rank 0's exit status 2)."""

    def check(out: Outcome) -> str | None:
        text = out.stdout + out.stderr
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        if out.returncode == 0:
            return "exit 0"
        if "megatron_dapo/" in text:
            return "a rank printed a traceback"
        if len(errors) != 1 or not re.search(pattern, errors[0]):
            return f"'error:' lines {errors[:3]}, not one matching {pattern!r}"
        return None if "exitcode  : 2" in out.stderr else "torchrun does not report a rank's exit status 2"

    return check


# ---- 38.10: the planner -----------------------------------------------------------------------------------------
def _dry_run(*extra: str) -> Callable[[Path], list[str]]:
    return lambda w: [*module("megatron_dapo.train"), "--hf-checkpoint", str(REPO / "examples/models/qwen2.5-7B"),
                      "--prompt-data", "unused.jsonl", "--num-steps", "1", "--tensor-model-parallel-size", "4",
                      "--dry-run", *extra]


GPU_GIB = r"^plan: error: --gpu-memory-gib must be a finite number of GiB > 0, got "


# ---- 38.12: a /generate that hangs ------------------------------------------------------------------------------
def _hanging_server(w: Path) -> None:
    """An SGLang stand-in whose /health and /server_info answer and whose /generate never does; it exits by itself
    after 120 s (fake_server.py --lifetime)."""
    _weights("qwen2")(w)
    port = free_port()
    subprocess.Popen([PY, "tests/sglang/fake_server.py", "--port", str(port), "--hang-generate", "--lifetime", "120",
                      "--startup-delay", "0"], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    (w / "port").write_text(str(port))


def _attached(w: Path) -> list[str]:
    url = f"http://127.0.0.1:{(w / 'port').read_text()}"
    return _train(w, "--rollout-engine", "sglang", "--sglang-server-urls", url, "--sglang-http-timeout", "2",
                  "--sglang-min-tokens-per-s", "100", "--sglang-server-wait-s", "10")


MISMATCH = (r"^error: --hf-checkpoint: .*/model does not match its config\.json \(model_type 'qwen3_moe'\): 4 "
            r"tensor\(s\) of another shape: model\.layers\.0\.mlp\.gate\.weight \[8, 64\] \(config\.json implies "
            r"\[4, 64\]\), .* this model has no place for \(a load would drop them\): "
            r"model\.layers\.0\.mlp\.experts\.4")


CASES = [
    # 38.6: every tensor of the HF checkpoint consumed by the mapping or named
    Case(name="38.6 hf-to-mcore of Qwen2 weights (q/k/v biases) under a config.json that says llama names the biases",
         setup=_weights("qwen2", model_type="llama", architectures=["LlamaForCausalLM"]),
         argv=lambda w: [*module("checkpoint_convert"), "hf-to-mcore", "--hf-path", str(w / "model"), "--save",
                         str(w / "mc")],
         check=one_line_error(r"^checkpoint_convert hf-to-mcore: error: .*/model does not match its config\.json "
                              r"\(model_type 'llama'\): 12 tensor\(s\) this model has no place for \(a load would drop "
                              r"them\): model\.layers\.0\.self_attn\.k_proj\.bias", status=1, also=_nothing_at("mc"))),
    Case(name="38.6 train.py on Qwen2 weights under a config.json that says llama names the biases, no step trained",
         setup=_weights("qwen2", model_type="llama", architectures=["LlamaForCausalLM"]), argv=_train,
         check=one_line_error(r"^error: --hf-checkpoint: .*/model does not match its config\.json \(model_type "
                              r"'llama'\): 12 tensor\(s\) this model has no place for",
                              also=_nothing_at("log/metrics.jsonl"))),
    # 38.8: gguf-to-hf on damaged files
    Case(name="38.8 gguf-to-hf on a GGUF file cut in half names it: truncated in tensor data",
         setup=_gguf_cut(0.5), argv=_gguf_to_hf,
         check=_gguf_error(r" is truncated: tensor token_embd\.weight ends at byte [\d,]+, the file has [\d,]+ bytes")),
    Case(name="38.8 gguf-to-hf on a GGUF file cut in its header names it",
         setup=_gguf_cut(0.01), argv=_gguf_to_hf,
         check=_gguf_error(r" is truncated or corrupt: .* at byte \d+ needs \d+ bytes, the file ends at byte \d+")),
    Case(name="38.8 gguf-to-hf on a file holding only the GGUF magic names it",
         setup=_gguf_bytes(b"GGUF"), argv=_gguf_to_hf,
         check=_gguf_error(r" is truncated or corrupt: the GGUF version at byte 4 needs 4 bytes, the file ends")),
    Case(name="38.8 gguf-to-hf on an empty file names it",
         setup=_gguf_bytes(b""), argv=_gguf_to_hf, check=_gguf_error(r" is empty \(0 bytes\), not a GGUF model$")),
    Case(name="38.8 gguf-to-hf on a GGUF of an architecture transformers cannot read names it and the architecture",
         setup=lambda w: _gguf(w, "foo"), argv=_gguf_to_hf,
         check=_gguf_error(r" \(general\.architecture 'foo'\): transformers cannot read it: ValueError: GGUF model "
                           r"with architecture foo is not supported yet\.$")),
    # 38.9: expert-parallel sizes that do not fit the ranks
    Case(name="38.9 --expert-model-parallel-size 2 on one process is one line",
         setup=_config_only(MOE), argv=lambda w: _train(w, "--expert-model-parallel-size", "2"),
         check=one_line_error(r"^error: --expert-model-parallel-size \(2\) x --expert-tensor-parallel-size \(1\) = 2 "
                              r"must divide the 1 ranks of a pipeline stage")),
    Case(name="38.9 --expert-tensor-parallel-size 2 on one process is one line",
         setup=_config_only(MOE), argv=lambda w: _train(w, "--expert-tensor-parallel-size", "2"),
         check=one_line_error(r"^error: --expert-model-parallel-size \(1\) x --expert-tensor-parallel-size \(2\) = 2 "
                              r"must divide the 1 ranks")),
    Case(name="38.9 --expert-model-parallel-size 4 under torchrun with 2 ranks is one line for the world",
         setup=_config_only(MOE), argv=lambda w: _torchrun(w, "--expert-model-parallel-size", "4"),
         check=_one_line_under_torchrun(r"^error: --expert-model-parallel-size \(4\) x --expert-tensor-parallel-size "
                                        r"\(1\) = 4 must divide the 2 ranks of a pipeline stage")),
    # 38.10: the planner's flags
    Case(name="38.10 --dry-run --gpu-memory-gib 0 is refused naming the flag",
         argv=_dry_run("--world-size", "8", "--gpu-memory-gib", "0"), check=one_line_error(GPU_GIB + r"0\.0$")),
    Case(name="38.10 --dry-run --gpu-memory-gib 0 --colocate is refused (was a ZeroDivisionError)",
         argv=_dry_run("--world-size", "8", "--gpu-memory-gib", "0", "--colocate", "--rollout-engine", "sglang"),
         check=one_line_error(GPU_GIB + r"0\.0$")),
    Case(name="38.10 --dry-run --gpu-memory-gib -80 is refused naming the flag",
         argv=_dry_run("--world-size", "8", "--gpu-memory-gib", "-80"), check=one_line_error(GPU_GIB + r"-80\.0$")),
    Case(name="38.10 --dry-run --gpu-memory-gib nan is refused naming the flag",
         argv=_dry_run("--world-size", "8", "--gpu-memory-gib", "nan"), check=one_line_error(GPU_GIB + r"nan$")),
    Case(name="38.10 --dry-run --gpu-memory-gib inf is refused (was 'headroom 100%')",
         argv=_dry_run("--world-size", "8", "--gpu-memory-gib", "inf"), check=one_line_error(GPU_GIB + r"inf$")),
    Case(name="38.10 --dry-run --world-size 0 names --world-size, not the data-parallel size",
         argv=_dry_run("--world-size", "0"),
         check=one_line_error(r"^plan: error: --world-size must be >= 1 \(the actor GPUs to plan for\), got 0$")),
    # 38.12: clear messages, one line each
    Case(name="38.12 train.py on an --hf-checkpoint whose config.json says 4 experts and whose weights hold 8",
         setup=_weights("qwen3_moe", num_experts=4, num_local_experts=4), argv=_train, check=one_line_error(MISMATCH)),
    Case(name="38.12 a --reward-fn that returns a string stops the run in one line naming it and the type",
         setup=_weights("qwen2"), argv=lambda w: _train(w, "--reward-fn", "os.path:join"),
         check=one_line_error(r"^error: --reward-fn 'os\.path:join' returned str \(.*\): it must return a "
                              r"RewardResult, a number, or a dict with a numeric 'score' key$")),
    Case(name="38.12 an attached SGLang server whose /generate hangs stops the run in one line naming it, the timeout "
              "and its flags", setup=_hanging_server, argv=_attached,
         check=one_line_error(r"^error: SGLang sample .* failed 4 tries, the last: http://127\.0\.0\.1:\d+ did not "
                              r"answer /generate within 2\.08 s \(--sglang-http-timeout 2 \+ 8 new tokens / "
                              r"--sglang-min-tokens-per-s 100\); raise those flags")),
    # 38.16: MoE-only flags on a dense model (with weights: they trained a step, the flag ignored)
    Case(name="38.16 --moe-aux-loss-coeff on a dense model is refused naming it",
         setup=_weights("qwen2"), argv=lambda w: _train(w, "--moe-aux-loss-coeff", "0.01"),
         check=one_line_error(r"^error: --moe-aux-loss-coeff apply to mixture-of-experts models; qwen2 has no experts "
                              r"\(drop the flag\)$")),
    Case(name="38.16 --moe-expert-capacity-factor on a dense model is refused naming it",
         setup=_weights("qwen2"), argv=lambda w: _train(w, "--moe-expert-capacity-factor", "1.0"),
         check=one_line_error(r"^error: --moe-expert-capacity-factor apply to mixture-of-experts models; qwen2 has no "
                              r"experts \(drop the flag\)$")),
]
