"""`checkpoint_convert gguf-to-hf` on the real SmolLM2-135M-Instruct GGUF, against the `gguf` package's own reader.

The reference is independent of transformers' GGUF loader: `gguf.GGUFReader` + `gguf.quants.dequantize` give
each Q4_1 tensor's values, and llama.cpp's q/k row permutation is undone by the formula written out here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert.cli import main as convert
from checkpoint_convert.gguf_to_hf import packaged_gguf
from tests.real_model import SMOLLM2_MARKS, smollm2_hf_dir

pytestmark = SMOLLM2_MARKS


@pytest.fixture(scope="module")
def gguf_and_hf():
    import gguf

    reader = gguf.GGUFReader(str(packaged_gguf()))
    tensors = {t.name: t for t in reader.tensors}

    def dequantized(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))

    def field(name: str):
        f = reader.fields[name]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value.item()

    hf = smollm2_hf_dir()
    return dequantized, field, hf, load_file(hf / "model.safetensors")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows per head as (half, 2) interleaved; HF as (2, half): swap back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def test_weights_are_the_dequantized_gguf_values(gguf_and_hf):
    dequantized, field, _, sd = gguf_and_hf
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    assert torch.equal(sd["model.embed_tokens.weight"], dequantized("token_embd.weight"))
    for layer in (0, 29):
        h, g = f"model.layers.{layer}.", f"blk.{layer}."
        assert torch.equal(sd[h + "mlp.up_proj.weight"], dequantized(g + "ffn_up.weight"))
        assert torch.equal(sd[h + "self_attn.v_proj.weight"], dequantized(g + "attn_v.weight"))
        assert torch.equal(sd[h + "self_attn.q_proj.weight"], _unpermute(dequantized(g + "attn_q.weight"), heads))
        assert torch.equal(sd[h + "self_attn.k_proj.weight"], _unpermute(dequantized(g + "attn_k.weight"), kv_heads))
        assert torch.equal(sd[h + "input_layernorm.weight"], dequantized(g + "attn_norm.weight"))
    assert "lm_head.weight" not in sd  # tied: the GGUF has no output.weight either
    assert all(t.dtype == torch.float32 for t in sd.values())


def test_config_and_tokenizer_come_from_the_gguf_metadata(gguf_and_hf):
    _, field, hf, _ = gguf_and_hf
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["num_hidden_layers"] == field("llama.block_count")
    assert config["rope_parameters"]["rope_theta"] == field("llama.rope.freq_base")
    assert config["rms_norm_eps"] == pytest.approx(field("llama.attention.layer_norm_rms_epsilon"), rel=1e-7)
    assert config["eos_token_id"] == field("tokenizer.ggml.eos_token_id")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.eos_token_id == field("tokenizer.ggml.eos_token_id") and tok.eos_token == "<|im_end|>"
    assert tok.chat_template == field("tokenizer.chat_template")
    assert len(tok) == config["vocab_size"]


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert convert(["gguf-to-hf", "--gguf", str(tmp_path / "nope.gguf"), "--save", str(tmp_path / "out")]) == 1
    assert "--gguf" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    assert convert(["gguf-to-hf", "--gguf", "smollm2", "--save", str(tmp_path / "taken")]) == 1
    assert "--overwrite" in capsys.readouterr().err
