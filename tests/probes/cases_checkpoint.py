"""Issue 38 probes of checkpoints: a crafted checkpoint at every reader (item 1), a disk that fills during a save
(item 5), a resume under another --seed and a step linked from outside --load (item 12).

Inputs are built once per process: a tiny model (tools/make_tiny_base.py at its default width, hidden 128: a record
of ~256 KB, which a full disk cuts in the middle, as at scale), its `checkpoint_convert hf-to-mcore` output, and a
one-step training run with --save (--seed 5). Each case copies what it needs into its own directory. The crafted
checkpoints are those of tests/crafted_checkpoint.py: the payload creates `marker` in the case's directory and
hands back the value it replaced, so an unrestricted reader loads the checkpoint as if nothing happened; the
manifest's CRC-32 is rewritten to match.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.crafted_checkpoint import plant_in_common, plant_in_metadata, plant_in_object
from tests.probes.case import PY, Case, Outcome, module, one_line_error
from tests.rewards import PARITY_REWARD
from tests.torchrun import REPO, subprocess_env

STEP = "step_0000001"
REFUSED = r": refused, it pickles .*(builtins\.exec|_operator\.getitem).*give --load a checkpoint you trust"


def _run(argv: list[str], timeout: float = 600) -> None:
    subprocess.run(argv, cwd=REPO, env=subprocess_env(), check=True, capture_output=True, timeout=timeout)


@functools.cache
def _inputs() -> Path:
    """base/ (model/, train.jsonl), mc/ (hf-to-mcore output), run/ckpt/step_0000001 (one step, --seed 5), built
    once per process (~1 min)."""
    root = Path(tempfile.mkdtemp(prefix="probe-ckpt-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    _run([PY, "tools/make_tiny_base.py", "--out", str(root / "base"), "--sft-steps", "1", "--num-train", "16",
          "--num-eval", "4", "--sft-batch-size", "4"])
    _run([*module("checkpoint_convert"), "hf-to-mcore", "--hf-path", str(root / "base" / "model"), "--save",
          str(root / "mc")])
    _run(_train(root / "run", "--seed", "5", base=root / "base"))
    return root


def _train(w: Path, *extra: str, steps: int = 1, save: Path | None = None, base: Path | None = None) -> list[str]:
    """`python -m megatron_dapo.train` on the tiny model (`base`: _inputs' by default), a step saved to `save`
    (default w/ckpt) after each of `steps` steps."""
    base = base or _inputs() / "base"
    return [*module("megatron_dapo.train"), "--hf-checkpoint", str(base / "model"), "--prompt-data",
            str(base / "train.jsonl"), "--num-steps", str(steps), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "4",
            "--overlong-buffer-length", "2", "--global-batch-size", "4", "--max-prompt-length", "16",
            "--log-dir", str(w / "log"), "--save", str(save or w / "ckpt"), "--save-interval", "1", "--no-wandb",
            "--no-progress", *extra]


def _copy(what: str, w: Path) -> Path:
    """A copy of the built input `what` (mc, run/ckpt) as w/<its name>."""
    src = _inputs() / what
    return Path(shutil.copytree(src, w / src.name))


def _no_marker(out: Outcome) -> str | None:
    return "the payload ran: the marker file exists" if (out.workdir / "marker").exists() else None


# ---- 38.1: a crafted checkpoint at every reader --------------------------------------------------------------------
def _crafted_mc(plant: Callable[[Path, Path], object]) -> Callable[[Path], None]:
    return lambda w: plant(_copy("mc", w) / "release", w / "marker")


def _crafted_step(plant: Callable[[Path, Path], object], *, manifest: bool = True) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        step = _copy("run/ckpt", w) / STEP
        plant(step, w / "marker")
        if not manifest:
            (step / "manifest.json").unlink()

    return setup


def _in_rng(step: Path, marker: Path) -> None:
    plant_in_object(step, "rng_state", marker)


def _in_extra_state(directory: Path, marker: Path) -> None:
    plant_in_object(directory, "decoder.layers.mlp.linear_fc1._extra_state", marker)  # one the CPU model asks for


def _resume(w: Path, *extra: str) -> list[str]:
    """Resume w/ckpt (a copy of the one-step run) for a second step, under its --seed 5 unless `extra` says."""
    return _train(w, "--load", str(w / "ckpt"), "--seed", "5", *extra, steps=2)


def _refused(where: str, *, status: int = 2) -> Callable[[Outcome], str | None]:
    """One error line: `where` (a regex) then the refusal; no marker file."""
    return one_line_error(where + REFUSED, status=status, also=_no_marker)


# ---- 38.5: a disk that fills during a save --------------------------------------------------------------------------
def _full_disk(w: Path, *extra: str) -> list[str]:
    """The one-step run with --save on a 1 MiB file system (the step needs ~4 MB)."""
    return [*module("tests.probes.full_disk"), "1m", str(w / "small"), "--", *_train(w, *extra, save=w / "small")[1:]]


def _nothing_left(out: Outcome) -> str | None:
    left = [line for line in out.stdout.splitlines() if line.startswith("left in ")
            and not line.endswith(".megatron_dapo.lock")]
    return f"the failed save left {', '.join(line.rsplit(': ', 1)[1] for line in left)}" if left else None


FULL = (r"^error: no space left on device writing a checkpoint \(--save(, --async-save)?\) to .*/small "
        r"\([\d.]+ GiB free on .*\); free disk space there or choose another directory; the unfinished "
        r"step_0000001\.tmp was removed$")


# ---- 38.12: another --seed, a step linked from outside --load -------------------------------------------------------
def _step_linked_from_outside(w: Path) -> None:
    ckpt = _copy("run/ckpt", w)
    (w / "elsewhere").mkdir()
    shutil.move(ckpt / STEP, w / "elsewhere" / STEP)
    (ckpt / STEP).symlink_to(w / "elsewhere" / STEP)


CASES = [
    Case(name="38.1 --load of hf-to-mcore output whose .metadata runs code on unpickling is refused, nothing run",
         setup=_crafted_mc(plant_in_metadata), argv=lambda w: _train(w, "--load", str(w / "mc")),
         check=_refused(r"mc/release/\.metadata")),
    Case(name="38.1 --load of hf-to-mcore output whose common.pt runs code on unpickling is refused, nothing run",
         setup=_crafted_mc(plant_in_common), argv=lambda w: _train(w, "--load", str(w / "mc")),
         check=_refused(r"mc/release/common\.pt")),
    Case(name="38.1 --load of hf-to-mcore output whose _extra_state object (.distcp) runs code is refused",
         setup=_crafted_mc(_in_extra_state), argv=lambda w: _train(w, "--load", str(w / "mc")),
         check=_refused(r"mc/release/__0_\d+\.distcp \(object decoder\.layers\.mlp\.linear_fc1\._extra_state/"
                        r"shard_\d_2\)")),
    Case(name="38.1 resume from a step whose .metadata runs code (manifest CRC-32 rewritten) is refused",
         setup=_crafted_step(plant_in_metadata), argv=_resume, check=_refused(rf"ckpt/{STEP}/\.metadata")),
    Case(name="38.1 resume from a step without manifest whose .metadata runs code is refused by the verifier",
         setup=_crafted_step(plant_in_metadata, manifest=False), argv=_resume,
         check=_refused(rf"ckpt/{STEP}/\.metadata")),
    Case(name="38.1 resume from a step whose RNG state object (.distcp) runs code is refused",
         setup=_crafted_step(_in_rng), argv=_resume,
         check=_refused(rf"ckpt/{STEP}/__0_\d+\.distcp \(object rng_state/shard_0_1\)")),
    Case(name="38.1 resume from a step whose common.pt runs code is refused",
         setup=_crafted_step(plant_in_common), argv=_resume, check=_refused(rf"ckpt/{STEP}/common\.pt")),
    Case(name="38.1 checkpoint_convert mcore-to-hf of a checkpoint whose .metadata runs code is refused",
         setup=_crafted_mc(plant_in_metadata),
         argv=lambda w: [*module("checkpoint_convert"), "mcore-to-hf", "--load", str(w / "mc"), "--save",
                         str(w / "hf")],
         check=_refused(r"mc/release/\.metadata", status=1)),
    Case(name="38.5 the disk filling in the middle of a checkpoint record: one line naming --save and its free "
              "space, no step_N.tmp left",
         argv=_full_disk, check=one_line_error(FULL, also=_nothing_left)),
    Case(name="38.5 the disk filling during an --async-save: one line naming --save and its free space, no "
              "step_N.tmp left",
         argv=lambda w: _full_disk(w, "--async-save"), check=one_line_error(FULL, also=_nothing_left)),
    Case(name="38.12 resume with another --seed than the checkpoint's is one line naming both seeds",
         setup=lambda w: _copy("run/ckpt", w), argv=lambda w: _resume(w, "--seed", "6"),
         check=one_line_error(r"the checkpoint under --load was saved with --seed 5, this run has --seed 6: .*"
                              r"resume with --seed 5")),
    Case(name="38.12 a step_N of --load that is a symbolic link to a directory outside it is refused, not followed",
         setup=_step_linked_from_outside, argv=_resume,
         check=one_line_error(rf"--load .*/ckpt: {STEP} is a symbolic link to .*/elsewhere/{STEP}, outside .*/ckpt; "
                              r"a checkpoint is read from its own directory only")),
]
