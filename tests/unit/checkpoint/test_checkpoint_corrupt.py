"""Damaged checkpoints: --load verifies the newest step against its manifest and falls back.

A truncated .distcp or common.pt, or a deleted file, in the newest step makes load_checkpoint resume
from the previous step with a warning that names the file; when every step is damaged the error
names each step directory and its problem (instead of dist_checkpointing's bare EOFError).
"""

from __future__ import annotations

import json
import shutil
import zlib

import pytest

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import (
    CheckpointCorruptError,
    CheckpointFallbackWarning,
    StepLinkError,
    load_checkpoint,
    save_checkpoint,
)
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    load_hf_weights,
    make_samples,
    tiny_hf_model,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(make_actor, pristine checkpoint dir with steps 1 and 2)."""
    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=8)
    arch = ModelArch.from_hf(hf.config)

    def make_actor() -> MegatronActor:
        actor = MegatronActor(arch, ActorConfig(lr=1e-3), layout)
        load_hf_weights(actor, hf)
        return actor

    root = tmp_path_factory.mktemp("ckpt")
    actor = make_actor()
    for step in (1, 2):
        actor.train_step(make_samples(4, seed=step))
        save_checkpoint(root, step, actor, extra={"tag": step})
    yield make_actor, root
    destroy_parallel()


def test_manifest_lists_every_file_with_size_and_crc32(saved):
    step = saved[1] / "step_0000002"
    files = json.loads((step / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in step.iterdir() if p.name != "manifest.json"}
    assert set(files) == on_disk and "common.pt" in files and any(n.endswith(".distcp") for n in files)
    for name, entry in files.items():
        data = (step / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def _damage(step, how: str) -> str:
    if how == "truncate-distcp":
        victim = sorted(step.glob("*.distcp"))[0]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "truncate-common":
        victim = step / "common.pt"
        victim.write_bytes(victim.read_bytes()[:100])
    elif how == "flip-byte":
        victim = sorted(step.glob("*.distcp"))[-1]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim = sorted(step.glob("*.distcp"))[-1]
        victim.unlink()
    return victim.name


def _fallback_messages(record) -> list[str]:
    """The CheckpointFallbackWarnings among the recorded warnings (torch's deprecation warnings come too)."""
    return [str(w.message) for w in record if issubclass(w.category, CheckpointFallbackWarning)]


def _assert_falls_back_to_step_1(root, make_actor, victim: str) -> None:
    """load_checkpoint(root) skips step 2, warning with `victim` (the damaged file) and both steps' names."""
    actor = make_actor()
    with pytest.warns(CheckpointFallbackWarning, match=victim) as record:
        extra = load_checkpoint(root, actor)
    assert extra == {"step": 1, "tag": 1}
    skipped = _fallback_messages(record)[0]
    assert "step_0000002" in skipped and "step_0000001" in skipped


@pytest.mark.parametrize("how", ["truncate-distcp", "truncate-common", "flip-byte", "delete"])
def test_damaged_newest_step_falls_back_with_a_warning(saved, tmp_path, how):
    make_actor, pristine = saved
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    victim = _damage(root / "step_0000002", how)
    _assert_falls_back_to_step_1(root, make_actor, victim)


def test_every_step_damaged_is_a_clear_error(saved, tmp_path):
    make_actor, pristine = saved
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    first = _damage(root / "step_0000001", "truncate-common")
    second = _damage(root / "step_0000002", "delete")
    with pytest.raises(CheckpointCorruptError) as err:
        load_checkpoint(root, make_actor())
    message = str(err.value)
    assert str(root / "step_0000001" / first) in message and str(root / "step_0000002" / second) in message
    assert "truncated" in message and "missing" in message


def test_empty_load_dir_is_a_fresh_run(saved, tmp_path):
    assert load_checkpoint(tmp_path, saved[0]()) is None


@pytest.mark.parametrize("how", ["truncate-distcp", "delete-metadata", "truncate-common"])
def test_damaged_newest_step_without_manifest_falls_back_with_a_warning(saved, tmp_path, how):
    """A step with no manifest.json (an older checkpoint, or the manifest lost) is checked against its own
    `.metadata` (every referenced file present and long enough) and loaded with a fallback: a damaged one is
    skipped for the previous step, the warning naming the file, instead of a bare EOFError / AssertionError."""
    make_actor, pristine = saved
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    step = root / "step_0000002"
    (step / "manifest.json").unlink()
    if how == "delete-metadata":
        (step / ".metadata").unlink()
        victim = ".metadata"
    else:
        victim = _damage(step, how)
    _assert_falls_back_to_step_1(root, make_actor, victim)


def test_unverified_step_that_fails_to_read_falls_back(saved, tmp_path, monkeypatch):
    """Damage the `.metadata` check cannot see (a flipped byte inside a tensor's pickle) fails the read itself:
    for a step without a manifest that read error skips it like a failed verification, the warning naming it."""
    from megatron_dapo.checkpoint import training as checkpoint

    make_actor, pristine = saved
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    (root / "step_0000002" / "manifest.json").unlink()
    real_load = checkpoint.dist_checkpointing.load

    def load(state, path, *args, **kwargs):
        if path.endswith("step_0000002"):
            raise EOFError("Ran out of input")
        return real_load(state, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.dist_checkpointing, "load", load)
    with pytest.warns(CheckpointFallbackWarning, match="fails to load: EOFError: Ran out of input") as record:
        extra = load_checkpoint(root, make_actor())
    assert extra == {"step": 1, "tag": 1}
    skipped = _fallback_messages(record)[0]
    assert "step_0000002" in skipped and "resuming from step_0000001" in skipped


@pytest.mark.parametrize("link", ["step_0000003", "latest"])
def test_a_step_or_latest_linking_outside_load_is_one_error_and_never_followed(saved, tmp_path, link):
    """A `step_N` (or `latest`) symbolic link leading out of --load (issue 38 item 12): refused naming it, nothing of
    the target read. A link between the steps of --load itself is followed as before."""
    make_actor, pristine = saved
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    shutil.copytree(pristine, root)
    shutil.copytree(pristine / "step_0000002", elsewhere / "step_0000002")
    (root / "step_0000003").symlink_to(root / "step_0000002")  # inside: loads step 2's files as step 3
    assert load_checkpoint(root, make_actor())["tag"] == 2
    (root / "step_0000003").unlink()
    if link == "latest":
        (elsewhere / "latest").write_text("step_0000002")
        (root / "latest").unlink()
        (root / "latest").symlink_to(elsewhere / "latest")
    else:
        (root / link).symlink_to(elsewhere / "step_0000002")
    with pytest.raises(StepLinkError) as err:
        load_checkpoint(root, make_actor())
    target = elsewhere / ("latest" if link == "latest" else "step_0000002")
    assert str(err.value) == (f"--load {root}: {link} is a symbolic link to {target}, "
                              f"outside {root}; a checkpoint is read from its own directory only: replace the link by "
                              f"the step directory itself, or give --load the directory that holds it")
