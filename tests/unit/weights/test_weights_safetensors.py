"""The streaming safetensors writer/reader against the `safetensors` package."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_dapo.weights.safetensors_io import (
    CheckpointError,
    PositionalSafetensorsWriter,
    SafetensorsFile,
    StreamingSafetensorsWriter,
    TensorSpec,
    write_safetensors,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.fp32": torch.randn(7, generator=g),
        "c.fp16": torch.randn(2, 2, 2, generator=g).half(),
        "d.int64": torch.arange(5),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.zeros(0, 4),
        "g.bool": torch.tensor([True, False, True]),
    }


def test_written_file_loads_with_safetensors_package(tmp_path: Path) -> None:
    tensors = _tensors()
    write_safetensors(tmp_path / "x.safetensors", tensors.items(), metadata={"format": "pt"})
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name


def test_reader_reads_safetensors_package_files(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "y.safetensors", metadata={"k": "v"})
    with SafetensorsFile(tmp_path / "y.safetensors") as f:
        assert f.metadata == {"k": "v"}
        assert set(f.names()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get(name), t), name


def test_writer_enforces_declared_order_shape_and_completeness(tmp_path: Path) -> None:
    specs = [TensorSpec("x", torch.float32, (2,)), TensorSpec("y", torch.float32, (3,))]
    w = StreamingSafetensorsWriter(tmp_path / "w.safetensors", specs)
    with pytest.raises(ValueError, match=r"expected x torch.float32 \[2\] next, got y"):
        w.write("y", torch.zeros(3))
    with pytest.raises(ValueError, match=r"expected x .* got x torch.float32 \[4\]"):
        w.write("x", torch.zeros(4))
    w.write("x", torch.zeros(2))
    with pytest.raises(ValueError, match="1 tensor\\(s\\) unwritten: \\['y'\\]"):
        w.close()


def test_positional_writer_any_order_from_threads_equals_the_package_file(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    tensors = _tensors()
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    w = PositionalSafetensorsWriter(tmp_path / "p.safetensors", specs, metadata={"format": "pt"})
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda item: w.write(*item), reversed(list(tensors.items()))))
    w.close()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    with safe_open(tmp_path / "p.safetensors", framework="pt") as f:
        assert all(torch.equal(f.get_tensor(n), t) for n, t in tensors.items())
    write_safetensors(tmp_path / "s.safetensors", tensors.items(), metadata={"format": "pt"})
    assert (tmp_path / "p.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()
    w = PositionalSafetensorsWriter(tmp_path / "q.safetensors", specs[:2])
    with pytest.raises(ValueError, match=r"a.bf16 declared torch.bfloat16 \[3, 5\], got rows 0:3 of torch.float32"):
        w.write("a.bf16", torch.zeros(3, 5))
    w.write("b.fp32", torch.zeros(7))
    w.write_rows("a.bf16", 1, torch.zeros(2, 5, dtype=torch.bfloat16))  # rows 1:3 only; row 0 missing
    with pytest.raises(ValueError, match=r"1 tensor\(s\) unwritten: \['a.bf16'\]"):
        w.close()


@pytest.mark.parametrize("kernel", ["copy_file_range", "short-then-EXDEV", "no-copy_file_range"])
def test_copy_rows_from_another_file_equals_write_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """copy_rows copies row ranges file to file in the kernel; where the kernel refuses part way (EXDEV
    after 7 bytes: not a row boundary) or has no copy_file_range, the rest goes through a mapped pwrite."""
    import errno
    import os

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 5, generator=g).to(torch.bfloat16), torch.randn(9, generator=g)
    (tmp_path / "src.bin").write_bytes(b"x" * 13 + a.view(torch.uint8).numpy().tobytes() + b.numpy().tobytes())
    if kernel == "short-then-EXDEV":
        real, calls = os.copy_file_range, []

        def short(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
            calls.append(count)
            if len(calls) % 2 == 0:
                raise OSError(errno.EXDEV, "cross-device")
            return real(src, dst, min(count, 7), offset_src, offset_dst)

        monkeypatch.setattr(os, "copy_file_range", short)
    elif kernel == "no-copy_file_range":
        monkeypatch.delattr(os, "copy_file_range")
    specs = [TensorSpec("a", torch.bfloat16, (6, 5)), TensorSpec("b", torch.float32, (9,))]
    w = PositionalSafetensorsWriter(tmp_path / "out.safetensors", specs)
    fd = os.open(tmp_path / "src.bin", os.O_RDONLY)
    try:
        w.copy_rows("a", 4, 2, fd, 13 + 4 * 10)  # rows 4:6 first, then 0:4: any order
        w.copy_rows("a", 0, 4, fd, 13)
        w.copy_rows("b", 0, 9, fd, 13 + a.numel() * 2)
        with pytest.raises(ValueError, match=r"a declared \[6, 5\], got rows 5:7"):
            w.copy_rows("a", 5, 2, fd, 13)
    finally:
        os.close(fd)
    w.close()  # complete: copy_rows counted every row
    write_safetensors(tmp_path / "ref.safetensors", {"a": a, "b": b}.items())
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_truncated_and_corrupt_files_give_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(path)
    path.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsFile(path)
    header = b"{not json" + b" " * 7
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        SafetensorsFile(path)
    bad = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(bad)) + bad + b"\0" * 8)
    with pytest.raises(CheckpointError, match="spans 8 bytes, its shape needs 16"):
        SafetensorsFile(path)
    with pytest.raises(CheckpointError, match="missing safetensors file"):
        SafetensorsFile(tmp_path / "absent.safetensors")
