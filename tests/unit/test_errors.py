"""megatron_dapo/errors.py: the one-line messages shared by every writer (disk full)."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from megatron_dapo import errors
from megatron_dapo.errors import UserError, disk_full_error, is_disk_full

Usage = namedtuple("Usage", "total used free")


def test_disk_full_error_names_what_the_path_and_the_free_space_of_the_nearest_existing_parent(tmp_path, monkeypatch):
    probed = []

    def fake_usage(path):
        probed.append(path)
        return Usage(total=10 * 2**30, used=0, free=int(1.234 * 2**30))

    monkeypatch.setattr(errors.shutil, "disk_usage", fake_usage)
    target = tmp_path / "not" / "yet" / "model.safetensors"
    err = disk_full_error(target, "the HF export")
    assert isinstance(err, UserError) and err.echo
    assert probed == [tmp_path]
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"no space left on device writing the HF export to {target} "
                              f"(1.23 GiB free on {tmp_path})")


def test_disk_full_error_reports_the_real_free_space(tmp_path):
    free = shutil.disk_usage(tmp_path).free / 2**30
    message = str(disk_full_error(str(tmp_path / "x.bin"), "a shard"))
    reported = float(message.split("(")[1].split(" GiB")[0])
    assert abs(reported - free) < 0.05, message


def _raised_during(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 (the implicit __context__ is the point: torch.save's RuntimeError)
    except BaseException as err:
        return err


@pytest.mark.parametrize("err, full", [
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), True, id="enospc"),
    pytest.param(OSError(errno.EDQUOT, "Disk quota exceeded"), True, id="edquot"),
    pytest.param(_raised_during(OSError(errno.ENOSPC, "full"), RuntimeError("unexpected pos 46 vs 0")), True,
                 id="torch-save-runtime-error"),
    pytest.param(OSError(errno.EACCES, "Permission denied"), False, id="eacces"),
    pytest.param(_raised_during(OSError(errno.EIO, "io"), RuntimeError("x")), False, id="runtime-error-of-eio"),
])
def test_is_disk_full_looks_through_the_exception_chain(err, full):
    assert is_disk_full(err) is full
