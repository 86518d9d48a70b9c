"""A full disk during a checkpoint save is one clear error, not a traceback from a forked writer.

The write is made to fail with OSError(ENOSPC) where megatron's writer puts each `.distcp` item
(filesystem_async._write_item, also inside its forked worker processes), or inside torch.save's own writes
(tests/disk_full.py: the files megatron's writer and the common.pt save open fill up, as a real full disk does: torch's
zip writer then raises "unexpected pos", issue 38 item 5); the save must raise a UserError naming the --save directory
and its free space, the line `python -m megatron_dapo.train` prints as `error: ...`, and leave no `step_N.tmp`.
"""

from __future__ import annotations

import errno
import shutil

import pytest

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import CheckpointSaver
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from tests.disk_full import fill_disk_after
from tests.dist.actor_common import load_hf_weights, tiny_hf_model


@pytest.fixture(scope="module")
def actor():
    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=3)
    actor = MegatronActor(ModelArch.from_hf(hf.config), ActorConfig(lr=1e-3), layout)
    load_hf_weights(actor, hf)
    yield actor
    destroy_parallel()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_in_save_is_one_error_naming_the_path_and_free_space(actor, tmp_path, monkeypatch, async_save):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_write_item", _no_space)
    saver = CheckpointSaver(tmp_path / "ckpt", async_save=async_save)
    with pytest.raises(UserError) as err:
        saver.save(1, actor, extra={})
        saver.close()  # --async-save: the forked write's failure arrives at the finalisation
    message = str(err.value)
    free_gib = shutil.disk_usage(tmp_path).free / 2**30
    assert "no space left on device" in message and str(tmp_path / "ckpt") in message, message
    assert "GiB free" in message and abs(float(message.split(" GiB free")[0].split("(")[-1]) - free_gib) < 1.0
    assert "\n" not in message
    assert not (tmp_path / "ckpt" / "latest").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [], "the unfinished step_0000001.tmp is removed"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["distcp", "common"])
def test_a_disk_filling_inside_torch_save_is_one_error_and_leaves_no_tmp(actor, tmp_path, monkeypatch, async_save,
                                                                         where):
    """The disk fills after 20,000 bytes of a `.distcp` file, in the middle of a record (torch's zip writer then
    raises "unexpected pos", the OSError only its context, which the forked writer's queue drops: what a real full
    disk gave, a tmpfs in tests/probes/cases_checkpoint.py), or after 1 KiB of common.pt (torch.save to a path reports
    it with no errno at all)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.checkpoint import training

    fill_disk_after(monkeypatch, *((filesystem_async, 20_000) if where == "distcp" else (training, 1024)))
    saver = CheckpointSaver(tmp_path / "ckpt", async_save=async_save)
    with pytest.raises(UserError) as err:
        saver.save(1, actor, extra={})
        saver.close()
    message = str(err.value)
    assert message.startswith("no space left on device writing a checkpoint (--save") and "GiB free" in message
    assert f"to {tmp_path / 'ckpt'} (" in message and "the unfinished step_0000001.tmp was removed" in message
    assert "\n" not in message and "unexpected pos" not in message, message
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []
