"""The converter and the trainer across model families: `hf-to-mcore --dry-run` of Qwen3-32B and Llama-3.1-8B (their
real config.json shapes, examples/models) gives the Megatron-LM args that rebuild each family, and an unknown or
missing config.json model_type stops both CLIs with the supported families and docs/MODELS.md, writing nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoint_convert.cli import main as convert_main
from megatron_dapo import train as train_mod
from megatron_dapo.models.registry import model_types
from tests.torchrun import REPO


def _dry_run_args(tmp_path: Path, model: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[dict, str]:
    hf = tmp_path / "hf"
    shutil.copytree(REPO / "examples/models" / model, hf)
    assert convert_main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc"), *flags,
                         "--dry-run"]) == 0
    assert not (tmp_path / "mc").exists()
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"): out.index("}") + 1]), out


def test_qwen3_32b_dry_run_maps_to_megatron_args(tmp_path, capsys):
    """Qwen3-32B: 64 heads x head_dim 128 = a q projection 8192 wide on hidden 5120, per-head q/k RMSNorm
    (--qk-layernorm), no q/k/v bias, plain RoPE 1e6."""
    args, out = _dry_run_args(tmp_path, "qwen3-32B", capsys, "--tp", "8", "--pp", "2")
    expected = dict(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                    num_query_groups=8, group_query_attention=True, kv_channels=128, vocab_size=151936,
                    padded_vocab_size=152576,  # ceil(151936 / (128 x 8)) x 1024
                    max_position_embeddings=40960, tensor_model_parallel_size=8, pipeline_model_parallel_size=2,
                    norm_epsilon=1e-6, untie_embeddings_and_output_weights=True, add_qkv_bias=False,
                    qk_layernorm=True, add_bias_linear=False, swiglu=True, normalization="RMSNorm",
                    position_embedding_type="rope", rotary_percent=1.0, rotary_base=1e6)
    assert {k: args.get(k) for k in expected} == expected
    assert "use_rope_scaling" not in args
    for line in (
        "  decoder.layers.self_attention.linear_qkv.weight [64, 10240, 5120]",  # (64 + 2 x 8) x 128
        "  decoder.layers.self_attention.linear_proj.weight [64, 5120, 8192]",
        "  decoder.layers.self_attention.q_layernorm.weight [64, 128]",
        "  decoder.layers.self_attention.k_layernorm.weight [64, 128]",
        "  decoder.layers.mlp.linear_fc1.weight [64, 51200, 5120]",
        "  output_layer.weight [152576, 5120]",
    ):
        assert line + "\n" in out, line
    assert "linear_qkv.bias" not in out
    # 32.76e9 parameters (+ 640 x 5120 x 2 vocab padding rows) x 2 B
    assert "total 65.537 GB" in out


def test_qwen3_30b_a3b_dry_run_maps_to_megatron_moe_args(tmp_path, capsys):
    """Qwen3-30B-A3B: 128 experts, top-8, moe_intermediate 768, every layer MoE -> Megatron-LM's --num-experts,
    --moe-router-topk, --moe-ffn-hidden-size, --moe-layer-freq 1; the experts stored on a global axis after the
    stacked layer axis (the same for any --ep); a layout the experts do not split over names the flag."""
    from tests.unit.models.test_models_moe import QWEN3_30B_A3B

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    base = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--dry-run"]
    assert convert_main([*base, "--tp", "2", "--pp", "2", "--ep", "8", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    args = json.loads(out[out.index("{"): out.index("}") + 1])
    expected = dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                    qk_layernorm=True, add_qkv_bias=False, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                    moe_layer_freq=1, moe_router_pre_softmax=False, moe_router_score_function="softmax",
                    moe_aux_loss_coeff=0.001, moe_router_load_balancing_type="aux_loss")
    assert {k: args.get(k) for k in expected} == expected
    for line in (
        "  decoder.layers.mlp.router.weight [48, 128, 2048]",
        "  decoder.layers.mlp.experts.experts.linear_fc1.weight [48, 128, 1536, 2048]",  # gate; up of 768 rows
        "  decoder.layers.mlp.experts.experts.linear_fc2.weight [48, 128, 2048, 768]",
        "  decoder.layers.pre_mlp_layernorm.weight [48, 2048]",  # a TE MoE layer's own TENorm (what TE loads)
    ):
        assert line + "\n" in out, line
    assert "decoder.layers.mlp.linear_fc1." not in out  # no dense MLP, no fused pre-MLP norm
    # per layer: qkv (4096 + 2 x 512) x 2048, o 2048 x 4096, q/k norms 2 x 128, 2 norms x 2048, router 128 x 2048,
    # 128 experts x 3 x 768 x 2048; embedding and head at the TP2-padded vocab 152064; the final norm. x 2 B
    layer = 5120 * 2048 + 2048 * 4096 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 768 * 2048
    params = 48 * layer + 2 * 152064 * 2048 + 2048
    assert args["padded_vocab_size"] == 152064 and f"total {params * 2 / 1e9:.3f} GB" in out  # 61.065
    assert convert_main([*base, "--ep", "3"]) == 1
    assert "num_experts (128) is not divisible by --expert-model-parallel-size (3)" in capsys.readouterr().err
    assert convert_main([*base, "--ep", "2", "--etp", "5"]) == 1
    assert "--expert-tensor-parallel-size (5)" in capsys.readouterr().err


def test_llama31_8b_dry_run_maps_to_megatron_args(tmp_path, capsys):
    """Llama-3.1-8B: llama3 rope scaling (factor 8) -> Megatron-LM's --use-rope-scaling --rope-scaling-factor 8,
    rope 5e5, no bias, no q/k norm."""
    args, out = _dry_run_args(tmp_path, "llama3.1-8B", capsys, "--tp", "8")
    expected = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_query_groups=8, kv_channels=128, vocab_size=128256, padded_vocab_size=129024,
                    max_position_embeddings=131072, norm_epsilon=1e-5, untie_embeddings_and_output_weights=True,
                    add_qkv_bias=False, qk_layernorm=False, swiglu=True, rotary_base=5e5, use_rope_scaling=True,
                    rope_scaling_factor=8.0)
    assert {k: args.get(k) for k in expected} == expected
    assert "  decoder.layers.self_attention.linear_qkv.weight [32, 6144, 4096]\n" in out  # (32 + 2 x 8) x 128
    assert "q_layernorm" not in out and "linear_qkv.bias" not in out


UNREGISTERED = "not-a-registered-family"
"""A model_type no family can take: a family's folder is named after its model_type, and no package name has a '-'."""
BAD_MODEL_TYPES = [pytest.param({"model_type": "gpt2"}, "model_type 'gpt2' is not supported", id="gpt2"),
                   pytest.param({"model_type": UNREGISTERED}, f"model_type {UNREGISTERED!r} is not supported",
                                id="unregistered"),
                   pytest.param({}, "model_type is missing", id="missing")]


