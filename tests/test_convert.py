"""checkpoint_convert on tiny random HF Qwen2 models: bit-exact round trips, validation, atomic output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from checkpoint_convert.cli import main
from megatron_dapo.weights import hf_format

TINY = dict(
    vocab_size=200,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=1e6,
)


def make_tiny_hf(path: Path, *, tied: bool, seed: int = 0, **save_kwargs) -> transformers.Qwen2ForCausalLM:
    """A random Qwen2 (GQA 4 heads / 2 groups, qkv bias, vocab 200: not a multiple of 128) saved to `path`."""
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=tied))
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomise so every layout is exercised
        for name, p in model.named_parameters():
            # Scales keep logits O(1), so an fp32 comparison of logits is meaningful at 1e-5.
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.1)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return model.eval()


def read_all(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory via the safetensors package (an independent reader)."""
    files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    out = {}
    for name in files:
        with safe_open(hf_dir / name, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in list(f.keys())})
    return out


def convert(*argv: str) -> None:
    assert main(list(argv)) == 0


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("pp", [1, 2], ids=["pp1", "pp2"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_hf_mcore_hf_round_trip_is_bit_exact(tmp_path: Path, tp: int, pp: int, tied: bool) -> None:
    make_tiny_hf(tmp_path / "hf", tied=tied)
    convert(
        "hf-to-mcore",
        "--hf-path",
        str(tmp_path / "hf"),
        "--save",
        str(tmp_path / "mc"),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
    )
    args = json.loads((tmp_path / "mc" / "args.json").read_text())
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (tp, pp)
    assert args["untie_embeddings_and_output_weights"] == (not tied)
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text() == "release"
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = tmp_path / "mc" / "release" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model.safetensors"
            with safe_open(shard, framework="pt") as f:  # rank files load with the safetensors package
                qkv = f.get_tensor("decoder.layers.1.self_attention.linear_qkv.weight")
                assert qkv.shape == ((4 + 2 * 2) * 8 // tp, 32)
                assert ("embedding.word_embeddings.weight" in set(f.keys())) == (pp_rank == 0)
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    original, back = read_all(tmp_path / "hf"), read_all(tmp_path / "hf2")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert transformers.Qwen2Config.from_pretrained(tmp_path / "hf2").to_dict() == (
        transformers.Qwen2Config.from_pretrained(tmp_path / "hf").to_dict()
    )


def test_sharded_output_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    model = make_tiny_hf(tmp_path / "hf", tied=False, max_shard_size="40KB")
    assert (tmp_path / "hf" / hf_format.INDEX_FILE).exists()  # the input is sharded too
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2")
    convert(
        "mcore-to-hf",
        "--load",
        str(tmp_path / "mc"),
        "--save",
        str(tmp_path / "out"),
        "--max-shard-size",
        "30KB",
    )
    index = json.loads((tmp_path / "out" / hf_format.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((tmp_path / "out" / s).exists() for s in shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in read_all(tmp_path / "out").values()
    )
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_dtype_cast_to_bf16(tmp_path: Path) -> None:
    make_tiny_hf(tmp_path / "hf", tied=True)
    convert(
        "hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--dtype", "bf16"
    )
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    original, back = read_all(tmp_path / "hf"), read_all(tmp_path / "hf2")
    assert all(torch.equal(back[n], t.to(torch.bfloat16)) for n, t in original.items())
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["dtype"] == "bfloat16"


QWEN25_32B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def test_qwen25_32b_dry_run_maps_to_megatron_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(QWEN25_32B))
    convert(
        "hf-to-mcore",
        "--hf-path",
        str(tmp_path / "hf"),
        "--save",
        str(tmp_path / "mc"),
        "--tp",
        "8",
        "--pp",
        "2",
        "--dry-run",
    )
    assert not (tmp_path / "mc").exists()
    out = capsys.readouterr().out
    args = json.loads(out[out.index("{") : out.index("}") + 1])
    expected = dict(
        num_layers=64,
        hidden_size=5120,
        ffn_hidden_size=27648,
        num_attention_heads=40,
        num_query_groups=8,
        group_query_attention=True,
        kv_channels=128,
        vocab_size=152064,
        padded_vocab_size=152576,  # ceil(152064 / (128 * 8)) * 1024
        tensor_model_parallel_size=8,
        pipeline_model_parallel_size=2,
        rotary_base=1e6,
        norm_epsilon=1e-5,
        untie_embeddings_and_output_weights=True,
        add_qkv_bias=True,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        params_dtype="bf16",
    )
    assert {k: args[k] for k in expected} == expected
    # Per-rank shapes: qkv (40 + 2*8) heads x 128 / 8 ranks; fc1 2 x 27648 / 8; fc2 27648 / 8 columns.
    for line in (
        "  embedding.word_embeddings.weight [19072, 5120]",
        "  decoder.layers.31.self_attention.linear_qkv.weight [896, 5120]",
        "  decoder.layers.31.self_attention.linear_qkv.bias [896]",
        "  decoder.layers.0.self_attention.linear_proj.weight [5120, 640]",
        "  decoder.layers.0.mlp.linear_fc1.weight [6912, 5120]",
        "  decoder.layers.0.mlp.linear_fc2.weight [5120, 3456]",
        "  output_layer.weight [19072, 5120]",
    ):
        assert line + "\n" in out + "\n", line
    stage0, stage1 = out.split("pp stage 1:")
    assert "decoder.layers.32." not in out and "output_layer" not in stage0 and "embedding" not in stage1


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        ("3", "1", r"num_attention_heads \(4\) is not divisible by --tensor-model-parallel-size \(3\)"),
        ("4", "1", r"num_key_value_heads \(2\) is not divisible by --tensor-model-parallel-size \(4\)"),
        ("1", "3", r"num_hidden_layers \(4\) is not divisible by --pipeline-model-parallel-size \(3\)"),
    ],
    ids=["heads", "kv_heads", "layers"],
)
def test_layout_errors_name_the_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tp: str, pp: str, message: str
) -> None:
    make_tiny_hf(tmp_path / "hf", tied=False)
    assert (
        main(
            [
                "hf-to-mcore",
                "--hf-path",
                str(tmp_path / "hf"),
                "--save",
                str(tmp_path / "mc"),
                "--tp",
                tp,
                "--pp",
                pp,
            ]
        )
        == 1
    )
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "mc").exists()


