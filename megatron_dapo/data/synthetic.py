"""The synthetic verifiable task of the embedded CPU demo: short integer arithmetic.

Problems look like "17+25" or "3*14-5"; the ground truth is the integer value, so the DAPO
verifier scores a response whose last line is "Answer: 42". Values are computed from the
generated operands (multiplication before addition/subtraction), never by evaluating text.
A character-level tokenizer keeps a tiny model's vocabulary under 100 tokens.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from megatron_dapo.data.records import PromptRecord

OPERATORS = ("+", "-", "*")
SYNTHETIC_DATA_SOURCE = "synthetic_arithmetic"


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Difficulty of the arithmetic problems."""

    min_operand: int = 1
    """Smallest operand (inclusive), >= 0."""
    max_operand: int = 20
    """Largest operand (inclusive)."""
    min_operations: int = 1
    """Fewest binary operations per problem (1 gives "a+b")."""
    max_operations: int = 2
    """Most binary operations per problem."""
    operators: tuple[str, ...] = OPERATORS
    """Operators drawn uniformly, a subset of '+', '-', '*'."""
    allow_negative: bool = False
    """Keep problems whose value is negative (otherwise they are redrawn)."""
    prompt_template: str = "What is {expression}?"
    """User message; `{expression}` is replaced by the problem, e.g. "3*14-5"."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                "ArithmeticTask: need 0 <= min_operand <= max_operand, got "
                f"{self.min_operand}, {self.max_operand}"
            )
        if not 1 <= self.min_operations <= self.max_operations:
            raise ValueError(
                "ArithmeticTask: need 1 <= min_operations <= max_operations, got "
                f"{self.min_operations}, {self.max_operations}"
            )
        if self.max_operations > 8:
            raise ValueError(
                f"ArithmeticTask.max_operations={self.max_operations} > 8: keep demo prompts short"
            )
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(
                f"ArithmeticTask.operators must be a non-empty subset of {OPERATORS}, got {self.operators}"
            )
        if "{expression}" not in self.prompt_template:
            raise ValueError("ArithmeticTask.prompt_template must contain '{expression}'")


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of operands[0] op0 operands[1] op1 ... with '*' binding tighter than '+'/'-'."""
    if len(operands) != len(operators) + 1:
        raise ValueError("evaluate: need exactly one more operand than operators")
    total, term = 0, operands[0]
    sign = 1
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            term *= value
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), value
    return total + sign * term


def _draw(rng: random.Random, task: ArithmeticTask) -> tuple[str, int]:
    num_ops = rng.randint(task.min_operations, task.max_operations)
    operands = [rng.randint(task.min_operand, task.max_operand) for _ in range(num_ops + 1)]
    operators = [rng.choice(task.operators) for _ in range(num_ops)]
    expression = "".join(f"{a}{op}" for a, op in zip(operands[:-1], operators, strict=True)) + str(operands[-1])
    return expression, evaluate(operands, operators)


def make_arithmetic_problems(
    n: int, *, seed: int, difficulty: ArithmeticTask | None = None
) -> list[PromptRecord]:
    """`n` seeded problems; ground truth is the value as a string ("42", "-3")."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"make_arithmetic_problems: n must be an int >= 1, got {n!r}")
    task = difficulty if difficulty is not None else ArithmeticTask()
    rng = random.Random(seed)
    records = []
    for index in range(n):
        for _ in range(1000):
            expression, value = _draw(rng, task)
            if task.allow_negative or value >= 0:
                break
        else:
            raise ValueError(
                f"ArithmeticTask {task} almost never gives a non-negative value; set allow_negative"
            )
        records.append(
            PromptRecord(
                messages=[
                    {"role": "user", "content": task.prompt_template.replace("{expression}", expression)}
                ],
                ground_truth=str(value),
                data_source=SYNTHETIC_DATA_SOURCE,
                index=index,
                # A reference response in the verifier's format, e.g. for a supervised warm-up.
                extra={"expression": expression, "reference_response": f"Answer: {value}"},
            )
        )
    return records


EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", UNK_TOKEN)
CHARACTERS = string.digits + string.ascii_letters + " \n+-*/=().,:?!"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_name(char: str) -> str:
    """The name of an ASCII character in GPT-2's byte-level alphabet: '!'..'~' keep their own; bytes 0-32 are
    named chr(256 + byte) (' ' -> 'Ġ', '\\n' -> 'Ċ'), and DEL chr(289)."""
    code = ord(char)
    if code >= 128:
        raise ValueError(f"_byte_level_name: {char!r} is not ASCII")
    if ord("!") <= code <= ord("~"):
        return char
    return chr(256 + code) if code <= 32 else chr(289)


TOOL_CHARACTERS = "`_%"
"""The characters a tool call needs beyond `CHARACTERS` (code fences, Python's % and names): the tool task's tokenizer
(`build_char_tokenizer(extra_characters=TOOL_CHARACTERS)`) has them after the others, so every id of the demo's
tokenizer keeps its meaning."""


def build_char_tokenizer(save_dir: str | None = None, *, with_chat_template: bool = False,
                         extra_characters: str = ""):
    """A character-level `PreTrainedTokenizerFast` (len 80): specials get ids 0-3, then one id per char.

    `<|endoftext|>` is both eos and pad; characters outside `CHARACTERS` map to `<|unk|>`. The characters are
    named in the byte-level alphabet (space 'Ġ', newline 'Ċ'), behind a byte-level pre-tokenizer and decoder:
    transformers 5 reloads a directory whose config.json says qwen2 as a `Qwen2Tokenizer`, which keeps the
    vocabulary but byte-level encodes the text, and would drop a plain ' ' or '\\n' entry's text (prompts with
    spaces lost them). With `save_dir`, the files are written there and `AutoTokenizer.from_pretrained(save_dir)`
    then encodes and decodes every text with the same ids. `with_chat_template` adds a ChatML template (longer
    prompts), otherwise prompts are rendered as plain text. `extra_characters` (ASCII, none of `CHARACTERS`) get the
    ids after the others (the tool task's backticks: `TOOL_CHARACTERS`).
    """
    extra = "".join(dict.fromkeys(extra_characters))
    if any(c in CHARACTERS or ord(c) >= 128 for c in extra):
        raise ValueError(f"build_char_tokenizer: extra_characters must be ASCII characters not already in the "
                         f"tokenizer, got {extra_characters!r}")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *map(_byte_level_name, CHARACTERS + extra)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included) is its own pre-token, then named by its byte.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    if with_chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer
