"""Legacy: the per-rank safetensors format checkpoint_convert wrote before torch_dist (read only by
`weights/load.py`'s load_mcore_checkpoint, which nothing in the project calls any more; the converter now
writes megatron-core dist checkpoints, see `weights/dist_ckpt.py`). Kept until that loader is removed.

    <dir>/latest_checkpointed_iteration.txt   "release" (converted) or an iteration number
    <dir>/args.json                           Megatron args + the HF config.json (key "hf_config")
    <dir>/hf_assets/                          tokenizer and generation files copied from the HF model
    <dir>/<release | iter_%07d>/mp_rank_{tp:02d}_{pp:03d}/model.safetensors

Rank directories always carry the `_{pp:03d}` suffix, also when PP = 1 (Megatron drops it there),
so the path of a rank never depends on the layout. Tensor names are megatron-core local-spec names
with stage-local layer numbers, exactly the keys of that stage's `GPTModel.state_dict()`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.parallel import ParallelLayout, padded_vocab_size, validate_layout
from megatron_dapo.weights.safetensors_io import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ARGS_FILE = "args.json"
ASSETS_DIR = "hf_assets"
SHARD_FILE = "model.safetensors"
FORMAT_VERSION = 1
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Megatron args that are a function of the HF config and the layout; checked on every load.
_ARCH_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "padded_vocab_size",
    "untie_embeddings_and_output_weights",
    "rotary_base",
    "norm_epsilon",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)


def iteration_dir(iteration: str | int) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_file(ckpt_dir: str | os.PathLike[str], iteration: str | int, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(
        os.fspath(ckpt_dir), iteration_dir(iteration), f"mp_rank_{tp_rank:02d}_{pp_rank:03d}", SHARD_FILE
    )


def megatron_args(
    arch: Qwen2Arch, layout: ParallelLayout, *, dtype: torch.dtype, hf_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The Megatron arguments that build a model matching `arch` on `layout` (validated first)."""
    validate_layout(arch, layout)
    args: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
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
        "rotary_base": arch.rope_theta,
        "norm_epsilon": arch.rms_norm_eps,
        "untie_embeddings_and_output_weights": not arch.tie_word_embeddings,
        "add_qkv_bias": True,
        "add_bias_linear": False,
        "swiglu": True,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "params_dtype": {v: k for k, v in DTYPES.items()}[dtype],
    }
    if hf_config is not None:
        args["hf_config"] = hf_config
    return args


def check_args(args: dict[str, Any], arch: Qwen2Arch, layout: ParallelLayout, *, source: str) -> None:
    """Raise CheckpointError listing every Megatron arg of `source` that disagrees with arch/layout."""
    expected = megatron_args(arch, layout, dtype=torch.float32)
    wrong = [
        f"{k}: checkpoint has {args.get(k)!r}, expected {expected[k]!r}"
        for k in _ARCH_ARGS
        if args.get(k) != expected[k]
    ]
    if wrong:
        raise CheckpointError(
            f"{source} does not match the requested model/layout:\n  "
            + "\n  ".join(wrong)
            + "\nconvert again with the matching --tp/--pp, or pass the matching HF config"
        )


def read_args(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.path.join(os.fspath(ckpt_dir), ARGS_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} not found: {ckpt_dir} is not a checkpoint written by checkpoint_convert"
        )
    try:
        with open(path) as f:
            args = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e
    if args.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {args.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    return args


def read_iteration(ckpt_dir: str | os.PathLike[str]) -> str | int:
    path = os.path.join(os.fspath(ckpt_dir), TRACKER_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} not found: {ckpt_dir} is not a Megatron checkpoint directory")
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}; expected 'release' or an iteration number")
    return int(text)


def layout_from_args(args: dict[str, Any]) -> ParallelLayout:
    return ParallelLayout(
        tp=int(args["tensor_model_parallel_size"]), pp=int(args["pipeline_model_parallel_size"])
    )


def arch_from_args(args: dict[str, Any], *, source: str) -> Qwen2Arch:
    """Rebuild the arch from the embedded HF config and check it against the Megatron args."""
    if "hf_config" not in args:
        raise CheckpointError(f"{source} has no embedded hf_config; pass --hf-config CONFIG.json")
    arch = Qwen2Arch.from_hf(args["hf_config"])
    check_args(args, arch, layout_from_args(args), source=source)
    return arch
