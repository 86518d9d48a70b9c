"""Tensor layout functions behind the layout kinds of `mapping.py`: HF tensors <-> TP shards.

Only the kinds that are not a plain split carry logic: the GQA QKV interleave, the fc1 gate/up
concat, and vocab padding. Every function is pure (no process groups), exact (no arithmetic on
values, so a round trip is bit-exact) and keeps the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.mapping import MappingEntry, fill, resolve_mcore_name

Shape = tuple[int, ...]


def hf_shapes(entry: MappingEntry, arch: ModelArch) -> tuple[Shape, ...]:
    """Shapes of the HF tensors feeding `entry`, in the order of `entry.hf` (the table's `shapes`, read off `arch`)."""
    return tuple(tuple(arch.fact(dim) for dim in shape) for shape in entry.shapes)


def mcore_shard_shape(entry: MappingEntry, arch: ModelArch, tp: int) -> Shape:
    """Shape of one TP rank's shard of `entry` (all ranks hold the same shape)."""
    shapes = hf_shapes(entry, arch)
    if entry.kind == "replicated":
        return shapes[0]
    if entry.kind == "vocab":
        return (padded_vocab_size(arch.vocab_size, tp) // tp, shapes[0][1])
    if entry.kind in ("qkv", "fc1"):
        rows = sum(s[0] for s in shapes)
        return (rows // tp, *shapes[0][1:])
    if entry.kind == "column":
        return (shapes[0][0] // tp, *shapes[0][1:])
    return (shapes[0][0], shapes[0][1] // tp)  # row


def global_shape(entry: MappingEntry, arch: ModelArch, padded_vocab: int) -> Shape:
    """Shape of `entry` in a dist checkpoint: the TP=1 tensor, an expert's on a leading global expert axis, layers
    stacked on a leading axis where megatron-core stacks them (`mapping.stacked_layers`: not in a mixed dense /
    MoE model, whose keys are per layer).

    Layout-independent except the vocab rows, which megatron-core pads per TP and reshards at load.
    """
    from megatron_dapo.weights.mapping import stacked_layers

    if entry.kind == "vocab":
        shape: Shape = (padded_vocab, arch.hidden_size)
    else:
        shape = mcore_shard_shape(entry, arch, 1)
    if entry.per_expert:
        shape = (arch.num_experts, *shape)
    return (arch.num_layers, *shape) if entry.stage == "layer" and stacked_layers(arch) else shape


@dataclass(frozen=True)
class RowSegment:
    """HF tensor `hf_index` rows hf_lo:hf_hi are rows row:row + (hf_hi - hf_lo) of the global (TP=1) tensor."""

    hf_index: int
    hf_lo: int
    hf_hi: int
    row: int

    @property
    def rows(self) -> int:
        return self.hf_hi - self.hf_lo


def hf_row_segments(entry: MappingEntry, arch: ModelArch) -> list[RowSegment]:
    """Where every HF row of `entry` sits on dim 0 of its global (TP=1) tensor, in global row order.

    Each kind is a permutation of contiguous HF row blocks: one block per HF tensor (fc1 = [gate; up],
    the vocab then zero rows up to the padded size, which no segment covers), or, for qkv, three per
    query group g: q rows of its heads_per_group heads, k rows of head g, v rows of head g. A converter
    copies each block as one byte range (memory-mapped or in-kernel), never building a fused copy.
    At the 32B launcher a qkv weight layer (73 MB) is 8 groups x (6.25 MiB q + 1.25 MiB k + 1.25 MiB v).
    """
    if entry.kind != "qkv":
        segments, row = [], 0
        for i, shape in enumerate(hf_shapes(entry, arch)):
            segments.append(RowSegment(i, 0, shape[0], row))
            row += shape[0]
        return segments
    d, q_rows = arch.head_dim, arch.heads_per_group * arch.head_dim
    group_rows = q_rows + 2 * d
    segments = []
    for g in range(arch.num_kv_heads):
        at = g * group_rows
        segments += [
            RowSegment(0, g * q_rows, (g + 1) * q_rows, at),
            RowSegment(1, g * d, (g + 1) * d, at + q_rows),
            RowSegment(2, g * d, (g + 1) * d, at + q_rows + d),
        ]
    return segments


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """[q_size, *t], [kv_size, *t] x2 -> [groups * (heads_per_group + 2) * head_dim, *t].

    Per query group g: its heads_per_group q heads, then k head g, then v head g. TP rank r then owns
    groups r*G/tp .. (r+1)*G/tp - 1, a contiguous block of rows (megatron-core's fused QKV layout).
    """
    g, d = arch.num_kv_heads, arch.head_dim
    trailing = q.shape[1:]
    q = q.reshape(g, arch.heads_per_group * d, *trailing)
    k = k.reshape(g, d, *trailing)
    v = v.reshape(g, d, *trailing)
    return torch.cat([q, k, v], dim=1).reshape(-1, *trailing)


def _split_qkv(fused: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """Inverse of `_interleave_qkv`: the full fused tensor -> [q, k, v] in HF layout."""
    g, d = arch.num_kv_heads, arch.head_dim
    trailing = fused.shape[1:]
    grouped = fused.reshape(g, (arch.heads_per_group + 2) * d, *trailing)
    q, k, v = torch.split(grouped, [arch.heads_per_group * d, d, d], dim=1)
    return [
        q.reshape(arch.q_size, *trailing),
        k.reshape(arch.kv_size, *trailing),
        v.reshape(arch.kv_size, *trailing),
    ]


def _check_hf(kind: str, hf_tensors: Sequence[torch.Tensor], count: int) -> None:
    if len(hf_tensors) != count:
        raise ValueError(f"layout {kind!r} takes {count} HF tensor(s), got {len(hf_tensors)}")


def hf_to_mcore_tensor(
    kind: str, hf_tensors: Sequence[torch.Tensor], arch: ModelArch, tp: int
) -> list[torch.Tensor]:
    """HF tensor(s) of one parameter -> its `tp` megatron-core shards (index = TP rank).

    Shards may be views of the inputs (no copy) except where padding or interleaving makes one.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if kind == "replicated":
        _check_hf(kind, hf_tensors, 1)
        return [hf_tensors[0]] * tp
    if kind == "column":
        _check_hf(kind, hf_tensors, 1)
        return list(torch.chunk(hf_tensors[0], tp, dim=0))
    if kind == "row":
        _check_hf(kind, hf_tensors, 1)
        return list(torch.chunk(hf_tensors[0], tp, dim=1))
    if kind == "vocab":
        _check_hf(kind, hf_tensors, 1)
        (table,) = hf_tensors
        if table.shape[0] != arch.vocab_size:
            raise ValueError(
                f"vocab tensor has {table.shape[0]} rows, config.json vocab_size is {arch.vocab_size}"
            )
        pad = padded_vocab_size(arch.vocab_size, tp) - arch.vocab_size
        # Zero rows: never produced as tokens (the tokenizer has no ids there) and cut again on export.
        padded = torch.cat([table, table.new_zeros(pad, *table.shape[1:])]) if pad else table
        return list(torch.chunk(padded, tp, dim=0))
    if kind == "qkv":
        _check_hf(kind, hf_tensors, 3)
        if arch.num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads ({arch.num_kv_heads}) is not divisible by tp ({tp})")
        return list(torch.chunk(_interleave_qkv(*hf_tensors, arch), tp, dim=0))
    if kind == "fc1":
        _check_hf(kind, hf_tensors, 2)
        gate, up = (torch.chunk(t, tp, dim=0) for t in hf_tensors)
        return [torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)]
    raise ValueError(f"unknown layout kind {kind!r}")


def _cat(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat that does not copy a single tensor (the TP=1 / dist-checkpoint case)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=dim)


def merge_tp_shards(kind: str, shards: Sequence[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """Inverse of `hf_to_mcore_tensor`: TP shards (index = rank) -> HF tensor(s) in table order.

    With one shard (TP=1) the results are views of it where the layout allows (all but qkv).
    """
    if not shards:
        raise ValueError("merge_tp_shards needs at least one shard")
    if kind == "replicated":
        return [shards[0]]
    if kind == "column":
        return [_cat(shards, 0)]
    if kind == "row":
        return [_cat(shards, 1)]
    if kind == "vocab":
        full = _cat(shards, 0)
        if full.shape[0] < arch.vocab_size:
            raise ValueError(
                f"vocab shards hold {full.shape[0]} rows, fewer than vocab_size {arch.vocab_size}"
            )
        return [full[: arch.vocab_size]]
    if kind == "qkv":
        return _split_qkv(_cat(shards, 0), arch)
    if kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return [_cat([g for g, _ in halves], 0), _cat([u for _, u in halves], 0)]
    raise ValueError(f"unknown layout kind {kind!r}")


def mcore_to_hf_tensors(
    name: str, shards: Sequence[torch.Tensor], arch: ModelArch, *, layer_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """A megatron-core parameter's TP shards (an expert's: expert-TP shards) -> [(HF name, tensor)].

    `name` is a megatron-core name (canonical or alias) whose layer number plus `layer_offset` is
    the global layer, and whose expert number is the global expert. Tied models have no HF tensor for
    `output_layer.weight`: it returns [].
    """
    entry, layer, expert = resolve_mcore_name(name, arch)
    if entry.tied_hf and arch.tie_word_embeddings:
        return []
    global_layer = None if layer is None else layer + layer_offset
    names = [fill(t, global_layer, expert) for t in entry.hf]
    return list(zip(names, merge_tp_shards(entry.kind, shards, arch), strict=True))
