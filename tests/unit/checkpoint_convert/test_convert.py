"""checkpoint_convert on tiny random HF models (every registered family for the layout, round-trip and
transformers-reload checks; Qwen2 for the rest): torch_dist layout, bit-exact round trips, config checks,
atomic output and clean-up after a killed run. Loading into live models at TP/PP 1-2:
tests/unit/weights/test_weights_live.py."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from checkpoint_convert.cli import main
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from megatron_dapo.weights import hf_format
from megatron_dapo.weights.safetensors_io import SafetensorsFile
from tests.dist.actor_common import FAMILIES, hf_to_full_mcore
from tests.torchrun import REPO, subprocess_env

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


def tiny_fields(model_type: str = "qwen2") -> dict:
    """config.json fields of make_tiny_hf's model: TINY for qwen2, else the family's tiny_config (its own head_dim,
    rope scaling, ...) with TINY's vocab 200, so every family pads to 256 rows."""
    if model_type == "qwen2":
        return dict(TINY)
    return {**families()[model_type].tiny_config, "vocab_size": TINY["vocab_size"]}


def make_tiny_hf(path: Path, *, tied: bool, seed: int = 0, model_type: str = "qwen2", overrides: dict | None = None,
                 **save_kwargs) -> transformers.PreTrainedModel:
    """A random model of `model_type`'s family saved to `path`; the default, Qwen2: GQA 4 heads / 2 groups, qkv
    bias, vocab 200 (not a multiple of 128). `overrides` replace config fields (e.g. mlp_only_layers)."""
    torch.manual_seed(seed)
    fam = families()[model_type]
    model = fam.hf_causal_lm()(fam.hf_config(**{**tiny_fields(model_type), **(overrides or {})},
                                             tie_word_embeddings=tied))
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomise so every layout is exercised
        for name, p in model.named_parameters():
            # Scales keep logits O(1), so an fp32 comparison of logits is meaningful at 1e-5.
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: saved, and it changes the routing
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
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



def dcp_tensors(ckpt_iter_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist directory, read by torch.distributed.checkpoint itself (independent)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(ckpt_iter_dir)).read_metadata()
    state = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if hasattr(md, "chunks")
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt_iter_dir)), no_dist=True)
    return state


def load_common(ckpt_iter_dir: Path) -> dict:
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(ckpt_iter_dir / "common.pt", weights_only=True)


def expected_layer_tensors(full: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The decoder-layer tensors a torch_dist checkpoint of megatron-core 0.16.1's TE model holds, from
    `hf_to_full_mcore` output, written out here from megatron-core's naming: stacked on a leading layer axis
    (`decoder.layers.<name>`) unless some layers are dense and some MoE (then `decoder.layers.<L>.<name>`); GQA's
    fused qkv with the input norm fused in (`linear_qkv.layer_norm_weight`), MLA's TENorm input norm and its latent
    norms fused into the up projections; a dense MLP's norm fused into linear_fc1, an MoE layer's own
    `pre_mlp_layernorm`, its experts on a leading expert axis, its shared experts' fc1 [gate; up]."""
    per_layer: list[dict[str, torch.Tensor]] = []
    for i in range(layers):
        m, out = f"decoder.layers.{i}.", {}
        for key, tensor in full.items():
            if not key.startswith(m) or ".local_experts." in key:
                continue
            name = key[len(m):]
            if name == "input_layernorm.weight" and m + "self_attention.linear_qkv.weight" in full:
                name = "self_attention.linear_qkv.layer_norm_weight"
            elif name == "pre_mlp_layernorm.weight" and m + "mlp.router.weight" not in full:
                name = "mlp.linear_fc1.layer_norm_weight"
            elif name.endswith("linear_fc1.gate"):
                name, tensor = name.replace(".gate", ".weight"), torch.cat([tensor, full[key[:-4] + "up"]])
            elif name.endswith("linear_fc1.up"):
                continue
            out[name] = tensor
        experts = sorted({int(k.split(".local_experts.")[1].split(".")[0]) for k in full
                          if k.startswith(m) and ".local_experts." in k})
        if experts:
            x = m + "mlp.experts.local_experts."
            out["mlp.experts.experts.linear_fc1.weight"] = torch.stack(
                [torch.cat([full[f"{x}{e}.linear_fc1.gate"], full[f"{x}{e}.linear_fc1.up"]]) for e in experts])
            out["mlp.experts.experts.linear_fc2.weight"] = torch.stack([full[f"{x}{e}.linear_fc2.weight"]
                                                                        for e in experts])
        per_layer.append(out)
    moe = ["mlp.router.weight" in layer for layer in per_layer]
    if all(moe) or not any(moe):  # stacked
        return {f"decoder.layers.{name}": torch.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}
    return {f"decoder.layers.{i}.{name}": t for i, layer in enumerate(per_layer) for name, t in layer.items()}


# The full TP/PP x tie matrix for the first family, TP2 x PP2 tied and untied for the others (the layout code
# is shared; what differs per family is which tensors exist and their shapes).
ROUND_TRIPS = [(FAMILIES[0], 1, 1, False), (FAMILIES[0], 1, 1, True)] + [
    (f, 2, 2, tied) for f in FAMILIES for tied in (False, True)]


@pytest.mark.parametrize(("model_type", "tp", "pp", "tied"), ROUND_TRIPS,
                         ids=[f"{f}-tp{tp}pp{pp}-{'tied' if t else 'untied'}" for f, tp, pp, t in ROUND_TRIPS])
def test_torch_dist_layout_and_bit_exact_round_trip(tmp_path: Path, model_type: str, tp: int, pp: int,
                                                     tied: bool) -> None:
    model = make_tiny_hf(tmp_path / "hf", tied=tied, model_type=model_type)
    hidden = tiny_fields(model_type)["hidden_size"]
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"),
            "--tp", str(tp), "--pp", str(pp))
    # Megatron-LM layout: the tracker names a release directory holding a torch_dist checkpoint.
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text() == "release"
    release = tmp_path / "mc" / "release"
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = load_common(release)
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    fields = tiny_fields(model_type)
    assert (args.num_layers, args.num_query_groups, args.padded_vocab_size) == (
        4, fields["num_key_value_heads"], 256)
    assert args.untie_embeddings_and_output_weights == (not tied) and common["iteration"] == 0
    # Stored tensors (read by torch DCP) against an independent HF -> megatron mapping
    stored = dcp_tensors(release)
    full = hf_to_full_mcore(model.state_dict(), ModelArch.from_hf(tmp_path / "hf"))
    emb = stored["embedding.word_embeddings.weight"]
    assert emb.shape == (256, hidden) and torch.equal(emb[:200], full["embedding.word_embeddings.weight"])
    assert not emb[200:].any()  # padding rows are zero
    assert ("output_layer.weight" in stored) == (not tied)
    want = expected_layer_tensors(full, 4)
    assert sorted(k for k in stored if k.startswith("decoder.layers.")) == sorted(want)
    for key, ref in want.items():
        assert torch.equal(stored[key], ref), key
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    original, back = read_all(tmp_path / "hf"), read_all(tmp_path / "hf2")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    config_class = type(model.config)
    assert config_class.from_pretrained(tmp_path / "hf2").to_dict() == (
        config_class.from_pretrained(tmp_path / "hf").to_dict()
    )


