"""The one place a parallel layout (TP, PP, DP) is checked against a model.

Errors name the flag to change, so a launcher typo is caught before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.models.hf_config import Qwen2Arch

VOCAB_DIVISIBLE_BY = 128


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    tp: int = 1
    """--tensor-model-parallel-size"""
    pp: int = 1
    """--pipeline-model-parallel-size"""
    dp: int = 1
    """data-parallel size = world size / (tp * pp)"""

    def __post_init__(self) -> None:
        for name, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                           ("dp", "data-parallel size")):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def from_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> ParallelLayout:
        """Derive dp from the world size; raise naming the flags when it does not divide."""
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                f"--pipeline-model-parallel-size ({pp}); change the process count or the layout"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of divisible_by * tp that holds vocab_size (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def validate_layout(arch: Qwen2Arch, layout: ParallelLayout) -> None:
    """Raise ValueError naming the flag when `arch` cannot be split over `layout`."""
    if arch.num_heads % layout.tp:
        raise ValueError(
            f"num_attention_heads ({arch.num_heads}) is not divisible by --tensor-model-parallel-size "
            f"({layout.tp})"
        )
    if arch.num_kv_heads % layout.tp:
        raise ValueError(
            f"num_key_value_heads ({arch.num_kv_heads}) is not divisible by --tensor-model-parallel-size "
            f"({layout.tp}); GQA query groups cannot be split across more TP ranks than there are groups"
        )
    if arch.intermediate_size % layout.tp:
        raise ValueError(
            f"intermediate_size ({arch.intermediate_size}) is not divisible by "
            f"--tensor-model-parallel-size ({layout.tp})"
        )
    if arch.num_layers % layout.pp:
        raise ValueError(
            f"num_hidden_layers ({arch.num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({layout.pp})"
        )