def _bad_model_dir(tmp_path: Path, fields: dict) -> Path:
    """Qwen2.5-7B's config.json with model_type replaced by an unregistered one (or removed)."""
    assert fields.get("model_type") not in model_types(), fields
    config = json.loads((REPO / "examples/models/qwen2.5-7B/config.json").read_text())
    config.pop("model_type")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config | fields))
    return model


def _names_the_families(message: str, shown: str) -> None:
    assert f"{shown}; supported: " in message, message
    assert all(repr(t) in message for t in model_types()) and "docs/MODELS.md" in message, message


@pytest.mark.parametrize("fields,shown", BAD_MODEL_TYPES)
@pytest.mark.parametrize("dry_run", [False, True], ids=["convert", "dry-run"])
def test_converter_rejects_an_unknown_model_type(tmp_path, capsys, fields, shown, dry_run):
    model = _bad_model_dir(tmp_path, fields)
    rc = convert_main(["hf-to-mcore", "--hf-path", str(model), "--save", str(tmp_path / "mc"),
                       *(["--dry-run"] if dry_run else [])])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(f"checkpoint_convert hf-to-mcore: error: --hf-path {model / 'config.json'}: "), err
    _names_the_families(err, shown)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing written


@pytest.mark.parametrize("fields,shown", BAD_MODEL_TYPES)
def test_trainer_rejects_an_unknown_model_type_before_writing(tmp_path, capsys, monkeypatch, fields, shown):
    """check_flags reads the family (every rank), before rank 0 creates --save / --log-dir or any model exists."""
    import megatron_dapo.actor as actor_mod

    def no_model(*_a, **_k):
        raise AssertionError("reached init_parallel")

    monkeypatch.setattr(actor_mod, "init_parallel", no_model)
    model = _bad_model_dir(tmp_path, fields)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n' * 4)
    with pytest.raises(SystemExit) as info:
        train_mod.main(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-steps", "1",
                        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-wandb", "--no-progress",
                        "--save", str(tmp_path / "save"), "--log-dir", str(tmp_path / "log")])
    err = capsys.readouterr().err
    assert info.value.code == 2
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: --hf-checkpoint {model / 'config.json'}: "), line
    _names_the_families(line, shown)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "train.jsonl"]  # no --save, no --log-dir