def test_mixed_dense_moe_model_has_per_layer_keys_and_round_trips_bit_exact(tmp_path: Path) -> None:
    """Qwen3-MoE with a dense layer 1 (mlp_only_layers): megatron-core 0.16.1 then keys every layer apart
    (`decoder.layers.{L}.…`, no layer axis; TransformerBlock.sharded_state_dict under a moe_layer_freq list), the
    MoE layers with their experts on a global axis, the dense one with its dense MLP; HF -> mcore -> HF is
    bit-exact and the experts are written at EP4 x ETP1 as at EP1 (the output is layout-independent)."""
    model = make_tiny_hf(tmp_path / "hf", tied=False, model_type="qwen3_moe", overrides={"mlp_only_layers": [1]})
    for name, flags in [("mc", ["--tp", "2", "--pp", "2"]), ("mc_ep4", ["--ep", "4", "--etp", "1"])]:
        convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / name), *flags)
    stored = dcp_tensors(tmp_path / "mc" / "release")
    full = hf_to_full_mcore(model.state_dict(), ModelArch.from_hf(tmp_path / "hf"))
    assert not [k for k in stored if k.startswith("decoder.layers.") and not k.split(".")[2].isdigit()]
    for i in range(4):
        m = f"decoder.layers.{i}."
        assert torch.equal(stored[m + "self_attention.linear_qkv.weight"], full[m + "self_attention.linear_qkv.weight"])
        norm = "mlp.linear_fc1.layer_norm_weight" if i == 1 else "pre_mlp_layernorm.weight"  # TE: dense fused, MoE own
        assert torch.equal(stored[m + norm], full[m + "pre_mlp_layernorm.weight"])
        assert (m + "mlp.router.weight" in stored) == (i != 1) and (m + "mlp.linear_fc1.weight" in stored) == (i == 1)
        if i == 1:
            fc1 = torch.cat([full[m + "mlp.linear_fc1.gate"], full[m + "mlp.linear_fc1.up"]])
            assert torch.equal(stored[m + "mlp.linear_fc1.weight"], fc1)
            continue
        assert torch.equal(stored[m + "mlp.router.weight"], full[m + "mlp.router.weight"])
        fc1, fc2 = (stored[m + f"mlp.experts.experts.linear_fc{n}.weight"] for n in (1, 2))
        assert fc1.shape == (8, 64, 64) and fc2.shape == (8, 64, 32)
        for e in range(8):
            x = m + f"mlp.experts.local_experts.{e}."
            assert torch.equal(fc1[e], torch.cat([full[x + "linear_fc1.gate"], full[x + "linear_fc1.up"]])), (i, e)
            assert torch.equal(fc2[e], full[x + "linear_fc2.weight"]), (i, e)
    ep4 = dcp_tensors(tmp_path / "mc_ep4" / "release")
    assert set(ep4) == set(stored) and all(torch.equal(ep4[k], stored[k]) for k in stored)
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    original, back = read_all(tmp_path / "hf"), read_all(tmp_path / "hf2")
    assert set(back) == set(original) and len(original) == 113  # 3 MoE layers x (8 experts x 3 + router) + ...
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_sharded_ids_match_megatron_core() -> None:
    """The converter writes megatron-core's ShardedObject keys and metadata.json without importing it."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_dapo.checkpoint.dist_ckpt import MEGATRON_CONFIG, sharded_object_key

    obj = ShardedObject("decoder.layers.mlp.linear_fc1._extra_state", None, (64,), (3,), replica_id=0)
    assert sharded_object_key(obj.key, (3,), (64,)) == obj.unique_key
    from dataclasses import asdict

    assert asdict(CheckpointingConfig(sharded_backend="torch_dist")) == MEGATRON_CONFIG


def test_large_tensors_are_stored_in_row_chunks(tmp_path: Path) -> None:
    make_tiny_hf(tmp_path / "hf", tied=False)
    # Every tiny tensor fits one default chunk: split with chunks of a few rows (fp32, hidden 32).
    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, _entry_tensor
    from megatron_dapo.checkpoint.ckpt_config import stored_tensors

    arch = ModelArch.from_hf(tmp_path / "hf")
    HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / "mc"))  # validates
    with hf_format.HFCheckpointReader(tmp_path / "hf") as reader:
        emb = _entry_tensor(reader, stored_tensors(arch)[0], arch, 256, torch.float32, chunk_bytes=32 * 4 * 64)
        fc1 = _entry_tensor(reader, stored_tensors(arch)[6], arch, 256, torch.float32, chunk_bytes=32 * 4 * 20)
        # 200 vocab rows in 64-row chunks + one zero chunk of the 56 padding rows
        assert [(c.offset, c.shape) for c in emb.chunks] == [
            ((0, 0), (64, 32)), ((64, 0), (64, 32)), ((128, 0), (64, 32)), ((192, 0), (8, 32)),
            ((200, 0), (56, 32)),
        ]
        assert torch.equal(torch.cat([c.produce() for c in emb.chunks[:4]]), reader.get("model.embed_tokens.weight"))
        # fc1 of layer 1: gate rows 0-47 then up rows 48-95 of the [2F, H] slice, 20 rows a chunk
        layer1 = [c for c in fc1.chunks if c.offset[0] == 1]
        assert [c.offset[1] for c in layer1] == [0, 20, 40, 48, 68, 88]
        up = torch.cat([c.produce()[0] for c in layer1[3:]])
        assert torch.equal(up, reader.get("model.layers.1.mlp.up_proj.weight"))


@pytest.mark.parametrize(("h2m_bytes", "m2h_bytes"), [(1000, 4096), (4096, 1000)], ids=["small-stored", "small-read"])
def test_row_chunks_of_any_size_round_trip(tmp_path: Path, h2m_bytes: int, m2h_bytes: int) -> None:
    """Stored chunks and read blocks of a few rows (1000 B = 7 rows of hidden 32): blocks inside one stored
    chunk are mapped in place, blocks across chunks are assembled; both give the HF tensors back exactly."""
    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
    from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf

    make_tiny_hf(tmp_path / "hf", tied=False)
    cfg = HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / "mc"), threads=3)
    cfg.chunk_bytes = h2m_bytes
    hf_to_mcore(cfg)
    stored = dcp_tensors(tmp_path / "mc" / "release")  # torch's own reader assembles the chunks
    assert stored["embedding.word_embeddings.weight"].shape == (256, 32)
    back = McoreToHfConfig(load=str(tmp_path / "mc"), save=str(tmp_path / "hf2"), threads=3)
    back.chunk_bytes = m2h_bytes
    mcore_to_hf(back)
    original, result = read_all(tmp_path / "hf"), read_all(tmp_path / "hf2")
    assert set(result) == set(original) and all(torch.equal(result[n], t) for n, t in original.items())


def test_writer_holds_one_chunk_per_thread_and_qkv_is_stored_per_query_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a --dtype cast (chunks mapped and cast in memory), each writer thread drops (unmaps) its chunk before
    producing the next: at most --threads HF-backed chunks are alive at once (torch's own writer keeps one per
    tensor key per thread until its file is done). qkv is stored as its HF row ranges, three per query group;
    the .distcp files are the same on every run."""
    import threading
    import weakref

    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
    from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader

    make_tiny_hf(tmp_path / "hf", tied=False)
    real, lock, live, peak, produced = hf_format.HFCheckpointReader.map_rows, threading.Lock(), [0], [0], [0]

    def release() -> None:
        with lock:
            live[0] -= 1

    def tracked(self: hf_format.HFCheckpointReader, name: str, start: int, stop: int) -> torch.Tensor:
        t = real(self, name, start, stop)
        with lock:
            live[0] += 1
            produced[0] += 1
            peak[0] = max(peak[0], live[0])
        weakref.finalize(t, release)
        return t

    monkeypatch.setattr(hf_format.HFCheckpointReader, "map_rows", tracked)
    for out in ("mc", "mc2"):
        cfg = HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / out), threads=2, dtype="bf16")
        cfg.chunk_bytes = 32 * 2 * 5  # 5 rows of hidden 32 (bf16): many chunks per thread
        hf_to_mcore(cfg)
    assert produced[0] > 200 and peak[0] <= 2 and live[0] == 0
    with DistCheckpointReader(tmp_path / "mc") as reader:
        qkv = reader.tensors["decoder.layers.self_attention.linear_qkv.weight"]
        rows = sorted((c.offsets[1], c.sizes[1]) for c in qkv.chunks if c.offsets[0] == 0)
    # 2 groups x (2 q heads x head_dim 8 = 16 rows in 5-row chunks, 8 k rows, 8 v rows)
    group = [(0, 5), (5, 5), (10, 5), (15, 1), (16, 5), (21, 3), (24, 5), (29, 3)]
    assert rows == group + [(32 + r, n) for r, n in group]
    distcp = sorted(p.name for p in (tmp_path / "mc" / "release").glob("*.distcp"))
    assert distcp == ["__0_0.distcp", "__0_1.distcp"]
    for name in distcp:
        assert (tmp_path / "mc" / "release" / name).read_bytes() == (tmp_path / "mc2" / "release" / name).read_bytes()


