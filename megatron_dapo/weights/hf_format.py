"""HF checkpoint directories: a lazy multi-shard reader and a streaming sharded writer.

Layout written (what transformers and SGLang load): `config.json`, `model-0000i-of-0000n.safetensors`
shards of at most `max_shard_bytes` each (a tensor is never split), `model.safetensors.index.json`
with the weight map, and the tokenizer files. A single shard is named `model.safetensors` with no index.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Collection, Sequence

import torch

from megatron_dapo.weights.safetensors_io import (
    CheckpointError,
    PositionalSafetensorsWriter,
    SafetensorsFile,
    TensorSpec,
    safetensors_header,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_SHARD_BYTES = 5 * 1024**3


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The {tensor name: shard file} map of an HF index; CheckpointError naming the file when it is damaged."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read it ({e.strerror})") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{index_path} is corrupt: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index_path} is corrupt: no \"weight_map\" object of tensor name -> shard file")
    return weight_map


class HFCheckpointReader:
    """All tensors of an HF safetensors checkpoint by name; headers parsed on open, data read on `get`."""

    def __init__(self, hf_dir: str | os.PathLike[str]) -> None:
        self.dir = os.fspath(hf_dir)
        index_path = os.path.join(self.dir, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = _read_weight_map(index_path)
        elif os.path.isfile(os.path.join(self.dir, SINGLE_FILE)):
            weight_map = {}
        else:
            raise CheckpointError(
                f"{self.dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}: not an HF "
                "safetensors checkpoint (convert .bin checkpoints with save_pretrained first)"
            )
        shard_names = sorted(set(weight_map.values())) or [SINGLE_FILE]
        missing = [s for s in shard_names if not os.path.isfile(os.path.join(self.dir, s))]
        if missing:
            raise CheckpointError(f"{self.dir}: shard(s) {missing} listed in {INDEX_FILE} are missing")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        try:
            for shard in shard_names:
                f = self._files[shard] = SafetensorsFile(os.path.join(self.dir, shard))
                for name in f.names():
                    self._where[name] = f
        except Exception:
            self.close()
            raise
        absent = [n for n, s in weight_map.items() if n not in self._files[s].specs]
        if absent:
            raise CheckpointError(f"{self.dir}: {INDEX_FILE} lists tensors its shards lack: {absent[:5]}")

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {n: f.specs[n] for n, f in self._where.items()}

    def check_unquantized(self) -> None:
        """Raise CheckpointError, one line, on an FP8 block-quantized checkpoint (DeepSeek-V3's release format: fp8
        weights each with a `weight_scale_inv` of per-128x128-block scales), which nothing here de-quantizes."""
        scales = [n for n in self.specs if n.endswith(FP8_SCALE_SUFFIX)]
        if scales:
            raise CheckpointError(
                f"{self.dir} is an FP8 block-quantized checkpoint ({len(scales)} tensor(s) named *{FP8_SCALE_SUFFIX}, "
                "e.g. " + scales[0] + "): de-quantize it to bf16 first (DeepSeek-V3's inference/fp8_cast_bf16.py "
                "writes that copy) and point at the bf16 directory")

    def check_expected(self, expected: Sequence[TensorSpec], *, model: str = "",
                       dropped: tuple[str, ...] = ()) -> list[str]:
        """Raise CheckpointError, one line, unless the checkpoint holds exactly the tensors of the config-derived
        `expected` (names and shapes): it names the tensors missing, those of another shape, and those the model
        has no place for, which a load would otherwise drop in silence (a Qwen2 checkpoint's q/k/v biases under a
        config.json that says llama). `model` says what config.json describes (e.g. "model_type 'llama'"). Derived
        buffers transformers ignores too (`IGNORED_TENSORS`) are not counted. Reads the headers only (parsed on
        open): milliseconds, also at Qwen2.5-32B's 771 tensors or Qwen3-30B-A3B's 18,867. Tensors under a `dropped`
        name prefix (what the family leaves out on purpose, `ModelFamily.dropped_hf_tensors`) are no problem: their
        names are returned, for the caller to say what it skips."""
        have = self.specs
        want = {s.name: s for s in expected}
        missing = [n for n in want if n not in have]
        reshaped = [f"{n} {list(have[n].shape)} (config.json implies {list(s.shape)})"
                    for n, s in want.items() if n in have and have[n].shape != s.shape]
        skipped = [n for n in have if n not in want and n.startswith(dropped)] if dropped else []
        extra = [n for n in have if n not in want and not IGNORED_TENSORS.search(n) and not self._tied_copy(n, want)
                 and not (dropped and n.startswith(dropped))]
        problems = [_listing(f"{len(missing)} tensor(s) missing", missing),
                    _listing(f"{len(reshaped)} tensor(s) of another shape", reshaped),
                    _listing(f"{len(extra)} tensor(s) this model has no place for (a load would drop them)", extra)]
        problems = [p for p in problems if p]
        if problems:
            what = f" ({model})" if model else ""
            raise CheckpointError(f"{self.dir} does not match its config.json{what}: " + "; ".join(problems)
                                  + ": does config.json describe these weights?")
        return skipped

    def _tied_copy(self, name: str, want: dict[str, TensorSpec]) -> bool:
        """Whether `name` is the output head a tied model's checkpoint may store besides its embedding
        (TIED_HEADS: some exporters write both), holding the same values: nothing is lost by not loading it. A head
        that differs is counted as a tensor with no place, so the load names it. Reads both tensors (a tied model
        is a small one: 0.27 GB each at Qwen2.5-0.5B)."""
        source = TIED_HEADS.get(name)
        if source is None or name in want or source not in want or source not in self._where:
            return False
        return torch.equal(self.get(name), self.get(source))

    def dtype(self, ignore: Collection[str] = ()) -> torch.dtype:
        """The checkpoint's floating dtype (the converter keeps it unless --dtype says otherwise), over its tensors
        but those named in `ignore` (buffers kept in fp32, tensors the family leaves out)."""
        dtypes = {spec.dtype for f in self._where.values() for name, spec in f.specs.items() if name not in ignore}
        if len(dtypes) != 1:
            raise CheckpointError(f"{self.dir} mixes dtypes {sorted(map(str, dtypes))}; pass --dtype")
        return dtypes.pop()

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.dir} has no tensor {name!r}")
        return f.get(name)

    def map_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of tensor `name`, memory-mapped read-only (thread-safe; see map_file_tensor)."""
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.dir} has no tensor {name!r}")
        return f.map_rows(name, start, stop)

    def byte_range(self, name: str, start: int, stop: int) -> tuple[int, int]:
        """(fd, file offset) where the raw bytes of rows start:stop of tensor `name` lie contiguously (thread-safe;
        the fd stays open until `close`)."""
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"{self.dir} has no tensor {name!r}")
        return f.byte_range(name, start, stop)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


FP8_SCALE_SUFFIX = "weight_scale_inv"
"""The name ending of an FP8 block-quantized checkpoint's scale tensors (`HFCheckpointReader.check_unquantized`)."""

IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""HF tensors no model parameter is built from: RoPE's inverse frequencies, which older checkpoints saved per layer
and every reader derives from rope_theta (transformers skips them on load for the same reason)."""


TIED_HEADS = {"lm_head.weight": "model.embed_tokens.weight"}
"""{head: embedding} of a tied model in transformers' CausalLM naming (its `_tied_weights_keys`): when config.json
ties them, the mapping has no place for the head, and a stored copy equal to the embedding is not a lost tensor."""


def _listing(head: str, names: Sequence[str], shown: int = 3) -> str:
    """`head` and the first `shown` of `names`, e.g. "2 tensor(s) missing: a, b"; '' when there are none."""
    if not names:
        return ""
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return f"{head}: {', '.join(names[:shown])}{more}"


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most max_shard_bytes (one oversized tensor = one shard)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def planned_offsets(specs: Sequence[TensorSpec], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, int]:
    """File offset of each tensor's data in its shard, as HFShardedWriter(specs, max_shard_bytes) lays them out.

    hf-to-mcore places each stored chunk at the same offset modulo the page size as it will have in the
    default mcore-to-hf output, so that copy is page-aligned on both sides (see dist_ckpt.Chunk.page_offset).
    """
    offsets: dict[str, int] = {}
    for shard in plan_shards(specs, max_shard_bytes):
        _, at = safetensors_header("", shard, metadata=_SHARD_METADATA)
        offsets.update((spec.name, o) for spec, o in zip(shard, at, strict=True))
    return offsets


_SHARD_METADATA = {"format": "pt"}


class HFShardedWriter:
    """Write an HF checkpoint's tensors in any order, from several threads at once.

    Every shard file is created with its header up front (the plan is fixed by `specs` and
    max_shard_bytes); `write` pwrites a tensor at its offset in its shard.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        self.dir = os.fspath(out_dir)
        self._shards = plan_shards(specs, max_shard_bytes)
        n = len(self._shards)
        self._names = (
            [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._files: list[PositionalSafetensorsWriter] = []
        self._shard_index = {spec.name: i for i, shard in enumerate(self._shards) for spec in shard}
        try:
            for name, shard in zip(self._names, self._shards, strict=True):
                self._files.append(
                    PositionalSafetensorsWriter(os.path.join(self.dir, name), shard, metadata=_SHARD_METADATA))
        except BaseException:
            self.abort()
            raise
        self.total_bytes = sum(s.nbytes for s in specs)

    def shard_of(self, name: str) -> int:
        """Index of the shard file tensor `name` goes to (file order)."""
        if name not in self._shard_index:
            raise ValueError(f"{self.dir}: {name} is not a planned tensor")
        return self._shard_index[name]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor `name` (thread-safe; each tensor once)."""
        self._files[self.shard_of(name)].write(name, tensor)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write rows start:start+len(rows) of tensor `name` (thread-safe; each row once)."""
        self._files[self.shard_of(name)].write_rows(name, start, rows)

    def copy_rows(self, name: str, start: int, rows: int, src_fd: int, src_offset: int) -> None:
        """Write rows start:start+rows of tensor `name` from file `src_fd` at `src_offset`, in the kernel
        (PositionalSafetensorsWriter.copy_rows; thread-safe; each row once)."""
        self._files[self.shard_of(name)].copy_rows(name, start, rows, src_fd, src_offset)

    def close(self) -> None:
        """Close every shard (each checks it is complete) and write the index when there are several."""
        for f in self._files:
            f.close()
        if len(self._shards) > 1:
            weight_map = {name: self._names[i] for name, i in self._shard_index.items()}
            with open(os.path.join(self.dir, INDEX_FILE), "w") as f:
                json.dump(
                    {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2
                )

    def abort(self) -> None:
        for f in self._files:
            f.abort()


def copy_assets(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer/generation files that exist in src_dir; returns the names copied."""
    copied = []
    for name in ASSET_FILES:
        src = os.path.join(os.fspath(src_dir), name)
        if os.path.isfile(src):
            os.makedirs(dst_dir, exist_ok=True)
            shutil.copy2(src, os.path.join(os.fspath(dst_dir), name))
            copied.append(name)
    return copied
