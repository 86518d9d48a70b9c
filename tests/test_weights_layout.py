"""Mapping table and layout functions against layouts written out index by index."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights import (
    arch_mapping,
    canonical_mcore_name,
    hf_to_mcore_tensor,
    merge_tp_shards,
    resolve_mcore_name,
    stage_tensors,
)
from megatron_dapo.weights.layout import hf_row_segments, hf_shapes, mcore_shard_shape

ARCH = ModelArch(
    model_type="qwen2",
    vocab_size=300,
    hidden_size=16,
    intermediate_size=24,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=2,
)


def _qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rows of TP rank `rank`: for each of its query groups, that group's q heads, then its k, then its v."""
    d, hpg = ARCH.head_dim, ARCH.heads_per_group
    groups = ARCH.num_kv_heads // tp
    rows = []
    for g in range(rank * groups, (rank + 1) * groups):
        for h in range(g * hpg, (g + 1) * hpg):
            rows.append(q[h * d : (h + 1) * d])
        rows.append(k[g * d : (g + 1) * d])
        rows.append(v[g * d : (g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_qkv_interleave_matches_per_group_reference(tp: int, bias: bool) -> None:
    trailing = () if bias else (ARCH.hidden_size,)
    q = torch.randn(ARCH.q_size, *trailing)
    k = torch.randn(ARCH.kv_size, *trailing)
    v = torch.randn(ARCH.kv_size, *trailing)
    shards = hf_to_mcore_tensor("qkv", [q, k, v], ARCH, tp)
    assert len(shards) == tp
    for r, shard in enumerate(shards):
        assert torch.equal(shard, _qkv_reference(q, k, v, tp, r))
    back = merge_tp_shards("qkv", shards, ARCH)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


@pytest.mark.parametrize("entry", [e for e in arch_mapping(ARCH) if not e.tied_hf], ids=lambda e: e.mcore)
def test_row_segments_rebuild_every_layout_bit_exact(entry) -> None:
    """Copying the HF rows of each segment into place (what the converters do, file to file) gives the
    TP=1 tensor of the reference `hf_to_mcore_tensor` bit for bit, and reading them back gives merge_tp_shards'."""
    g = torch.Generator().manual_seed(1)
    hf = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in hf_shapes(entry, ARCH)]
    (reference,) = hf_to_mcore_tensor(entry.kind, hf, ARCH, 1)
    segments = hf_row_segments(entry, ARCH)
    built = torch.zeros_like(reference)  # vocab padding rows: covered by no segment, stay zero
    for s in segments:
        built[s.row : s.row + s.rows] = hf[s.hf_index][s.hf_lo : s.hf_hi]
    assert torch.equal(built.view(torch.int16), reference.view(torch.int16))
    if entry.kind == "qkv":
        assert torch.equal(built, _qkv_reference(*hf, tp=1, rank=0))  # the per-group formula written out
        assert len(segments) == 3 * ARCH.num_kv_heads
    back = [torch.full_like(t, float("nan")) for t in hf]
    for s in segments:
        back[s.hf_index][s.hf_lo : s.hf_hi] = reference[s.row : s.row + s.rows]
    for got, want, merged in zip(back, hf, merge_tp_shards(entry.kind, [reference], ARCH)):
        assert torch.equal(got, want) and torch.equal(got, merged)  # every HF row covered exactly once
    rows = sorted((s.row, s.row + s.rows) for s in segments)
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])) and rows[0][0] == 0  # no overlap, no gap
    assert sum(s.rows for s in segments) == sum(shape[0] for shape in hf_shapes(entry, ARCH))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_fc1_is_gate_chunk_then_up_chunk_per_rank(tp: int) -> None:
    f = ARCH.intermediate_size
    gate, up = torch.randn(f, ARCH.hidden_size), torch.randn(f, ARCH.hidden_size)
    shards = hf_to_mcore_tensor("fc1", [gate, up], ARCH, tp)
    n = f // tp
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]]))
    g2, u2 = merge_tp_shards("fc1", shards, ARCH)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_pads_to_multiple_of_128_tp_with_zero_rows(tp: int) -> None:
    table = torch.randn(ARCH.vocab_size, ARCH.hidden_size, dtype=torch.bfloat16)
    shards = hf_to_mcore_tensor("vocab", [table], ARCH, tp)
    padded = torch.cat(shards)
    multiple = 128 * tp
    assert padded.shape[0] % multiple == 0 and padded.shape[0] - multiple < ARCH.vocab_size <= padded.shape[0]
    assert torch.equal(padded[: ARCH.vocab_size], table)
    assert not padded[ARCH.vocab_size :].any()
    assert tuple(shards[0].shape) == mcore_shard_shape(arch_mapping(ARCH)[0], ARCH, tp)
    (back,) = merge_tp_shards("vocab", shards, ARCH)
    assert torch.equal(back, table) and back.dtype == torch.bfloat16