def _expect_error(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err


def test_missing_corrupt_and_mismatched_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=False, max_shard_size="40KB")
    argv = ["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")]
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _expect_error(capsys, argv, shard.name, "truncated")
    shard.unlink()
    _expect_error(capsys, argv, "missing", shard.name)
    shard.write_bytes(data)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    _expect_error(capsys, argv, "model.layers.0.mlp.gate_proj.weight: shape [48, 32]", "implies [40, 32]")
    assert not (tmp_path / "mc").exists()


def test_failure_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_tiny_hf(tmp_path / "hf", tied=False)
    real_get = hf_format.HFCheckpointReader.get
    calls = []

    def failing_get(self: hf_format.HFCheckpointReader, name: str) -> torch.Tensor:
        calls.append(name)
        if len(calls) > 12:
            raise OSError("disk vanished")
        return real_get(self, name)

    monkeypatch.setattr(hf_format.HFCheckpointReader, "get", failing_get)
    with pytest.raises(OSError, match="disk vanished"):
        main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2"])
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # neither the output nor its temporary sibling


def test_existing_checkpoint_and_hf_config_are_checked_against_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_hf(tmp_path / "hf", tied=False)
    base = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc")]
    convert(*base)
    _expect_error(
        capsys,
        [*base, "--tp", "2"],
        "already exists",
        "tensor_model_parallel_size: checkpoint has 1, expected 2",
    )
    convert(*base, "--tp", "2", "--overwrite")
    assert json.loads((tmp_path / "mc" / "args.json").read_text())["tensor_model_parallel_size"] == 2
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    other = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 6})
    other.save_pretrained(tmp_path / "other")
    _expect_error(
        capsys,
        [
            "mcore-to-hf",
            "--load",
            str(tmp_path / "mc"),
            "--save",
            str(tmp_path / "out"),
            "--hf-config",
            str(tmp_path / "other"),
        ],
        "num_layers: checkpoint has 4, expected 6",
    )
    _expect_error(
        capsys,
        ["mcore-to-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "out")],
        "is not a checkpoint written by checkpoint_convert",
    )
    rank = tmp_path / "mc" / "release" / "mp_rank_01_000" / "model.safetensors"
    rank.unlink()
    _expect_error(
        capsys,
        ["mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "out")],
        "missing safetensors file",
        "mp_rank_01_000",
    )
    assert not (tmp_path / "out").exists()
