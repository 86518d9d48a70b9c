"""A crafted checkpoint runs no code on any reader (megatron_dapo/checkpoint/safe_read.py; issue 38 item 1).

A pickle payload (tests/crafted_checkpoint.py: it creates a marker file, then hands back the value it replaced, so an
unrestricted reader loads the checkpoint as if nothing happened) is planted in each kind of pickled file, `.metadata`,
`common.pt` and a ShardedObject record of a `.distcp`, with the manifest's CRC-32 updated to match, and read at each
entry point: the extra-state detection (`stored_keys`), the reader of --load and the converter
(`DistCheckpointReader`), the verifier of a step without a manifest (`check_unverified`), resume
(`load_checkpoint`), --load of converter output (`load_model_weights`) and `checkpoint_convert mcore-to-hf`. Each
must refuse with one UnsafeCheckpointError line naming the file, and the marker must not exist. The reference for
"the restricted reader reads real checkpoints unchanged" is torch's own FileSystemReader.
"""

from __future__ import annotations

import io
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint import manifest, safe_read
from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader
from megatron_dapo.checkpoint.dist_load import load_model_weights
from megatron_dapo.checkpoint.safe_read import UnsafeCheckpointError
from megatron_dapo.checkpoint.training import CheckpointSaver, load_checkpoint, step_dir
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.extra_state import stored_keys
from tests.crafted_checkpoint import object_keys, plant_in_common, plant_in_metadata, plant_in_object, point_outside
from tests.dist.actor_common import load_hf_weights, make_samples, tiny_hf_model

