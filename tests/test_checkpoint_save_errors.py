"""A full disk during a checkpoint save is one clear error, not a traceback from a forked writer.

The write is made to fail with OSError(ENOSPC) where megatron's writer puts each `.distcp` item
(filesystem_async._write_item, also inside its forked worker processes); the save must raise a UserError
naming the --save directory and its free space, the line `python -m megatron_dapo.train` prints as `error: ...`.
"""

from __future__ import annotations

import errno
import shutil

import pytest

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import CheckpointSaver
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
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
