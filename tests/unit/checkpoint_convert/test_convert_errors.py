"""checkpoint_convert's one-line errors for a full disk and for damaged safetensors input (no tracebacks)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch

from checkpoint_convert.cli import main
from megatron_dapo.checkpoint import dist_ckpt
from megatron_dapo.weights import safetensors_io
from tests.disk_full import fill_disk_after, raise_enospc
from tests.unit.checkpoint_convert.test_convert import make_tiny_hf


def error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The converter's only stderr line, `checkpoint_convert <command>: error: ...`, without its prefix."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint_convert {command}: error: "), lines
    return lines[0].split(": error: ", 1)[1]


def full_disk_message(save: Path, what: str) -> str:
    return (rf"no space left on device writing {what} \(--save\) to {save} \(\d+\.\d\d GiB free on {save.parent}\); "
            r"free disk space there or choose another directory")


@pytest.mark.parametrize("route", ["copy", "cast"])
def test_full_disk_in_hf_to_mcore(tmp_path, monkeypatch, capsys, route):
    """copy: the kernel copy of a chunk (copy_file_range) finds the disk full; cast (--dtype bf16): torch.save's
    write does, which torch reports as a RuntimeError raised while handling the OSError."""
    make_tiny_hf(tmp_path / "hf", tied=False)
    capsys.readouterr()  # transformers' progress bars
    save = tmp_path / "mc"
    argv = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(save)]
    if route == "copy":
        monkeypatch.setattr(dist_ckpt, "copy_file_bytes", raise_enospc)
    else:
        fill_disk_after(monkeypatch, dist_ckpt, 40_000)
        argv += ["--dtype", "bf16"]
    assert main(argv) == 1
    assert re.fullmatch(full_disk_message(save, "the torch_dist checkpoint"), error_line(capsys, "hf-to-mcore"))
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no temporary sibling


def test_full_disk_in_mcore_to_hf(tmp_path, monkeypatch, capsys):
    make_tiny_hf(tmp_path / "hf", tied=False)
    capsys.readouterr()  # transformers' progress bars
    assert main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(safetensors_io, "copy_file_bytes", raise_enospc)
    save = tmp_path / "back"
    assert main(["mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(save)]) == 1
    assert re.fullmatch(full_disk_message(save, "the HF checkpoint"), error_line(capsys, "mcore-to-hf"))
    assert sorted(os.listdir(tmp_path)) == ["hf", "mc"]


def _rewrite_header(path: Path, edit) -> None:
    """Replace the JSON header of safetensors file `path` by `edit(header)` (a JSON-able value), data kept."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def _first_entry(header: dict, **change) -> dict:
    name = next(k for k in header if k != "__metadata__")
    return {**header, name: {**header[name], **change}}


