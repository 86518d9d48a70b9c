"""HF safetensors (a registered model family) -> a megatron-core dist checkpoint that `--load` opens at any TP/PP.

No model is built: each tensor goes through the mapping table to its dist-checkpoint key and global
shape, as chunks that are each one HF row range (`hf_row_segments`: the QKV interleave is three ranges
per query group). Without a --dtype cast a writer thread copies each range from the HF file into its
`.distcp` record in the kernel (copy_file_range, inside the record torch.save would write); with a
cast it memory-maps and casts the range only when it writes it. `--tp`/`--pp` only validate that the
model splits over that layout and set the padded vocab (`--ep`/`--etp`: the experts over EP and expert-TP);
megatron-core reshards at load.

Cost at Qwen2.5-32B (65.5 GB bf16, 64 layers of 975 MB: qkv 73 MB, fc1 566 MB; embedding and head
1.56 GB each): no HF byte enters the process without a cast (RSS growth ~0); with one, --threads mapped
chunks of at most --chunk-mb and their serialized records (4 x 2 x 16 MiB = 128 MiB), not a layer (the
goal's bound, one layer plus the write buffers, is 1.04 GB). Each byte is copied once, page cache to page
cache, so the time is a byte copy's (65.5 GB at the disk's write speed: ~66 s at 1 GB/s) times the ratio
`tools/bench_convert.py` measures.

Mixture of experts (Qwen3-MoE): each expert's HF gate / up / down rows go to index e of the layer's expert axis
(`entry.dist` keys: [L, E, 2I, H] and [L, E, H, I] when the layers stack, [E, ...] per layer key in a mixed dense /
MoE model; `ckpt_config.stored_tensors`), so the output is the same whatever --ep / --etp. At Qwen3-30B-A3B
(61.1 GB bf16, 18,867 HF tensors of which 18,432 experts; `tools/bench_convert.py --plan qwen3-30b-a3b`): a layer's
fc1 is 128 x 1536 x 2048 x 2 B = 805 MB and the stacked fc1 38.7 GB, but neither is ever held: an expert's gate, up
or down (768 x 2048 x 2 B = 3 MiB) is one chunk, copied in the kernel (~0 resident), or mapped and cast with
--dtype (at most --threads x --chunk-mb chunks plus their records = 128 MiB). 19,373 chunks and 12,529
`_extra_state` objects (~1 KB each) make the .metadata the writers' only per-chunk state.

The keys are a Transformer Engine model's by default (`--transformer-impl`, as the trainer's flag), what every GPU
run and Megatron-LM's default asks for: they differ from a local-spec model's only in an MoE layer's pre-MLP norm
(TE: `pre_mlp_layernorm.weight`, its own TENorm; local: `mlp.linear_fc1.layer_norm_weight`). megatron_dapo's
`--load` and resume read either into either (`ckpt_config.request_stored_keys`); `--transformer-impl local` is for
other loaders of an MoE model under megatron-core's local spec.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir
from megatron_dapo.checkpoint.ckpt_config import (
    StoredTensor,
    check_dtype,
    config_dtype,
    read_hf_config,
    stored_tensors,
)
from megatron_dapo.checkpoint.dist_ckpt import (
    FORMAT,
    ITERATION_DIR,
    PAGE,
    Chunk,
    LazyTensor,
    serialized_object,
    sharded_object_key,
    write_dist_checkpoint,
    write_tracker,
)
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size, validate_layout
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.hf_format import HFCheckpointReader, copy_assets, planned_offsets
from megatron_dapo.weights.layout import RowSegment, global_shape, hf_row_segments, hf_shapes
from megatron_dapo.weights.mapping import LAYER_IMPLS, hf_names
from megatron_dapo.weights.plan import (
    buffer_hf_names,
    dropped_hf_tensors,
    dropped_notice,
    entry_dtype,
    hf_tensor_specs,
)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ASSETS_DIR = "hf_assets"
"""Tokenizer and generation files copied next to the checkpoint, so mcore-to-hf needs no --tokenizer-path."""


@dataclass(kw_only=True)
class HfToMcoreConfig:
    hf_path: str
    """--hf-path: HF model directory (config.json + safetensors; only config.json for --dry-run)."""
    save: str
    """--save: output checkpoint directory (Megatron-LM layout: latest_checkpointed_iteration.txt, release/)."""
    tp: int = 1
    """--tp: tensor-parallel size to validate the model against (heads, kv heads, ffn) and pad the vocab for."""
    pp: int = 1
    """--pp: pipeline-parallel size to validate the layer count against."""
    ep: int = 1
    """--ep: expert-parallel size to validate num_experts against (MoE; the checkpoint loads at any EP)."""
    etp: int | None = None
    """--etp: expert-tensor-parallel size to validate moe_intermediate_size against (MoE; None = --tp)."""
    dtype: str | None = None
    """--dtype: fp32 | bf16 | fp16; default keeps the HF checkpoint's dtype (bit-exact)."""
    overwrite: bool = False
    """--overwrite: replace an existing --save directory."""
    dry_run: bool = False
    """--dry-run: print the Megatron args and tensor shapes; read only config.json, write nothing."""
    threads: int = 4
    """--threads: parallel writer threads (one .distcp file each; each holds one chunk at a time)."""
    chunk_mb: int = 16
    """--chunk-mb: largest stored chunk; bigger row ranges are split (with --dtype: resident <= threads x chunk)."""
    transformer_impl: str = "transformer_engine"
    """--transformer-impl: whose dist-checkpoint keys to write, a TE model's or megatron-core's local spec's (they
    differ in an MoE layer's pre-MLP norm). megatron_dapo's --load reads either into either; the choice matters to
    other loaders (Megatron-LM) of a mixture-of-experts model."""

    def __post_init__(self) -> None:
        if not os.path.isdir(self.hf_path):
            raise FileNotFoundError(f"--hf-path {self.hf_path} is not a directory")
        if self.transformer_impl not in LAYER_IMPLS:
            raise ValueError(f"--transformer-impl must be one of {list(LAYER_IMPLS)}, got {self.transformer_impl!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.chunk_mb < 1:
            raise ValueError(f"--chunk-mb must be >= 1, got {self.chunk_mb}")
        # Only validated against the model (`validate_layout`): data parallelism sized so the expert grid fits
        # (EP x ETP divides TP x DP), sequence parallelism on (an MoE model at TP > 1 runs with it).
        expert_tp = self.tp if self.etp is None else self.etp
        self.layout = ParallelLayout(tp=self.tp, pp=self.pp, dp=max(1, self.ep * expert_tp), sp=self.tp > 1,
                                     ep=self.ep, etp=self.etp)
        self.chunk_bytes = self.chunk_mb << 20


def _rows_per_chunk(chunk_bytes: int, row_bytes: int) -> int:
    """Rows of `row_bytes` bytes each that a chunk of at most `chunk_bytes` holds (at least one)."""
    return max(1, chunk_bytes // max(1, row_bytes))


def _row_chunks(
    reader: HFCheckpointReader, name: str, seg: RowSegment, prefix: tuple[int, ...], row_bytes: int,
    chunk_bytes: int, dtype: torch.dtype, planned: dict[str, int] | None = None,
) -> list[Chunk]:
    """HF rows seg.hf_lo:seg.hf_hi of `name` as chunks of at most chunk_bytes, placed at global row seg.row.

    Without a --dtype cast each chunk's `source` is its HF byte range: the writer copies it file to file in
    the kernel, starting at the page offset the rows will have in mcore-to-hf's default output (`planned`:
    HF file offsets of that layout), so that copy back is page-aligned. With a cast, `produce` maps the HF
    rows and casts them when a writer thread reaches the chunk (dropped once written).
    """
    step = _rows_per_chunk(chunk_bytes, row_bytes)
    spec = reader.specs[name]
    trailing = spec.shape[1:]
    out = []
    for lo in range(seg.hf_lo, seg.hf_hi, step):
        hi = min(seg.hf_hi, lo + step)

        def produce(lo: int = lo, hi: int = hi) -> torch.Tensor:
            t = reader.map_rows(name, lo, hi).to(dtype)
            return t.view(*(1,) * len(prefix), *t.shape)

        def source(lo: int = lo, hi: int = hi) -> tuple[int, int]:
            return reader.byte_range(name, lo, hi)

        offset = (*prefix, seg.row + lo - seg.hf_lo, *(0,) * len(trailing))
        copy = spec.dtype == dtype
        page = (planned[name] + lo * row_bytes) % PAGE if copy and planned else None
        out.append(Chunk(offset, (*(1,) * len(prefix), hi - lo, *trailing), produce, source if copy else None, page))
    return out


def _entry_tensor(
    reader: HFCheckpointReader, stored: StoredTensor, arch: ModelArch, padded_vocab: int,
    dtype: torch.dtype, chunk_bytes: int, planned: dict[str, int] | None = None,
) -> LazyTensor:
    """One stored tensor (an entry over its layers, and experts) as a LazyTensor of HF-backed chunks.

    Every kind is a permutation of HF row blocks (`hf_row_segments`; qkv: three per query group), so
    each chunk is one HF byte range: nothing is concatenated or interleaved in memory. An expert's HF
    tensors (gate, up / down of expert e) go to index e of the leading expert axis.
    """
    entry = stored.entry
    lazy = LazyTensor(global_shape(entry, arch, padded_vocab), dtype)
    segments = hf_row_segments(entry, arch)
    itemsize = torch.empty((), dtype=dtype).element_size()
    row_bytes = [itemsize * torch.Size(s[1:]).numel() for s in hf_shapes(entry, arch)]
    for layer, expert in stored.hf_sources(arch):
        prefix = stored.index(layer, expert)
        names = hf_names(entry, layer=layer, tied=False, expert=expert)
        for seg in segments:
            lazy.chunks += _row_chunks(
                reader, names[seg.hf_index], seg, prefix, row_bytes[seg.hf_index], chunk_bytes, dtype, planned
            )
        if entry.kind == "vocab" and padded_vocab > arch.vocab_size:
            # Zero rows: no token id reaches them; megatron-core re-pads them per TP at load. Up to 128 x TP - 1
            # rows (10 MiB at hidden 5120, TP8 in bf16), in chunks of at most chunk_bytes like the HF rows.
            step = _rows_per_chunk(chunk_bytes, row_bytes[0])
            for lo in range(arch.vocab_size, padded_vocab, step):
                pad = (min(step, padded_vocab - lo), *lazy.shape[1:])
                lazy.chunks.append(Chunk((lo, 0), pad, lambda pad=pad: torch.zeros(pad, dtype=dtype)))
    return lazy


def extra_state_objects(arch: ModelArch, impl: str = "transformer_engine") -> dict[str, Any]:
    """The `_extra_state` ShardedObjects GPTModel.sharded_state_dict() asks for at load, on a TE build too.

    Per layer, the linears (megatron-core's local ones and TE's alike: four, or MLA's six or five), of an MoE layer
    the attention's and each expert's two (megatron-core's SequentialMLP and TE's grouped linears alike: one object
    per expert, offsets (layer, expert) of (L, E) when the layers stack, (expert,) of (E,) in a per-layer key); the
    norms a TE build keeps as TENorm modules of their own (TE's RMSNorm has extra state; a stored key naming a
    `…layernorm` module: the per-head q/k norms, an MoE layer's pre-MLP norm; the fused ones are the linears');
    once, the final norm, which on a TE build is TE's RMSNorm (TransformerBlock's LayerNormImpl, whatever the layer
    spec) (unsharded: offset (0,), shape (1,)). Stored as None (no FP8 metadata): megatron-core's local modules ask
    for none of the norms' and ignore the linears', TE's accept None. Loading tolerates an absent one anyway
    (weights/extra_state.py). `impl`: the keys the tensors are written under (`stored_tensors`). At Qwen3-30B-A3B
    under TE: 48 x (2 + 2 x 128 + 3) + 1 = 12,529 objects of ~1 KB (`tools/bench_convert.py --plan`).
    """
    objects = {}
    for stored in stored_tensors(arch, impl):
        module, param = stored.key.rsplit(".", 1)
        # the router (replicated, no extra state) and the fused norms (`linear_*.layer_norm_weight`: the linear's) have
        # none of their own; a replicated linear has (MLA's duplicated down projections, TELinear and its local twin)
        linear = module.rsplit(".", 1)[-1].startswith("linear_") and param == "weight"
        if stored.entry.stage != "layer" or (stored.entry.kind == "replicated"
                                             and not (module.endswith("layernorm") or linear)):
            continue
        lead = (arch.num_layers,) if stored.stacked else ()
        experts = (arch.num_experts,) if stored.entry.per_expert else ()
        for layer, expert in stored.hf_sources(arch):
            offset, shape = stored.index(layer, expert), (*lead, *experts)
            if not shape:  # a per-layer key's unsharded object
                offset, shape = (0,), (1,)
            objects[sharded_object_key(f"{module}._extra_state", offset, shape)] = serialized_object(None)
    objects[sharded_object_key("decoder.final_layernorm._extra_state", (0,), (1,))] = serialized_object(None)
    return objects


POSITION_ARGS: dict[str, str] = {
    "position_embedding_type": "position_embedding_type",
    "rotary_percent": "rotary_percent",
    "rotary_base": "rotary_base",
    "rope_scaling": "use_rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
}
"""GPTModel keyword (a family's `model_kwargs`) -> the Megatron-LM argument that sets it (--use-rope-scaling,
--rope-scaling-factor: Llama 3's rope)."""


def megatron_args(arch: ModelArch, layout: ParallelLayout, dtype: torch.dtype) -> dict[str, Any]:
    """The Megatron-LM arguments that build this model (the names its check_checkpoint_args reads).

    The layer options (q/k/v bias, per-head q/k norm, norm type, gated silu MLP) come from the family's
    TransformerConfig fields and the positions from its GPTModel kwargs, so a family's choice reaches the
    checkpoint without this function naming a family; a GPTModel kwarg without a Megatron-LM argument is an error.
    """
    import torch.nn.functional as F

    layer = arch.family.transformer_config_fields(arch)
    positions = arch.family.model_kwargs(arch)
    unknown = sorted(set(positions) - set(POSITION_ARGS))
    if unknown:
        raise ValueError(f"model_type {arch.model_type!r}: GPTModel kwargs {unknown} have no Megatron-LM argument in "
                         "checkpoint_convert/hf_to_mcore.py POSITION_ARGS")
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "group_query_attention": arch.num_kv_heads != arch.num_heads,
        "num_query_groups": arch.num_kv_heads,
        "kv_channels": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "padded_vocab_size": padded_vocab_size(arch.vocab_size, layout.tp),
        "make_vocab_size_divisible_by": 128,
        "max_position_embeddings": arch.max_position_embeddings,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "norm_epsilon": arch.rms_norm_eps,
        "untie_embeddings_and_output_weights": not arch.tie_word_embeddings,
        "add_qkv_bias": layer["add_qkv_bias"],
        "qk_layernorm": layer["qk_layernorm"],
        "add_bias_linear": layer["add_bias_linear"],
        "swiglu": layer["gated_linear_unit"] and layer["activation_func"] is F.silu,
        "normalization": layer["normalization"],
        "hidden_dropout": layer["hidden_dropout"],
        "attention_dropout": layer["attention_dropout"],
        **{POSITION_ARGS[k]: v for k, v in positions.items()},
        "params_dtype": dtype,
        "ckpt_format": "torch_dist",
        "use_dist_ckpt": True,
        "iteration": 0,
        **(moe_args(layer) if arch.is_moe else {}),
    }


MOE_ARGS: dict[str, str] = {
    "num_moe_experts": "num_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_layer_freq": "moe_layer_freq",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
}
"""megatron-core MoE TransformerConfig field (a family's `transformer_config_fields`) -> the Megatron-LM argument
that sets it (--num-experts, --moe-router-topk, ...)."""


def moe_args(layer: dict[str, Any]) -> dict[str, Any]:
    """The Megatron-LM MoE arguments of a family's TransformerConfig fields. The expert-parallel size is not
    among them: the checkpoint holds every expert on a global axis and loads at any --expert-model-parallel-size
    (Megatron-LM's check_checkpoint_args does not compare it)."""
    return {arg: layer[field] for field, arg in MOE_ARGS.items() if field in layer}


def common_state(arch: ModelArch, layout: ParallelLayout, dtype: torch.dtype, hf_config: dict[str, Any]) -> dict:
    """common.pt: Megatron-LM's `args` (a Namespace), iteration 0, and the HF config for the way back."""
    return {
        "args": argparse.Namespace(**megatron_args(arch, layout, dtype)),
        "iteration": 0,
        "checkpoint_version": 3.0,
        "hf_config": hf_config,
        "format": FORMAT,
    }


def describe(arch: ModelArch, layout: ParallelLayout, dtype: torch.dtype, hf_config: dict[str, Any],
             impl: str = "transformer_engine") -> str:
    """Megatron args and the global shape of every stored tensor (under layer implementation `impl`'s keys), as
    printable text."""
    padded = padded_vocab_size(arch.vocab_size, layout.tp)
    args = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in megatron_args(arch, layout, dtype).items()}
    lines = ["megatron args:", json.dumps(args, indent=2),
             f"tensors ({dtype}, global shapes, layer axis first where stacked, then the expert axis; {impl} keys):"]
    total = 0
    for stored in stored_tensors(arch, impl):
        shape = global_shape(stored.entry, arch, padded)
        total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        lines.append(f"  {stored.key} {list(shape)}")
    lines.append(f"total {total / 1e9:.3f} GB; each of tp={layout.tp} x pp={layout.pp} ranks loads its part")
    return "\n".join(lines)


