"""Where a frozen model's weights come from (the reference, --ref-load; the teacher, --teacher-load), and the check
that a resumed run uses the same.

The reference model is a `MegatronActor(..., frozen=True)` on the actor's own layout (TP/PP/EP shards of the same
architecture): its weights alone, no grads, no optimizer (trainer/build.py `build_reference`). It has no state to
checkpoint, but a resume must rebuild it from the same weights, or every later KL term changes. `initial` is
resolved once, at the run's start, to the weights that start was made from; the checkpoint records the resolved
source (`ReferenceSource`, extra["reference"]) and a resumed run whose --ref-load resolves elsewhere is refused
(the launchers' `--load DIR --save DIR` resumes would otherwise turn `initial` from converter output into
--hf-checkpoint).

Memory: the reference's weights in the actor's dtype, per GPU the actor's weights line of the plan (bf16 at
Qwen2.5-32B, TP8 x PP2: 32.8e9 x 2 B / 16 = 3.8 GiB per GPU); compute: one forward-only pass over every trained
sample per step, as the actor's old-log-prob pass (`compute_log_probs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from megatron_dapo.checkpoint.state import CommonState
from megatron_dapo.errors import UserError

INITIAL = "initial"
SOURCE_KINDS: tuple[str, ...] = ("hf", "torch_dist", "sglang")
"""sglang: a --teacher-url teacher, its path the model its servers report (rollout/sglang/teacher.py)."""


@dataclass
class ReferenceSource:
    """The reference model's resolved weights: `kind` ('hf' or 'torch_dist') and `path`. Checkpointed (every rank
    holds the same, from the same flags) so a resume can refuse another source."""

    checkpoint_state: ClassVar[CommonState] = CommonState(key="reference", optional=True)
    FLAG: ClassVar[str] = "--ref-load"
    WHAT: ClassVar[str] = "reference model"
    kind: str | None = None
    path: str | None = None
    flag: str | None = None
    """The flag's value it was resolved from, for messages."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "flag": self.flag} if self.kind is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: `check_state` compared the sources before any component was restored."""

    @classmethod
    def flag_of(cls, kind: str | None) -> str:
        """The flag a source of `kind` comes from."""
        return "--teacher-url" if kind == "sglang" else cls.FLAG

    def check_state(self, state: dict[str, Any]) -> None:
        """UserError when the checkpoint's model differs from this run's (or this run has none)."""
        saved = (state.get("kind"), state.get("path"))
        if saved != (self.kind, self.path):
            was = (f"{saved[0]} {saved[1]} ({self.flag_of(saved[0])} {state.get('flag')})" if saved[0]
                   else f"no {self.WHAT}")
            now = f"{self.kind} {self.path} ({self.flag_of(self.kind)} {self.flag})" if self.kind else f"no {self.WHAT}"
            flag = self.flag_of(saved[0] or self.kind)
            raise UserError(f"{flag}: the checkpoint was trained against {was}, this run would use {now}; give "
                            f"the checkpoint's {flag} (its path, where 'initial' resolved elsewhere; a served "
                            f"teacher: servers of the model it names)")


@dataclass
class TeacherSource(ReferenceSource):
    """The distillation teacher's resolved weights (--teacher-load; algorithm/distill.py), checkpointed alike."""

    checkpoint_state: ClassVar[CommonState] = CommonState(key="teacher", optional=True)
    FLAG: ClassVar[str] = "--teacher-load"
    WHAT: ClassVar[str] = "teacher"


def resolve_reference(ref_load: str | None, *, hf_checkpoint: str, initial_checkpoint: str | None,
                      source: type[ReferenceSource] = ReferenceSource) -> ReferenceSource:
    """The flag's value (--ref-load, or --teacher-load with `source` TeacherSource) -> its resolved source: 'initial'
    is `initial_checkpoint` (converter output passed as --load) when given, else --hf-checkpoint; a directory with a
    config.json is an HF checkpoint, any other directory a torch_dist one. UserError for a path that is not a
    directory. None: no such model."""
    if ref_load is None:
        return source()
    if ref_load == INITIAL:
        if initial_checkpoint is not None:
            return source(kind="torch_dist", path=str(Path(initial_checkpoint).resolve()), flag=ref_load)
        return source(kind="hf", path=str(Path(hf_checkpoint).resolve()), flag=ref_load)
    path = Path(ref_load)
    if not path.is_dir():
        raise UserError(f"{source.FLAG} {ref_load}: not a directory ('{INITIAL}', an HF checkpoint directory or a "
                        f"torch_dist checkpoint directory)")
    kind = "hf" if (path / "config.json").is_file() else "torch_dist"
    return source(kind=kind, path=str(path.resolve()), flag=ref_load)


__all__ = ["INITIAL", "ReferenceSource", "TeacherSource", "resolve_reference"]