class _BlocksAlive:
    """Counts the bytes of the tensors a reader method returns that are still alive (weakref.finalize), across
    threads: the peak, the largest block, and how many were made."""

    def __init__(self) -> None:
        import threading

        self.lock, self.live, self.peak, self.largest, self.made = threading.Lock(), 0, 0, 0, 0

    def wrap(self, real):
        import weakref

        def tracked(*args, **kwargs) -> torch.Tensor:
            t = real(*args, **kwargs)
            nbytes = t.numel() * t.element_size()
            with self.lock:
                self.live += nbytes
                self.made += 1
                self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
            weakref.finalize(t, self._release, nbytes)
            return t

        return tracked

    def _release(self, nbytes: int) -> None:
        with self.lock:
            self.live -= nbytes


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_a_converter_holds_threads_x_chunk_bytes_never_a_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               direction: str) -> None:
    """docs/ARCHITECTURE.md's "about one layer in memory", asserted as the tighter bound the converter keeps: with a
    --dtype cast (the only case that brings checkpoint bytes into the process; without one they are copied in the
    kernel, test_mcore_to_hf_copies_converter_output_in_the_kernel) every block a writer thread holds (hf-to-mcore: the
    cast chunk it serializes; mcore-to-hf: the rows it reads to cast) is at most --chunk-mb and at most --threads x
    --chunk-mb are alive at once, under a quarter of one decoder layer here. At Qwen2.5-32B (--threads 4 --chunk-mb 16)
    that is 64 MiB against a 975 MB layer."""
    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
    from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf
    from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader, LazyTensor

    make_tiny_hf(tmp_path / "hf", tied=False)
    layer_bytes = sum(t.numel() * t.element_size() for n, t in read_all(tmp_path / "hf").items()
                      if n.startswith("model.layers.0."))
    threads, chunk_bytes = 2, 32 * 4 * 5  # 5 fp32 rows of hidden 32
    assert 4 * threads * chunk_bytes < layer_bytes
    blocks = _BlocksAlive()
    h2m = HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / "mc"), threads=threads,
                          dtype="fp16" if direction == "hf-to-mcore" else None)
    h2m.chunk_bytes = chunk_bytes
    if direction == "hf-to-mcore":  # the cast chunk a writer thread holds (its mapped HF rows die in the cast)
        monkeypatch.setattr(LazyTensor, "__get_tensor_shard__", blocks.wrap(LazyTensor.__get_tensor_shard__))
    hf_to_mcore(h2m)
    if direction == "mcore-to-hf":
        monkeypatch.setattr(DistCheckpointReader, "read", blocks.wrap(DistCheckpointReader.read))
        m2h = McoreToHfConfig(load=str(tmp_path / "mc"), save=str(tmp_path / "hf2"), threads=threads, dtype="fp16")
        m2h.chunk_bytes = chunk_bytes
        mcore_to_hf(m2h)
    assert blocks.made > 100 and blocks.live == 0
    assert blocks.largest <= chunk_bytes and blocks.peak <= threads * chunk_bytes


