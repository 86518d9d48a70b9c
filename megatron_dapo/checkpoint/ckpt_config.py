"""Config checks that run before any tensor is read: a checkpoint's stored config against the flags.

A model that loads with the wrong rope theta, vocab or tied head trains silently wrong (slime #1059),
so every field that changes the maths is compared, and a mismatch is an error naming both values and
where each came from. Tensor geometry is checked from checkpoint metadata alone (global shapes), so a
wrong-sized checkpoint fails in milliseconds, not after gigabytes were read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.layout import global_shape
from megatron_dapo.weights.mapping import (
    MappingEntry,
    arch_mapping,
    dist_key,
    entry_in_layer,
    layer_dist_key,
    stacked_layers,
)
from megatron_dapo.weights.safetensors_io import CheckpointError

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# (label, function of the arch): every arch field that changes the forward pass.
_FIELDS: tuple[tuple[str, Callable[[ModelArch], Any]], ...] = (
    ("model_type", lambda a: a.model_type),
    ("vocab_size", lambda a: a.vocab_size),
    ("hidden_size", lambda a: a.hidden_size),
    ("intermediate_size", lambda a: a.intermediate_size),
    ("num_hidden_layers", lambda a: a.num_layers),
    ("num_attention_heads", lambda a: a.num_heads),
    ("num_key_value_heads", lambda a: a.num_kv_heads),
    ("head_dim", lambda a: a.head_dim),
    ("rope_theta", lambda a: a.rope_theta),
    ("rms_norm_eps", lambda a: a.rms_norm_eps),
    ("tie_word_embeddings", lambda a: a.tie_word_embeddings),
    ("qkv_bias", lambda a: a.qkv_bias),
    ("qk_layernorm", lambda a: a.qk_layernorm),
    ("family_options", lambda a: a.family_options),
    # mixture of experts (0 / () for a dense model). router_aux_loss_coef is left out: it weights a training
    # loss term (--moe-aux-loss-coeff overrides it), the forward pass is the same.
    ("num_experts", lambda a: a.num_experts),
    ("num_experts_per_tok", lambda a: a.num_experts_per_tok),
    ("moe_intermediate_size", lambda a: a.moe_intermediate_size),
    ("norm_topk_prob", lambda a: a.norm_topk_prob),
    ("moe_layers (mlp_only_layers, decoder_sparse_step)", lambda a: a.moe_layers),
)


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """A JSON object from `path`; errors name the file (and `what` points at, e.g. the flag)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: {path} not found")
    try:
        with open(path) as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what}: {path} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{what}: {path} holds a {type(value).__name__}, expected a JSON object")
    return value


def read_hf_config(model_dir_or_file: str | os.PathLike[str], *, flag: str) -> dict[str, Any]:
    """config.json of an HF model directory (or the file itself), with the file named in errors."""
    path = os.fspath(model_dir_or_file)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    return read_json(path, what=flag)


