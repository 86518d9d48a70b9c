"""The check that two tokenizers are the same, token for token: a distillation teacher scores the student's token ids,
which must mean the same text to both (--teacher-load: trainer/build.py teacher_arch; a --teacher-url server started
with --skip-tokenizer-init: rollout/sglang/teacher.py)."""

from __future__ import annotations

from megatron_dapo.errors import UserError


def check_same_tokenizer(tokenizer, other_dir: str, *, flag: str) -> None:
    """UserError naming `flag` and the student's tokenizer unless `other_dir`'s tokenizer (local files only) has the
    same vocabulary and end-of-sequence id as `tokenizer`. One dict comparison: ~150k entries at Qwen2.5, ~0.1 s."""
    from transformers import AutoTokenizer

    mine = getattr(tokenizer, "name_or_path", "the student's tokenizer")
    try:
        other = AutoTokenizer.from_pretrained(other_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"{flag}: no tokenizer could be read from {other_dir} ({type(err).__name__}); the teacher must "
                        f"share the student's tokenizer ({mine}), and its files are how that is checked") from err
    a, b = tokenizer.get_vocab(), other.get_vocab()
    if a != b or tokenizer.eos_token_id != other.eos_token_id:
        differ = sum(1 for t in a.keys() | b.keys() if a.get(t) != b.get(t))
        raise UserError(f"{flag}: its tokenizer ({other_dir}: {len(b)} tokens, eos id {other.eos_token_id}) is not "
                        f"the student's ({mine}: {len(a)} tokens, eos id {tokenizer.eos_token_id}; {differ} tokens "
                        f"differ): the teacher would score other text than the student sampled")


__all__ = ["check_same_tokenizer"]