@pytest.mark.parametrize("dtype", [None, "bf16"], ids=["copy", "cast"])
def test_copied_chunks_are_torch_save_records_equal_to_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str | None
) -> None:
    """Without --dtype every chunk's bytes go from the HF file to its record in the kernel (no HF row is mapped
    into the process); with --dtype bf16 each chunk is mapped and cast. Either way each record is byte for byte
    what torch.save of its tensor writes (the format of torch's FileSystemWriter, CRC32 off in every writer
    thread), and torch's own DCP reader gets the HF tensors back exactly, through the QKV interleave (two query
    groups, split into chunks of a few rows) and the padded vocab. A copied chunk's bytes start at the offset in
    a page they have in mcore-to-hf's output (planned_offsets, checked against the file it writes), so the copy
    back is page-aligned on both sides."""
    import io
    import zipfile

    import torch.distributed.checkpoint as dcp

    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore

    model = make_tiny_hf(tmp_path / "hf", tied=False)
    counts = {"map_rows": 0, "byte_range": 0}
    for method in counts:
        real = getattr(hf_format.HFCheckpointReader, method)

        def counting(self: hf_format.HFCheckpointReader, *a: int, real=real, method: str = method) -> object:
            counts[method] += 1
            return real(self, *a)

        monkeypatch.setattr(hf_format.HFCheckpointReader, method, counting)
    cfg = HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / "mc"), tp=2, threads=3, dtype=dtype)
    cfg.chunk_bytes = 32 * 4 * 5  # 5 fp32 rows of hidden 32: q rows of a group in 4 chunks
    hf_to_mcore(cfg)
    route = "map_rows" if dtype else "byte_range"
    assert counts[route] > 100 and counts["byte_range" if dtype else "map_rows"] == 0
    target = torch.bfloat16 if dtype else torch.float32
    release = tmp_path / "mc" / "release"
    stored = dcp_tensors(release)
    arch = ModelArch.from_hf(tmp_path / "hf")
    full = {k: v.to(target) for k, v in hf_to_full_mcore(model.state_dict(), arch).items()}
    emb = stored["embedding.word_embeddings.weight"]
    assert emb.dtype == target and emb.shape == (256, 32) and not emb[200:].any()
    assert torch.equal(emb[:200], full["embedding.word_embeddings.weight"])
    assert torch.equal(stored["output_layer.weight"][:200], full["output_layer.weight"])
    for i in range(4):
        for kind in ("weight", "bias"):
            key = f"self_attention.linear_qkv.{kind}"
            assert torch.equal(stored[f"decoder.layers.{key}"][i], full[f"decoder.layers.{i}.{key}"]), (i, kind)
        fc1 = torch.cat([full[f"decoder.layers.{i}.mlp.linear_fc1.{half}"] for half in ("gate", "up")])
        assert torch.equal(stored["decoder.layers.mlp.linear_fc1.weight"][i], fc1)
    metadata = dcp.FileSystemReader(str(release)).read_metadata()
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    with SafetensorsFile(tmp_path / "hf2" / "model.safetensors") as out:
        planned = hf_format.planned_offsets(list(out.specs.values()))
        assert planned == out._offsets  # where HFShardedWriter put every tensor
    stored_at: dict[tuple, int] = {}  # (key, offset) -> file offset of the tensor bytes, from the zip itself
    records = 0
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        for index, info in metadata.storage_data.items():
            if not hasattr(metadata.state_dict_metadata[index.fqn], "chunks"):
                continue  # a ShardedObject (layer _extra_state): megatron's BytesIO, not a tensor record
            with open(release / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            tensor = torch.load(io.BytesIO(raw), weights_only=True)
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                at = z.getinfo("archive/data/0").header_offset
            name_len, extra_len = struct.unpack("<HH", raw[at + 26 : at + 30])
            stored_at[index.fqn, tuple(index.offset)] = info.offset + at + 30 + name_len + extra_len
            chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            assert tensor.dtype == target and tensor.shape == chunk.sizes
            expected = io.BytesIO()
            torch.save(tensor, expected)
            assert raw == expected.getvalue(), index
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                assert [r.CRC for r in z.infolist()] == [0] * len(z.infolist())
            records += 1
    finally:
        torch.serialization.set_crc32_options(crc)
    assert records > 100
    if dtype is None:  # fc1 of layer 2: gate rows then up rows, 5 rows a chunk, each at its HF page offset
        fc1 = sorted((o[1], at) for (k, o), at in stored_at.items() if k.endswith("linear_fc1.weight") and o[0] == 2)
        want = [planned[f"model.layers.2.mlp.{p}_proj.weight"] + r * 32 * 4 for p in ("gate", "up")
                for r in range(0, 48, 5)]
        assert [at % 4096 for _, at in fc1] == [w % 4096 for w in want]


def test_mcore_to_hf_copies_converter_output_in_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of converter output is one byte range of one stored chunk: copied by copy_file_range, no
    block is read into the process; a --dtype cast, and blocks across stored chunks, are read and pwritten."""
    from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader
    from megatron_dapo.weights.safetensors_io import PositionalSafetensorsWriter

    make_tiny_hf(tmp_path / "hf", tied=False)
    cfg_argv = ["--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2"]
    convert("hf-to-mcore", *cfg_argv)
    real = PositionalSafetensorsWriter.write_rows
    written: list[str] = []

    def counting(self: PositionalSafetensorsWriter, name: str, start: int, rows: torch.Tensor) -> None:
        written.append(name)
        real(self, name, start, rows)

    monkeypatch.setattr(PositionalSafetensorsWriter, "write_rows", counting)
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    assert written == []
    original = read_all(tmp_path / "hf")
    back = read_all(tmp_path / "hf2")
    assert set(back) == set(original) and all(torch.equal(back[n], t) for n, t in original.items())
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf3"), "--dtype", "fp16")
    assert set(written) == set(original)
    assert all(torch.equal(t, original[n].half()) for n, t in read_all(tmp_path / "hf3").items())
    with DistCheckpointReader(tmp_path / "mc") as reader:
        key = "decoder.layers.mlp.linear_fc1.weight"  # [gate; up] of layer 1: one stored chunk each
        assert reader.byte_range(key, 1, (0, 48)) is not None and reader.byte_range(key, 1, (40, 56)) is None
        fd, offset = reader.byte_range(key, 1, (50, 53))
        assert os.pread(fd, 3 * 32 * 4, offset) == reader.read(key, 1, (50, 53)).numpy().tobytes()


def test_byte_range_is_none_across_stored_chunks(tmp_path: Path) -> None:
    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
    from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader

    make_tiny_hf(tmp_path / "hf", tied=False)
    cfg = HfToMcoreConfig(hf_path=str(tmp_path / "hf"), save=str(tmp_path / "mc"))
    cfg.chunk_bytes = 32 * 4 * 10  # 10-row chunks
    hf_to_mcore(cfg)
    with DistCheckpointReader(tmp_path / "mc") as reader:
        key = "decoder.layers.mlp.linear_fc1.weight"
        assert reader.byte_range(key, 2, (8, 12)) is None  # rows 8-9 and 10-11 are in two chunks
        fd, offset = reader.byte_range(key, 2, (12, 15))
        assert os.pread(fd, 3 * 32 * 4, offset) == reader.read(key, 2, (12, 15)).numpy().tobytes()
        assert torch.equal(reader.read(key, 2, (8, 12)), torch.cat([reader.read(key, 2, (8, 10)),
                                                                    reader.read(key, 2, (10, 12))]))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_sharded_output_loads_in_transformers_with_equal_logits(tmp_path: Path, model_type: str) -> None:
    model = make_tiny_hf(tmp_path / "hf", tied=False, model_type=model_type, max_shard_size="40KB")
    assert (tmp_path / "hf" / hf_format.INDEX_FILE).exists()  # the input is sharded too
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2")
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "out"), "--max-shard-size", "30KB")
    index = json.loads((tmp_path / "out" / hf_format.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((tmp_path / "out" / s).exists() for s in shards)
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == shards  # every shard listed
    assert set(index["weight_map"]) == set(read_all(tmp_path / "hf"))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in read_all(tmp_path / "out").values()
    )
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == families()[model_type].hf_model_class
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_jobs_are_scheduled_round_robin_over_the_output_shards(tmp_path: Path) -> None:
    """mcore-to-hf submits its row blocks round-robin over the HF shards (file order within each), so the
    blocks running at once write different files instead of taking turns on one file's lock."""
    import importlib

    from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader
    from megatron_dapo.weights.plan import hf_tensor_specs

    m2h = importlib.import_module("checkpoint_convert.mcore_to_hf")
    make_tiny_hf(tmp_path / "hf", tied=False)
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2")
    arch = ModelArch.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    (tmp_path / "out").mkdir()
    writer = hf_format.HFShardedWriter(tmp_path / "out", hf_tensor_specs(arch, torch.float32), 30_000)
    try:
        with DistCheckpointReader(tmp_path / "mc") as reader:
            in_file_order = m2h._jobs(reader, arch, 4096)
        order = m2h.interleave_by_shard(in_file_order, lambda j: writer.shard_of(j.hf_name))
    finally:
        writer.abort()
    shard = [writer.shard_of(j.hf_name) for j in order]
    n = len(set(shard))
    assert n > 3 and sorted(map(id, order)) == sorted(map(id, in_file_order))
    assert shard[:n] == list(range(n))  # the first n blocks go to n different files
    for s in range(n):
        assert [j for j in order if writer.shard_of(j.hf_name) == s] == [
            j for j in in_file_order if writer.shard_of(j.hf_name) == s]
    in_file_shards = [writer.shard_of(j.hf_name) for j in in_file_order]
    assert in_file_shards == sorted(in_file_shards)  # without the schedule, one file after the other


def test_dtype_cast_to_bf16(tmp_path: Path) -> None:
    make_tiny_hf(tmp_path / "hf", tied=True)
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--dtype", "bf16")
    assert load_common(tmp_path / "mc" / "release")["args"].params_dtype == torch.bfloat16
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
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"),
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--dry-run")
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
        params_dtype="torch.bfloat16",
        ckpt_format="torch_dist",
    )
    assert {k: args[k] for k in expected} == expected
    # Global shapes, layers stacked: qkv (40 + 2*8) heads x 128; fc1 = [gate; up].
    for line in (
        "  embedding.word_embeddings.weight [152576, 5120]",
        "  decoder.layers.self_attention.linear_qkv.weight [64, 7168, 5120]",
        "  decoder.layers.self_attention.linear_qkv.bias [64, 7168]",
        "  decoder.layers.self_attention.linear_qkv.layer_norm_weight [64, 5120]",
        "  decoder.layers.self_attention.linear_proj.weight [64, 5120, 5120]",
        "  decoder.layers.mlp.linear_fc1.weight [64, 55296, 5120]",
        "  decoder.layers.mlp.linear_fc2.weight [64, 5120, 27648]",
        "  output_layer.weight [152576, 5120]",
    ):
        assert line + "\n" in out, line


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
    argv = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", tp, "--pp", pp]
    assert main(argv) == 1
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
    _expect_error(capsys, argv, "model.layers.0.mlp.gate_proj.weight [48, 32] (config.json implies [40, 32])")
    (hf / "config.json").write_text(json.dumps(config)[:-5])  # issue 12: name the file, not a bare JSONDecodeError
    _expect_error(capsys, argv, f"--hf-path: {hf / 'config.json'} is not valid JSON")
    (hf / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    _expect_error(capsys, argv, f"{hf}/config.json declares torch.bfloat16",
                  f"the tensors of --hf-path {hf} are torch.float32", "--dtype")
    assert not (tmp_path / "mc").exists()


@pytest.mark.parametrize("route", ["copy", "cast"])
def test_failure_mid_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], route: str
) -> None:
    """copy: the HF file is truncated under the running conversion, so the kernel copy of the 13th chunk finds
    its source short (a real failure inside copy_file_bytes). cast (--dtype): reading the 13th chunk fails."""
    make_tiny_hf(tmp_path / "hf", tied=False)
    argv = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--threads", "2"]
    calls = []
    if route == "copy":
        real_range = hf_format.HFCheckpointReader.byte_range

        def truncating(self: hf_format.HFCheckpointReader, name: str, start: int, stop: int) -> tuple[int, int]:
            fd, offset = real_range(self, name, start, stop)
            calls.append(name)
            if len(calls) == 13:
                os.truncate(tmp_path / "hf" / "model.safetensors", offset)
            return fd, offset

        monkeypatch.setattr(hf_format.HFCheckpointReader, "byte_range", truncating)
        assert main(argv) == 1  # a CheckpointError: reported, exit status 1
        assert "bytes early (truncated file?)" in capsys.readouterr().err
    else:
        real = hf_format.HFCheckpointReader.map_rows

        def failing(self: hf_format.HFCheckpointReader, name: str, start: int, stop: int) -> torch.Tensor:
            calls.append(name)
            if len(calls) > 12:
                raise OSError("disk vanished")
            return real(self, name, start, stop)

        monkeypatch.setattr(hf_format.HFCheckpointReader, "map_rows", failing)
        with pytest.raises(OSError, match="disk vanished"):
            main([*argv, "--dtype", "bf16"])
    assert len(calls) >= 13
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # neither the output nor its temporary sibling