def config_dtype(hf_config: dict[str, Any]) -> torch.dtype | None:
    """The dtype config.json declares (`torch_dtype`, or `dtype` in transformers >= 5), if any."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return DTYPE_NAMES.get(name) if isinstance(name, str) else None


def check_same_arch(stored: ModelArch, requested: ModelArch, *, stored_from: str, requested_from: str) -> None:
    """Raise CheckpointError listing every architecture field where the two configs differ."""
    wrong = [
        f"{label}: {stored_from} has {get(stored)!r}, {requested_from} has {get(requested)!r}"
        for label, get in _FIELDS
        if get(stored) != get(requested)
    ]
    if wrong:
        raise CheckpointError("config mismatch:\n  " + "\n  ".join(wrong))


def check_dtype(declared: torch.dtype | None, actual: torch.dtype, *, declared_from: str, actual_from: str) -> None:
    if declared is not None and declared != actual:
        raise CheckpointError(
            f"dtype mismatch: {declared_from} declares {declared}, but the tensors of {actual_from} are {actual}; "
            "pass --dtype "
            "to cast deliberately"
        )


@dataclass(frozen=True)
class StoredTensor:
    """One model tensor of a dist checkpoint of an arch: its key, its mapping entry and the global layers it holds.

    Dense and all-MoE models stack the decoder layers on a leading axis (one key per entry, `layers` = every
    layer); a mixed dense / MoE model has one key per layer (`decoder.layers.{L}.…`: megatron-core 0.16.1's
    TransformerBlock.sharded_state_dict under a `moe_layer_freq` list, `mapping.stacked_layers`). An expert entry
    has all E experts of a layer on a leading expert axis (after the layer axis when stacked), whatever the EP.
    """

    key: str
    entry: MappingEntry
    layers: tuple[int | None, ...]
    """Global layers held: all of them on axis 0 when `stacked`, else the one in the key; (None,) off the layers."""
    stacked: bool

    def index(self, layer: int | None, expert: int | None) -> tuple[int, ...]:
        """Leading indices of (global `layer`, global `expert`) in the stored tensor; the HF rows follow them."""
        return (*((layer,) if self.stacked else ()), *((expert,) if self.entry.per_expert else ()))

    def hf_sources(self, arch: ModelArch) -> Iterator[tuple[int | None, int | None]]:
        """(layer, expert) of each HF tensor group the stored tensor is made of, in HF file order."""
        for layer in self.layers:
            for expert in range(arch.num_experts) if self.entry.per_expert else (None,):
                yield layer, expert


def stored_tensors(arch: ModelArch, impl: str = "transformer_engine") -> list[StoredTensor]:
    """Every model tensor of a dist checkpoint of `arch` (tied: no output layer), in table order, under the keys a
    model of layer implementation `impl` saves and asks for (`mapping.layer_dist_key`: the two differ only in an
    MoE layer's pre-MLP norm). The converter writes the TE ones (`hf_to_mcore`), what every GPU run loads.

    At Qwen3-30B-A3B (48 all-MoE layers, stacked): 12 keys; the two expert keys are [48, 128, 1536, 2048] (fc1,
    38.7 GB bf16) and [48, 128, 2048, 768] (fc2, 19.3 GB), the pre-MLP norms `decoder.layers.pre_mlp_layernorm.weight`
    [48, 2048] under TE (`decoder.layers.mlp.linear_fc1.layer_norm_weight` under the local spec). A mixed model of L
    layers has one key per layer entry.
    """
    stacked = stacked_layers(arch)
    out: list[StoredTensor] = []
    for e in arch_mapping(arch):
        if e.tied_hf and arch.tie_word_embeddings:
            continue
        if e.stage != "layer":
            out.append(StoredTensor(dist_key(e), e, (None,), False))
            continue
        layers = tuple(layer for layer in range(arch.num_layers) if entry_in_layer(e, arch, layer))
        if not layers:  # e.g. the dense MLP of an all-MoE model
            continue
        if stacked:  # every stacked layer is of one kind (all dense, or all MoE): the first names them all
            out.append(StoredTensor(layer_dist_key(e, arch, layers[0], impl), e, layers, True))
        else:
            out += [StoredTensor(layer_dist_key(e, arch, layer, impl), e, (layer,), False) for layer in layers]
    return out


def checkpoint_impl(keys: Collection[str], arch: ModelArch) -> str:
    """The layer implementation whose keys a dist checkpoint of `arch` holds (`keys`: its stored keys): 'local' when
    it has a tensor under a key only the local spec uses (an MoE layer's pre-MLP norm under the fused name, as a
    local-spec run or an older converter saved it), else 'transformer_engine' (a dense model's keys are both)."""
    local_only = {t.key for t in stored_tensors(arch, "local")} - {t.key for t in stored_tensors(arch)}
    return "local" if any(k in local_only for k in keys) else "transformer_engine"


def stored_key_renames(arch: ModelArch, stored: Collection[str]) -> dict[str, str]:
    """{key a model of either layer implementation asks for: the key the checkpoint (`stored`: its keys) holds the
    same tensor under}, for the tensors whose keys differ between the two (an MoE layer's pre-MLP norm), where the
    checkpoint has the other implementation's. Empty for a dense model, and for a checkpoint of the model's own."""
    renames = {}
    for te, local in zip(stored_tensors(arch), stored_tensors(arch, "local"), strict=True):
        if te.key == local.key:
            continue
        for want, have in ((te.key, local.key), (local.key, te.key)):
            if want not in stored and have in stored:
                renames[want] = have
    return renames


def request_stored_keys(sharded: Any, arch: ModelArch, stored: Collection[str]) -> None:
    """Point, in place, every tensor of a model's `sharded` state dict (its `sharded_state_dict()`, before the
    optimizer's is built from it, so the optimizer's keys follow) whose key `stored` lacks at the key the
    checkpoint holds it under (`stored_key_renames`): a local-spec checkpoint loads into a TE model and the reverse.
    The state-dict names (what `load_state_dict` sees) do not change; a key neither spelling of which is stored
    stays as it is, for dist_checkpointing to name.
    Cost: one walk over the sharded state dict, no tensor data: at Qwen3-30B-A3B EP8 ~3,600 entries a rank (48
    layers x 16 local experts x 2 linears x (weight, extra state), and the rest); the renamed key is one [48, 2048].
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    renames = stored_key_renames(arch, stored)
    if not renames:  # a dense model, or a checkpoint of the model's own implementation
        return
    for value in nested_values(sharded):
        if isinstance(value, ShardedBase) and value.key in renames:
            value.key = renames[value.key]


def expected_global_shapes(arch: ModelArch, padded_vocab: int,
                           impl: str = "transformer_engine") -> dict[str, tuple[int, ...]]:
    """dist-checkpoint key -> global shape of every model tensor of `arch` (tied: no output layer) under the keys of
    layer implementation `impl`."""
    return {t.key: global_shape(t.entry, arch, padded_vocab) for t in stored_tensors(arch, impl)}


def check_global_shapes(shapes: dict[str, tuple[int, ...]], arch: ModelArch, *, source: str, against: str) -> int:
    """Check a dist checkpoint's tensor shapes (from metadata) against `arch`; return its padded vocab.

    The vocab may be padded to any multiple of 128 at or above vocab_size (megatron-core reshards the
    padding at load); every other shape must match exactly. Names the config field behind a mismatch:
    qkv rows -> num_key_value_heads, a missing bias -> qkv bias, an output layer -> tie_word_embeddings, an
    expert tensor -> num_experts / moe_intermediate_size, per-layer vs stacked keys -> mlp_only_layers.
    """
    embedding = next(e for e in arch_mapping(arch) if e.kind == "vocab" and e.stage == "first")
    emb = shapes.get(dist_key(embedding))
    if emb is None:
        raise CheckpointError(f"{source} has no {dist_key(embedding)}: not a {arch.model_type} model checkpoint")
    padded = emb[0]
    if padded < arch.vocab_size or padded % 128:
        raise CheckpointError(
            f"vocab mismatch: {source} has {padded} embedding rows (padded vocab), {against} has vocab_size "
            f"{arch.vocab_size}, which pads to {padded_vocab_size(arch.vocab_size, 1)} (a multiple of 128)"
        )
    expected = expected_global_shapes(arch, padded, checkpoint_impl(shapes, arch))  # a TE or a local-spec save
    problems = []
    for key, want in expected.items():
        have = shapes.get(key)
        if have is None:
            hint = (f" (qkv bias: {arch.model_type} models have one)" if key.endswith("linear_qkv.bias")
                    else _layers_hint(key, shapes, arch) if arch.is_moe else "")
            problems.append(f"{key}: missing in {source}{hint}")
        elif tuple(have) != want:
            hint = (" (num_experts, moe_intermediate_size)" if ".experts." in key or key.endswith("router.weight")
                    else "")
            problems.append(f"{key}: {source} has {list(have)}, {against} implies {list(want)}{hint}")
    if arch.tie_word_embeddings and "output_layer.weight" in shapes:
        problems.append(
            f"output_layer.weight: {source} has an untied output layer, {against} has tie_word_embeddings=true"
        )
    if problems:
        raise CheckpointError("checkpoint does not match the config:\n  " + "\n  ".join(problems[:10]))
    return padded


def _layers_hint(key: str, shapes: dict[str, tuple[int, ...]], arch: ModelArch) -> str:
    """Why an MoE model's key may be missing: the checkpoint stacks the layers where `arch` mixes dense and MoE
    layers (per-layer keys), or the reverse; both come from config.json's mlp_only_layers / decoder_sparse_step."""
    stacked = not any(k.startswith("decoder.layers.") and k.split(".")[2].isdigit() for k in shapes)
    if stacked == stacked_layers(arch):
        return ""
    have, want = ("stacked", "per-layer") if stacked else ("per-layer", "stacked")
    return (f" (the checkpoint has {have} layer keys, the config's MoE layers {list(arch.moe_layers)} of "
            f"{arch.num_layers} imply {want} ones: mlp_only_layers / decoder_sparse_step differ)")
