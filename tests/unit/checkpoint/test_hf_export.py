"""--export-hf never deletes what it did not write, and replaces its own earlier export whole.

The collective weight iteration is replaced by a fixed list of tensors: these tests are about the
directory handling (the real weights are checked by tests/e2e/test_trainer_e2e.py through transformers).
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_dapo.checkpoint import hf_export
from megatron_dapo.checkpoint.hf_export import EXPORT_MARKER, check_export_target, export_hf
from megatron_dapo.errors import UserError
from megatron_dapo.weights import safetensors_io
from tests.disk_full import fill_disk_after

CONFIG = {"model_type": "qwen2", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "torch_dtype": "bfloat16"}


@pytest.fixture
def source(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(CONFIG))
    (src / "tokenizer.json").write_text("{}")
    return src


def fake_actor(monkeypatch, scale: float, *, fail_after: int | None = None):
    """An actor whose export yields two named tensors filled with `scale` (optionally failing mid-way)."""
    def iter_hf_weights(model, arch):
        for i, name in enumerate(("model.embed_tokens.weight", "model.norm.weight")):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("disk full")
            yield name, torch.full((2, 3), scale)

    monkeypatch.setattr(hf_export, "iter_hf_weights", iter_hf_weights)
    return SimpleNamespace(chunks=None, arch=None, config=SimpleNamespace(torch_params_dtype=torch.float32))


def siblings(path: Path) -> set[str]:
    return {p.name for p in path.parent.iterdir()}


def test_refuses_a_non_empty_directory_it_did_not_write(tmp_path, source, monkeypatch):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match=rf"--export-hf {out} is a non-empty directory that is not an earlier export"):
        check_export_target(out)
    with pytest.raises(UserError, match="this export was left in") as info:
        export_hf(fake_actor(monkeypatch, 1.0), out, source)
    assert (out / "notes.txt").read_text() == "precious" and [p.name for p in out.iterdir()] == ["notes.txt"]
    left = Path(str(info.value).rsplit("this export was left in ", 1)[1])
    assert (left / EXPORT_MARKER).is_file() and (left / "model.safetensors").is_file()


def test_refuses_a_file_and_a_symlink(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_export_target(tmp_path / "file")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UserError, match="is a symbolic link"):
        check_export_target(tmp_path / "link")


def test_second_export_replaces_the_first_and_touches_nothing_else(tmp_path, source, monkeypatch):
    out = tmp_path / "hf"
    user_tmp = tmp_path / "hf.tmp"  # a user's directory that merely shares the old temp name
    user_tmp.mkdir()
    (user_tmp / "keep.txt").write_text("keep")
    export_hf(fake_actor(monkeypatch, 1.0), out, source)
    (tmp_path / "empty").mkdir()
    export_hf(fake_actor(monkeypatch, 1.0), tmp_path / "empty", source)  # an empty directory may be used
    assert check_export_target(out) is None  # an earlier export may be replaced
    export_hf(fake_actor(monkeypatch, 2.0), out, source)

    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert all(torch.equal(t, torch.full((2, 3), 2.0)) for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((out / EXPORT_MARKER).read_text())["source_hf_checkpoint"] == str(source)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                                             EXPORT_MARKER])
    assert (user_tmp / "keep.txt").read_text() == "keep"
    assert siblings(out) == {"src", "hf", "hf.tmp", "empty"}  # no temporary directories left behind


def test_a_failed_export_keeps_the_previous_one(tmp_path, source, monkeypatch):
    out = tmp_path / "hf"
    export_hf(fake_actor(monkeypatch, 1.0), out, source)
    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(fake_actor(monkeypatch, 2.0, fail_after=1), out, source)
    assert torch.equal(load_file(out / "model.safetensors")["model.norm.weight"], torch.full((2, 3), 1.0))
    assert siblings(out) == {"src", "hf"}


@pytest.mark.parametrize("room", [0, 200], ids=["first-write", "second-shard"])
def test_a_full_disk_is_one_line_naming_the_path_and_the_free_space(tmp_path, source, monkeypatch, room):
    out = tmp_path / "hf"
    export_hf(fake_actor(monkeypatch, 1.0), out, source)
    fill_disk_after(monkeypatch, safetensors_io, room)
    with pytest.raises(UserError) as info:
        export_hf(fake_actor(monkeypatch, 2.0), out, source, max_shard_bytes=24)  # two shards
    assert re.fullmatch(rf"no space left on device writing the HF export \(--export-hf\) to {out} "
                        rf"\(\d+\.\d\d GiB free on {out}\); free disk space there or choose another directory",
                        str(info.value)), str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert torch.equal(load_file(out / "model.safetensors")["model.norm.weight"], torch.full((2, 3), 1.0))
    assert siblings(out) == {"src", "hf"}  # the partial export is removed


def test_sharded_export_has_an_index(tmp_path, source, monkeypatch):
    out = tmp_path / "hf"
    export_hf(fake_actor(monkeypatch, 3.0), out, source, max_shard_bytes=24)  # one 2x3 fp32 tensor per shard
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"model.embed_tokens.weight": "model-00001.safetensors",
                                   "model.norm.weight": "model-00002.safetensors"}
    assert index["metadata"]["total_size"] == 48