def hf_to_mcore(cfg: HfToMcoreConfig) -> dict[str, Any]:
    """Convert; returns the common state written to common.pt (or that would be, for a dry run)."""
    hf_config = read_hf_config(cfg.hf_path, flag="--hf-path")
    try:  # the family from config.json's model_type: an unknown one lists the registered ones (models/registry.py)
        arch = ModelArch.from_hf(cfg.hf_path)  # the same file, named in its errors
    except ValueError as err:
        raise UserError(f"--hf-path {err}") from err
    validate_layout(arch, cfg.layout)  # the one layout check: heads, kv heads, ffn vs TP; layers vs PP
    if cfg.dry_run:
        dtype = DTYPES[cfg.dtype or "bf16"]
        print(describe(arch, cfg.layout, dtype, hf_config, cfg.transformer_impl))
        return common_state(arch, cfg.layout, dtype, hf_config)
    if os.path.exists(cfg.save) and not cfg.overwrite:
        raise FileExistsError(f"--save {cfg.save} already exists; pass --overwrite to replace it")
    with HFCheckpointReader(cfg.hf_path) as reader:
        reader.check_unquantized()
        prefixes, why = dropped_hf_tensors(arch)
        src_dtype = reader.dtype(ignore=buffer_hf_names(arch) | {n for n in reader.specs if n.startswith(prefixes)})
        if cfg.dtype is None:
            check_dtype(config_dtype(hf_config), src_dtype, declared_from=f"{cfg.hf_path}/config.json",
                        actual_from=f"--hf-path {cfg.hf_path}")
        # every tensor consumed by the mapping or named: a missing, reshaped or unplaceable one is an error
        skipped = reader.check_expected(hf_tensor_specs(arch, src_dtype), model=f"model_type {arch.model_type!r}",
                                        dropped=prefixes)
        if skipped:
            print(f"hf-to-mcore: {dropped_notice(skipped, prefixes, why)}", flush=True)
        dtype = DTYPES[cfg.dtype] if cfg.dtype else src_dtype
        padded = padded_vocab_size(arch.vocab_size, cfg.layout.tp)
        chunk_bytes = cfg.chunk_bytes
        planned = planned_offsets(hf_tensor_specs(arch, dtype))  # mcore-to-hf's default output layout
        impl = cfg.transformer_impl
        tensors = {t.key: _entry_tensor(reader, t, arch, padded, entry_dtype(t.entry, dtype), chunk_bytes, planned)
                   for t in stored_tensors(arch, impl)}
        common = common_state(arch, cfg.layout, dtype, hf_config)
        with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:
            write_dist_checkpoint(os.path.join(tmp, ITERATION_DIR), tensors, extra_state_objects(arch, impl), common,
                                  threads=cfg.threads)
            write_tracker(tmp)
            copy_assets(cfg.hf_path, os.path.join(tmp, ASSETS_DIR))
    return common