PAYLOAD = r"pickles .*(builtins\.exec|_operator\.getitem)"
"""What the refusal of tests/crafted_checkpoint.py's payload names (the restricted unpickler stops at the first global
outside its allowlist, getitem; weights_only's refusal lists them all)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(actor, HF model dir, converter output, a training checkpoint dir with step 1) for the whole module; beside
    it `distopt`, the same saved with --use-distributed-optimizer (its ShardedObjects: param groups, bucket sizes)."""
    from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore

    root = tmp_path_factory.mktemp("safe-read")
    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=3)
    hf.save_pretrained(root / "hf")
    hf_to_mcore(HfToMcoreConfig(hf_path=str(root / "hf"), save=str(root / "mc"), transformer_impl="local"))
    for name, distributed in (("distopt", True), ("ckpt", False)):  # the regular optimizer's actor is kept
        actor = MegatronActor(ModelArch.from_hf(hf.config), ActorConfig(lr=1e-3, use_distributed_optimizer=distributed),
                              layout)
        load_hf_weights(actor, hf)
        actor.train_step(make_samples(4, seed=0))  # Adam state to save
        saver = CheckpointSaver(root / name)
        saver.save(1, actor, extra={"sampler": {"seed": 1}})
        saver.close()
    yield actor, root / "hf", root / "mc", root / "ckpt"
    destroy_parallel()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _same(a, b) -> bool:
    """Equal values, tensors and numpy arrays compared by dtype, shape and content."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _refused(err: pytest.ExceptionInfo, path: Path, what: str) -> None:
    """One line naming the file and what it pickles."""
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: refused"), message
    assert re.search(what, message), message


def test_the_restricted_reader_reads_real_checkpoints_as_torch_does(world):
    _, _, mc, ckpt = world
    from torch.distributed.checkpoint import FileSystemReader

    for directory in (mc / "release", step_dir(ckpt, 1), step_dir(ckpt.parent / "distopt", 1)):
        ours, torchs = safe_read.read_metadata(directory), FileSystemReader(str(directory)).read_metadata()
        torchs.storage_meta.load_id = None  # set by torch's reader to its own random id
        assert ours == torchs
        assert safe_read.load_common(directory).keys() == torch.load(directory / "common.pt",
                                                                     weights_only=False).keys()
        for key in object_keys(directory):  # RNG states (numpy arrays, a ByteTensor), extra states, layer_impl
            info = next(s for i, s in ours.storage_data.items() if i.fqn == key)
            raw = (directory / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            ref = torch.load(io.BytesIO(raw), weights_only=False)
            assert _same(safe_read.load_object(io.BytesIO(raw), key), ref), key


@pytest.mark.parametrize("reader", ["stored_keys", "DistCheckpointReader", "check_unverified"])
def test_a_metadata_payload_is_refused_by_every_index_reader(world, tmp_path, reader):
    _, _, _, ckpt = world
    step = _copy(step_dir(ckpt, 1), tmp_path / "step_0000001")
    marker = tmp_path / "marker"
    plant_in_metadata(step, marker)
    read = {"stored_keys": lambda: stored_keys(step), "DistCheckpointReader": lambda: DistCheckpointReader(step),
            "check_unverified": lambda: manifest.check_unverified(step, 0, 1)}[reader]
    with pytest.raises(UnsafeCheckpointError) as err:
        read()
    _refused(err, step / ".metadata", PAYLOAD)
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["metadata", "metadata_without_manifest", "rng_object", "extra_state_object",
                                   "common"])
def test_a_payload_is_refused_at_resume(world, tmp_path, plant):
    """load_checkpoint (--load of a training run): with the manifest rehashed, or removed (the verifier path)."""
    actor, _, _, ckpt = world
    root = _copy(ckpt, tmp_path / "ckpt")
    step, marker = step_dir(root, 1), tmp_path / "marker"
    if plant.startswith("metadata"):
        plant_in_metadata(step, marker)
        if plant == "metadata_without_manifest":
            (step / manifest.MANIFEST).unlink()
        where, what = step / ".metadata", ": refused"
    elif plant == "common":
        plant_in_common(step, marker)
        where, what = step / "common.pt", ": refused"
    else:
        key = plant_in_object(step, "rng_state" if plant == "rng_object" else "decoder.layers.mlp.linear_fc1._extra",
                              marker)
        where, what = f"{step}/__0_", f"(object {key}): refused"
    with pytest.raises(UnsafeCheckpointError) as err:
        load_checkpoint(root, actor)
    message = str(err.value)
    assert message.startswith(str(where)) and what in message and re.search(PAYLOAD, message), message
    assert "\n" not in message
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["metadata", "common", "extra_state_object"])
def test_a_payload_is_refused_at_load_of_converter_output(world, tmp_path, plant):
    """load_model_weights (--load of hf-to-mcore output) and checkpoint_convert mcore-to-hf."""
    from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf

    actor, _, mc, _ = world
    out = _copy(mc, tmp_path / "mc")
    release, marker = out / "release", tmp_path / "marker"
    if plant == "metadata":
        plant_in_metadata(release, marker)
    elif plant == "common":
        plant_in_common(release, marker)
    else:
        plant_in_object(release, "decoder.layers.mlp.linear_fc1._extra_state", marker)  # one the model asks for
    with pytest.raises(UnsafeCheckpointError) as err:
        load_model_weights(actor.modules[0], out, actor.arch)
    assert str(err.value).startswith(str(release)) and re.search(PAYLOAD, str(err.value)), str(err.value)
    if plant != "extra_state_object":  # the converter reads tensors only, never a ShardedObject
        with pytest.raises(UnsafeCheckpointError):
            mcore_to_hf(McoreToHfConfig(load=str(out), save=str(tmp_path / "hf")))
    assert not marker.exists()


def test_a_record_naming_a_file_outside_the_checkpoint_is_refused(world, tmp_path):
    _, _, mc, _ = world
    release = _copy(mc / "release", tmp_path / "release")
    name = point_outside(release)
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_read.read_metadata(release)
    _refused(err, release / ".metadata", re.escape(f"naming {name!r}"))


def test_an_extra_state_holding_bytes_is_refused_and_an_empty_one_passes(tmp_path):
    """TE's set_extra_state unpickles a non-empty uint8 tensor with pickle.loads; bf16 TE saves an empty one."""
    fp8 = torch.frombuffer(bytearray(pickle.dumps({"scale_fwd": 1.0})), dtype=torch.uint8)
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_read.check_extra_states({"model": {"decoder.layers.0.mlp.linear_fc1._extra_state": fp8}}, tmp_path)
    key = "model.decoder.layers.0.mlp.linear_fc1._extra_state"
    _refused(err, tmp_path, re.escape(f"holds {fp8.numel()} bytes at {key}"))
    safe_read.check_extra_states({"model": {"a._extra_state": torch.empty(0, dtype=torch.uint8),
                                            "b._extra_state": None, "c.weight": torch.ones(3)}}, tmp_path)


def test_a_damaged_metadata_stays_damage_not_a_refusal(world, tmp_path):
    """Truncation is a CheckpointError (resume falls back past it), not an UnsafeCheckpointError (it stops)."""
    from megatron_dapo.weights.safetensors_io import CheckpointError

    _, _, _, ckpt = world
    step = _copy(step_dir(ckpt, 1), tmp_path / "step_0000001")
    data = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        safe_read.read_metadata(step)
    assert not isinstance(err.value, UnsafeCheckpointError)
    assert manifest.check_unverified(step, 0, 1)[0].startswith(f"{step}/.metadata is unreadable")
