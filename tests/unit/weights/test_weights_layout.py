"""Mapping table and layout functions against layouts written out index by index."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from megatron_dapo.weights import (
    arch_mapping,
    canonical_mcore_name,
    hf_to_mcore_tensor,
    iter_rank_shards,
    mcore_to_hf_tensors,
    merge_tp_shards,
    resolve_mcore_name,
    stage_tensors,
)
from megatron_dapo.weights.layout import hf_row_segments, hf_shapes, mcore_shard_shape
from megatron_dapo.weights.plan import hf_tensor_specs

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
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v], strict=True))


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
    for got, want, merged in zip(back, hf, merge_tp_shards(entry.kind, [reference], ARCH), strict=True):
        assert torch.equal(got, want) and torch.equal(got, merged)  # every HF row covered exactly once
    rows = sorted((s.row, s.row + s.rows) for s in segments)
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False)) and rows[0][0] == 0  # no overlap, no gap
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


def test_row_column_and_replicated_layouts() -> None:
    """row: TP rank r holds column block r; column (a kind no registered family's table uses today): row block r."""
    w = torch.randn(ARCH.q_size, ARCH.hidden_size)
    shards = hf_to_mcore_tensor("column", [w], ARCH, 2)
    assert torch.equal(shards[1], w[ARCH.q_size // 2 :]) and torch.equal(merge_tp_shards("column", shards, ARCH)[0], w)
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


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_shape_is_the_shape_of_every_tp_shard(tp: int) -> None:
    """mcore_shard_shape against the shards hf_to_mcore_tensor cuts: a row-parallel weight splits its columns, a
    column-parallel one (qkv, fc1, vocab) its rows."""
    gen = torch.Generator().manual_seed(0)
    for entry in arch_mapping(ARCH):
        hf = [torch.randn(shape, generator=gen) for shape in hf_shapes(entry, ARCH)]
        shards = hf_to_mcore_tensor(entry.kind, hf, ARCH, tp)
        assert len(shards) == tp and {tuple(s.shape) for s in shards} == {mcore_shard_shape(entry, ARCH, tp)}, entry
    proj = next(e for e in arch_mapping(ARCH) if e.kind == "row")
    assert mcore_shard_shape(proj, ARCH, 2) == (ARCH.hidden_size, ARCH.q_size // 2)


def test_a_stage_local_name_maps_to_the_hf_name_of_its_global_layer() -> None:
    """mcore_to_hf_tensors: layer 1 of the PP stage whose first layer is 2 is HF layer 3; its row-parallel TP shards
    are the HF tensor's column halves."""
    o = torch.randn(ARCH.hidden_size, ARCH.q_size)
    halves = [o[:, : ARCH.q_size // 2], o[:, ARCH.q_size // 2 :]]
    ((name, merged),) = mcore_to_hf_tensors("decoder.layers.1.self_attention.linear_proj.weight", halves, ARCH,
                                            layer_offset=2)
    assert name == "model.layers.3.self_attn.o_proj.weight" and torch.equal(merged, o)


MOE = ModelArch.from_hf(dict(families()["qwen3_moe"].tiny_config, model_type="qwen3_moe"))


def test_an_expert_parallel_rank_holds_its_global_experts_under_local_names() -> None:
    """EP2 over 8 experts: EP rank 1 holds global experts 4-7 of every layer as local_experts.0-3, read from HF's
    per-expert tensors of experts 4-7."""
    layout = ParallelLayout(tp=1, dp=2, ep=2)
    experts = [t for t in stage_tensors(MOE, layout, 0, ep_rank=1) if t.entry.per_expert]
    assert len(experts) == MOE.num_layers * 4 * 2  # fc1 and fc2 of 4 local experts per layer
    for t in experts:
        local = int(t.mcore_name.split("local_experts.")[1].split(".")[0])
        assert t.global_expert == 4 + local
        assert all(f"model.layers.{t.global_layer}.mlp.experts.{4 + local}." in n for n in t.hf_names)


def test_expert_shards_follow_the_expert_tp_rank_not_the_tp_rank() -> None:
    """TP2 with expert-TP 1 (EP2): TP rank 1 holds the second column half of a dense row-parallel weight but whole
    experts (their expert-TP rank is 0), HF's tensors of its EP rank's global experts."""
    layout = ParallelLayout(tp=2, dp=1, ep=2, etp=1, sp=True)
    gen = torch.Generator().manual_seed(0)
    hf = {s.name: torch.randn(s.shape, generator=gen) for s in hf_tensor_specs(MOE, torch.float32)}
    got = dict(iter_rank_shards(hf.__getitem__, MOE, layout, pp_rank=0, tp_rank=1, ep_rank=1, etp_rank=0))
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(got["decoder.layers.0.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2 :])
    assert torch.equal(got["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.layers.2.mlp.experts.5.down_proj.weight"])
    fc1 = got["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.2.mlp.experts.5.gate_proj.weight"],
                                       hf["model.layers.2.mlp.experts.5.up_proj.weight"]]))


def test_a_vocab_that_is_already_a_multiple_is_not_padded() -> None:
    """Megatron's rule, the smallest multiple of 128 x TP that holds the vocab: Qwen2.5's 152,064 rows (1188 x 128)
    stay 152,064 at TP1 and become 152,576 at TP8; a 256-row vocab is split unpadded at TP1 and TP2."""
    from megatron_dapo.distributed.parallel import padded_vocab_size

    assert [padded_vocab_size(152064, tp) for tp in (1, 2, 8)] == [152064, 152064, 152576]
    assert [padded_vocab_size(v, 1) for v in (1, 128, 129)] == [128, 128, 256]
    arch = ModelArch(**{**ARCH.to_dict(), "vocab_size": 256})
    table = torch.randn(256, ARCH.hidden_size)
    for tp in (1, 2):
        shards = hf_to_mcore_tensor("vocab", [table], arch, tp)
        assert torch.equal(torch.cat(shards), table)