def test_row_and_replicated_layouts() -> None:
    o = torch.randn(ARCH.hidden_size, ARCH.q_size)
    shards = hf_to_mcore_tensor("row", [o], ARCH, 2)
    assert torch.equal(shards[1], o[:, ARCH.q_size // 2 :])
    assert torch.equal(merge_tp_shards("row", shards, ARCH)[0], o)
    norm = torch.randn(ARCH.hidden_size)
    assert all(s is norm for s in hf_to_mcore_tensor("replicated", [norm], ARCH, 2))


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="takes 3 HF tensor"):
        hf_to_mcore_tensor("qkv", [torch.zeros(1)], ARCH, 1)
    with pytest.raises(ValueError, match="vocab_size is 300"):
        hf_to_mcore_tensor("vocab", [torch.zeros(10, 16)], ARCH, 1)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_to_mcore_tensor("qkv", [torch.zeros(ARCH.q_size), torch.zeros(8), torch.zeros(8)], ARCH, 8)
    with pytest.raises(ValueError, match="unknown layout kind"):
        hf_to_mcore_tensor("diagonal", [torch.zeros(1)], ARCH, 1)


def test_te_aliases_resolve_to_local_spec_names() -> None:
    assert (
        canonical_mcore_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", ARCH)
        == "decoder.layers.3.input_layernorm.weight"
    )
    assert canonical_mcore_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", ARCH) == (
        "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    entry, layer, _ = resolve_mcore_name("decoder.layers.12.mlp.linear_fc1.weight", ARCH)
    assert (entry.kind, layer, entry.hf[1].format(layer=layer)) == (
        "fc1",
        12,
        "model.layers.12.mlp.up_proj.weight",
    )
    with pytest.raises(KeyError, match="not a megatron-core parameter of a 'qwen2' model"):
        resolve_mcore_name("decoder.layers.0.mlp.router.weight", ARCH)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_tensors_place_embedding_head_and_local_layers(pp: int, tied: bool) -> None:
    arch = ModelArch(**{**ARCH.to_dict(), "tie_word_embeddings": tied})
    stages = [stage_tensors(arch, ParallelLayout(pp=pp), s) for s in range(pp)]
    names = [[t.mcore_name for t in s] for s in stages]
    assert names[0][0] == "embedding.word_embeddings.weight"
    assert all("embedding.word_embeddings.weight" not in n for n in names[1:])
    # megatron-core keeps a tied head copy only on a last stage that is not also the first.
    assert ("output_layer.weight" in names[-1]) == (not tied or pp > 1)
    assert names[-1][-1] in ("output_layer.weight", "decoder.final_layernorm.weight")
    per_stage = arch.num_layers // pp
    for s, stage in enumerate(stages):
        layers = [t for t in stage if t.global_layer is not None]
        assert len(layers) == per_stage * 7  # norm, qkv w+b, proj, norm, fc1, fc2
        assert {t.global_layer for t in layers} == set(range(s * per_stage, (s + 1) * per_stage))
        assert all(
            t.mcore_name.startswith(f"decoder.layers.{t.global_layer - s * per_stage}.") for t in layers
        )
    if tied and pp > 1:
        head = next(t for t in stages[-1] if t.mcore_name == "output_layer.weight")
        assert head.hf_names == ("model.embed_tokens.weight",)