DAMAGE = {  # what is wrong -> (how to make it, what the message says)
    "header-not-an-object": (lambda h: [h], "corrupt safetensors header (a JSON list, not an object of tensors)"),
    "metadata-not-an-object": (lambda h: {**h, "__metadata__": ["pt"]}, "__metadata__ is not an object"),
    "offsets-not-numbers": (lambda h: _first_entry(h, data_offsets="ab"), "bad header entry for"),
    "offsets-floats": (lambda h: _first_entry(h, data_offsets=[float(o) for o in _first_entry(h)[
        next(k for k in h if k != "__metadata__")]["data_offsets"]]), "bad header entry for"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_safetensors_header_is_one_line_naming_the_file(tmp_path, capsys, damage):
    make_tiny_hf(tmp_path / "hf", tied=False)
    capsys.readouterr()  # transformers' progress bars
    shard = tmp_path / "hf" / "model.safetensors"
    edit, says = DAMAGE[damage]
    _rewrite_header(shard, edit)
    assert main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc")]) == 1
    message = error_line(capsys, "hf-to-mcore")
    assert message.startswith(f"{shard}: ") and says in message, message
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("index, says", [
    pytest.param("[1, 2]", 'no "weight_map" object', id="a-list"),
    pytest.param('{"weight_map": ["model-00001-of-00002.safetensors"]}', 'no "weight_map" object', id="map-a-list"),
    pytest.param('{"weight_map": {"lm_head.weight": 7}}', 'no "weight_map" object', id="file-a-number"),
    pytest.param(b'{"weight_map": {"caf\xe9": "x"}}', "'utf-8' codec can't decode", id="not-utf8"),
])
def test_damaged_index_is_one_line_naming_the_file(tmp_path, capsys, index, says):
    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=False, max_shard_size="40KB")
    capsys.readouterr()
    path = hf / "model.safetensors.index.json"
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    assert main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")]) == 1
    message = error_line(capsys, "hf-to-mcore")
    assert message.startswith(f"{path} is corrupt: ") and says in message, message


def _edit_config(hf: Path, **fields) -> None:
    path = hf / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_hf_tensors_the_config_has_no_place_for_are_named(tmp_path, capsys):
    """Qwen2 weights (q/k/v biases) under a config.json that says llama: every tensor is consumed by the mapping or
    named (it converted without the biases, exit 0)."""
    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=True)
    _edit_config(hf, model_type="llama", architectures=["LlamaForCausalLM"])
    capsys.readouterr()
    biases = sorted(n for n in safe_open_names(hf / "model.safetensors") if n.endswith("_proj.bias"))
    assert len(biases) == 12  # 4 layers x q, k, v
    assert main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")]) == 1
    assert error_line(capsys, "hf-to-mcore") == (
        f"{hf} does not match its config.json (model_type 'llama'): 12 tensor(s) this model has no place for (a load "
        f"would drop them): {', '.join(biases[:3])}, ... (9 more): does config.json describe these weights?")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("same", [True, False], ids=["equal-copy", "different-head"])
def test_a_tied_models_stored_head_is_accepted_only_as_a_copy_of_the_embedding(tmp_path, capsys, same):
    """Some exporters write a tied model's lm_head.weight besides its embedding. Equal to the embedding, nothing is
    lost by not loading it: the conversion goes through. Different, it is a tensor the tied model has no place for:
    named, as any other."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=True)
    tensors = load_file(hf / "model.safetensors")
    head = tensors["model.embed_tokens.weight"].clone()
    if not same:
        head[0, 0] += 1
    save_file({**tensors, "lm_head.weight": head}, hf / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    rc = main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")])
    if same:
        assert rc == 0
    else:
        assert rc == 1
        assert "1 tensor(s) this model has no place for (a load would drop them): lm_head.weight" in \
            error_line(capsys, "hf-to-mcore")


def test_expert_count_mismatch_is_one_line(tmp_path, capsys):
    """config.json's num_experts (4) below the weights' (8): the routers' shapes and the experts past 3, one line."""
    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=True, model_type="qwen3_moe")
    _edit_config(hf, num_experts=4, num_local_experts=4)
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")]) == 1
    message = error_line(capsys, "hf-to-mcore")
    assert re.fullmatch(
        rf"{re.escape(str(hf))} does not match its config.json \(model_type 'qwen3_moe'\): 4 tensor\(s\) of another "
        r"shape: model\.layers\.0\.mlp\.gate\.weight \[8, 64\] \(config\.json implies \[4, 64\]\), .*, "
        r"\.\.\. \(1 more\); "
        r"48 tensor\(s\) this model has no place for \(a load would drop them\): model\.layers\.0\.mlp\.experts\.4\."
        r"down_proj\.weight, .*: does config\.json describe these weights\?", message), message


def test_derived_rope_buffers_of_old_checkpoints_are_not_counted(tmp_path, capsys):
    """`rotary_emb.inv_freq` (older checkpoints saved it per layer; every reader derives it from rope_theta, and
    transformers skips it on load) is no weight the mapping drops: the conversion goes on."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    make_tiny_hf(hf, tied=False)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf-path", str(hf), "--save", str(tmp_path / "mc")]) == 0


def safe_open_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return list(f.keys())