def test_stored_config_and_shapes_are_checked_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_hf(tmp_path / "hf", tied=False)
    base = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc")]
    convert(*base)
    _expect_error(capsys, base, "already exists", "--overwrite")
    convert(*base, "--overwrite")
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    back = ["mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "out")]
    for field, value, shown in [("rope_theta", 10000.0, "1000000.0"), ("tie_word_embeddings", True, "False"),
                                ("num_key_value_heads", 4, "2"), ("vocab_size", 300, "200")]:
        transformers.Qwen2Config(**{**TINY, field: value}).save_pretrained(tmp_path / "other")
        _expect_error(capsys, [*back, "--hf-config", str(tmp_path / "other")],
                      f"{field}: --load {tmp_path / 'mc'} has {shown}", f"--hf-config {tmp_path / 'other'} has {value}")
    _expect_error(capsys, ["mcore-to-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "out")],
                  "is not a megatron-core dist checkpoint")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "args.json").write_text("{}")
    _expect_error(capsys, ["mcore-to-hf", "--load", str(tmp_path / "old"), "--save", str(tmp_path / "out")],
                  "per-rank safetensors format", "hf-to-mcore")
    distcp = sorted((tmp_path / "mc" / "release").glob("*.distcp"))[0]
    distcp.unlink()
    _expect_error(capsys, back, str(distcp))
    assert not (tmp_path / "out").exists()


def test_geometry_checks_name_the_config_field() -> None:
    from megatron_dapo.checkpoint.ckpt_config import check_global_shapes, expected_global_shapes
    from megatron_dapo.weights import CheckpointError

    arch = ModelArch.from_hf({**TINY, "model_type": "qwen2"})
    good = expected_global_shapes(arch, 256)
    assert check_global_shapes(good, arch, source="ckpt", against="cfg") == 256
    assert check_global_shapes({**good, "embedding.word_embeddings.weight": (1024, 32),
                                "output_layer.weight": (1024, 32)}, arch, source="ckpt", against="cfg") == 1024
    cases = [
        ({"embedding.word_embeddings.weight": (128, 32)}, "ckpt has 128 embedding rows (padded vocab), cfg has "
                                                          "vocab_size 200"),
        ({"decoder.layers.self_attention.linear_qkv.weight": (4, 48, 32)}, "ckpt has [4, 48, 32], cfg implies "
                                                                           "[4, 64, 32]"),
        ({"decoder.layers.self_attention.linear_qkv.bias": None}, "qkv bias"),
    ]
    for change, message in cases:
        shapes = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(CheckpointError, match=__import__("re").escape(message)):
            check_global_shapes(shapes, arch, source="ckpt", against="cfg")
    tied = ModelArch.from_hf({**TINY, "model_type": "qwen2", "tie_word_embeddings": True})
    with pytest.raises(CheckpointError, match="untied output layer, cfg has tie_word_embeddings=true"):
        check_global_shapes(good, tied, source="ckpt", against="cfg")


def test_moe_config_fields_and_expert_geometry_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A converted Qwen3-MoE is refused, naming the field, by a config with other experts, top-k, expert width,
    routing or dense layers (mcore-to-hf --hf-config and `--load`'s check alike); a checkpoint without an HF
    config (a training one) by its expert tensor shapes and by per-layer vs stacked keys."""
    from megatron_dapo.checkpoint.ckpt_config import check_global_shapes, expected_global_shapes
    from megatron_dapo.checkpoint.dist_load import check_checkpoint_config
    from megatron_dapo.weights import CheckpointError

    make_tiny_hf(tmp_path / "hf", tied=False, model_type="qwen3_moe")
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--ep", "8")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    arch = ModelArch.from_hf(config)
    assert check_checkpoint_config(tmp_path / "mc", arch) == tmp_path / "mc" / "release"
    back = ["mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "out")]
    for field, value, label, shown in [("num_local_experts", 16, "num_experts", "8"),
                                       ("num_experts_per_tok", 4, "num_experts_per_tok", "2"),
                                       ("moe_intermediate_size", 48, "moe_intermediate_size", "32"),
                                       ("norm_topk_prob", False, "norm_topk_prob", "True"),
                                       ("mlp_only_layers", [1], "moe_layers", "(0, 1, 2, 3)")]:
        (tmp_path / "other").mkdir(exist_ok=True)
        (tmp_path / "other" / "config.json").write_text(json.dumps({**config, field: value}))
        _expect_error(capsys, [*back, "--hf-config", str(tmp_path / "other")],
                      f"{label}", f"--load {tmp_path / 'mc'} has {shown}")
        with pytest.raises(CheckpointError, match=f"{label}.*--hf-checkpoint config.json has"):
            check_checkpoint_config(tmp_path / "mc", ModelArch.from_hf({**config, field: value}))
    assert not (tmp_path / "out").exists()
    # geometry alone (no stored HF config): 16 experts' shapes name the fields; mixed layers the per-layer keys
    good = expected_global_shapes(arch, 256)
    assert good["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 8, 64, 64)
    more = ModelArch.from_hf({**config, "num_local_experts": 16})
    with pytest.raises(CheckpointError, match=r"ckpt has \[4, 8, 64, 64\], cfg implies \[4, 16, 64, 64\] "
                                              r"\(num_experts, moe_intermediate_size\)"):
        check_global_shapes(good, more, source="ckpt", against="cfg")
    mixed = ModelArch.from_hf({**config, "mlp_only_layers": [1]})
    with pytest.raises(CheckpointError, match="the checkpoint has stacked layer keys, the config's MoE layers "
                                              r"\[0, 2, 3\] of 4 imply per-layer ones"):
        check_global_shapes(good, mixed, source="ckpt", against="cfg")


@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [1]}], ids=["all-moe", "mixed"])
def test_bench_plan_counts_what_the_converter_writes(tmp_path: Path, overrides: dict) -> None:
    """tools/bench_convert.py --plan (sizes from config.json alone, e.g. Qwen3-30B-A3B's) counts the tensors, chunks
    and ShardedObjects a real conversion of the tiny Qwen3-MoE writes, read back from its files."""
    import importlib

    import torch.distributed.checkpoint as dcp

    plan_numbers = importlib.import_module("tools.bench_convert").plan_numbers
    make_tiny_hf(tmp_path / "hf", tied=False, model_type="qwen3_moe", overrides=overrides)
    arch = ModelArch.from_hf(tmp_path / "hf")
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--chunk-mb", "1",
            "--dtype", "bf16")
    metadata = dcp.FileSystemReader(str(tmp_path / "mc" / "release")).read_metadata().state_dict_metadata
    tensors = {k: md for k, md in metadata.items() if hasattr(md, "chunks")}
    got = plan_numbers(arch, threads=4, chunk_mb=1)
    hf = read_all(tmp_path / "hf")
    assert got["hf_tensors"] == len(hf) and got["hf_bytes"] == sum(t.numel() * 2 for t in hf.values())
    assert got["stored_keys"] == len(tensors) and got["objects"] == len(metadata) - len(tensors)
    assert got["chunks"] == sum(len(md.chunks) for md in tensors.values())
    assert got["largest_tensor"] == max(torch.Size(md.size).numel() * 2 for md in tensors.values())


_KILLABLE = """
import sys, time
from megatron_dapo.weights import hf_format
def slow(self, *a):  # where a writer thread gets a chunk's HF byte range, to copy it
    print("WRITING", flush=True)
    time.sleep(600)
hf_format.HFCheckpointReader.byte_range = slow
from checkpoint_convert.cli import main
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_killed_run_leaves_no_temporary_after_the_next_run(tmp_path: Path, sig: signal.Signals) -> None:
    """Issue 12: SIGTERM removes the temporary at exit; SIGKILL's is removed by the next run (dead pid)."""
    make_tiny_hf(tmp_path / "hf", tied=False)
    argv = ["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "out" / "mc")]
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, *argv], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("WRITING")  # a writer thread is inside the conversion
        tmp = [p.name for p in (tmp_path / "out").iterdir()]
        assert len(tmp) == 1 and tmp[0].startswith(".mc.tmp-") and tmp[0].endswith(f"-{proc.pid}")
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = os.listdir(tmp_path / "out")
    assert left == (tmp if sig == signal.SIGKILL else [])
    convert(*argv)
    assert os.listdir(tmp_path / "out") == ["mc"]


def _add_mtp_layer(hf_dir: Path, layer: int) -> int:
    """Append a DeepSeek-V3 multi-token-prediction layer `layer` (= num_hidden_layers) to `hf_dir`'s one safetensors
    file as the release stores it: a decoder layer (layer 1's tensors, renamed) plus eh_proj, enorm, hnorm and the
    shared head's norm. Returns how many tensors were added."""
    from safetensors.torch import load_file, save_file

    (path,) = hf_dir.glob("*.safetensors")
    tensors = load_file(path)
    mtp = {k.replace("model.layers.1.", f"model.layers.{layer}."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    hidden = tensors["model.norm.weight"].shape[0]
    for name, shape in (("eh_proj.weight", (hidden, 2 * hidden)), ("enorm.weight", (hidden,)),
                        ("hnorm.weight", (hidden,)), ("shared_head.norm.weight", (hidden,))):
        mtp[f"model.layers.{layer}.{name}"] = torch.randn(shape)
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    return len(mtp)


def test_deepseek_v3_mtp_layer_is_left_out_and_said(tmp_path: Path, capsys) -> None:
    """A DeepSeek-V3 checkpoint with its multi-token-prediction layer (num_nextn_predict_layers 1: tensors under
    model.layers.{num_hidden_layers}.): hf-to-mcore writes exactly what it writes without them and says it left them
    out, naming the prefix and why; the same tensors under a config.json with num_nextn_predict_layers 0 are
    refused as tensors with no place. (transformers 5.19's DeepseekV3Config defaults it to 1, as DeepSeek-V3 ships.)"""
    make_tiny_hf(tmp_path / "plain", tied=False, model_type="deepseek_v3", overrides={"num_nextn_predict_layers": 0})
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "plain"), "--save", str(tmp_path / "mc_plain"))
    capsys.readouterr()
    make_tiny_hf(tmp_path / "mtp", tied=False, model_type="deepseek_v3", overrides={"num_nextn_predict_layers": 1})
    added = _add_mtp_layer(tmp_path / "mtp", 4)
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "mtp"), "--save", str(tmp_path / "mc_mtp"))
    out = capsys.readouterr().out
    assert f"not loading {added} tensor(s) under model.layers.4.: DeepSeek-V3's multi-token-prediction layer" in out
    plain, mtp = dcp_tensors(tmp_path / "mc_plain" / "release"), dcp_tensors(tmp_path / "mc_mtp" / "release")
    assert set(plain) == set(mtp) and all(torch.equal(plain[k], mtp[k]) for k in plain)
    _add_mtp_layer(tmp_path / "plain", 4)
    assert main(["hf-to-mcore", "--hf-path", str(tmp_path / "plain"), "--save", str(tmp_path / "mc_bad")]) != 0
    err = capsys.readouterr().err
    assert f"{added} tensor(s) this model has no place for" in err and "model.layers.4." in err


def test_deepseek_v3_bf16_checkpoint_keeps_its_fp32_router_bias(tmp_path: Path) -> None:
    """DeepSeek-V3's release dtype mix: bf16 weights, fp32 e_score_correction_bias. hf-to-mcore takes it as a bf16
    checkpoint (no --dtype), stores the bias as megatron-core's fp32 expert_bias bit for bit (bf16 would round it),
    and mcore-to-hf gives the same mix back, bit-exact."""
    from safetensors.torch import load_file, save_file

    make_tiny_hf(tmp_path / "hf", tied=False, model_type="deepseek_v3")
    (path,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
               for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    convert("hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc"), "--tp", "2")
    stored = dcp_tensors(tmp_path / "mc" / "release")
    for i in (1, 2, 3):  # the MoE layers (per-layer keys: layer 0 is dense)
        bias = stored[f"decoder.layers.{i}.mlp.router.expert_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
    assert stored["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--save", str(tmp_path / "hf2"))
    back = read_all(tmp_path / "hf2")
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_fp8_block_quantized_checkpoint_is_refused_by_name(tmp_path: Path, capsys) -> None:
    """DeepSeek-V3's release format (fp8 weights, each with a weight_scale_inv of block scales) is refused in one line
    naming the scale tensors and how to get a bf16 copy, not as a dtype mix or a list of unplaceable tensors."""
    from safetensors.torch import load_file, save_file

    make_tiny_hf(tmp_path / "hf", tied=False, model_type="deepseek_v3")
    (path,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.replace("weight", "weight_scale_inv")] = torch.ones(1, 1)
    save_file(tensors, path, metadata={"format": "pt"})
    assert main(["hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--save", str(tmp_path / "mc")]) != 0
    err = capsys.readouterr().err
    assert "FP8 block-quantized checkpoint (1 tensor(s) named *weight_scale_inv" in err and "fp8_cast_bf16" in err
    assert not (tmp_path / "mc").exists()
