"""Synthetic arithmetic task (values vs Python's own parser) and the character-level tokenizer."""

from __future__ import annotations

import ast
import operator

import pytest
from transformers import AutoTokenizer

from megatron_dapo.data import render_prompt
from megatron_dapo.data.synthetic import (
    CHARACTERS,
    SPECIAL_TOKENS,
    ArithmeticTask,
    build_char_tokenizer,
    make_arithmetic_problems,
)
from megatron_dapo.reward import compute_score

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _reference_value(expression: str) -> int:
    """Evaluate with Python's grammar (precedence) by walking the AST: + - * on int literals only."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize(
    "task",
    [
        pytest.param(ArithmeticTask(), id="default"),
        pytest.param(
            ArithmeticTask(min_operations=3, max_operations=5, allow_negative=True), id="long-negative"
        ),
        pytest.param(ArithmeticTask(operators=("*",), min_operand=0, max_operand=9), id="times-only"),
    ],
)
def test_ground_truth_matches_reference_evaluation(task):
    records = make_arithmetic_problems(300, seed=5, difficulty=task)
    for r in records:
        expression = r.extra["expression"]
        assert r.ground_truth == str(_reference_value(expression))
        assert r.prompt_text == task.prompt_template.replace("{expression}", expression)
        operands = [int(x) for x in expression.replace("-", "+").replace("*", "+").split("+")]
        assert all(task.min_operand <= x <= task.max_operand for x in operands)
        assert task.min_operations + 1 <= len(operands) <= task.max_operations + 1
        if not task.allow_negative:
            assert int(r.ground_truth) >= 0
    assert [r.index for r in records] == list(range(300))


def test_seeded_and_verifiable():
    a = make_arithmetic_problems(50, seed=1)
    assert a == make_arithmetic_problems(50, seed=1) and a != make_arithmetic_problems(50, seed=2)
    for r in a:
        assert compute_score(r.extra["reference_response"], r.ground_truth).acc
        assert not compute_score(f"Answer: {int(r.ground_truth) + 1}", r.ground_truth).acc


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"min_operand": 5, "max_operand": 4}, "min_operand <= max_operand", id="operand-range"),
        pytest.param({"min_operations": 0}, "1 <= min_operations", id="zero-ops"),
        pytest.param({"max_operations": 9}, "max_operations=9 > 8", id="too-long"),
        pytest.param({"operators": ("/",)}, "subset of", id="bad-operator"),
        pytest.param({"prompt_template": "no placeholder"}, "{expression}", id="template"),
    ],
)
def test_task_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_always_negative_task_is_rejected():
    task = ArithmeticTask(operators=("-",), min_operand=1, max_operand=1, min_operations=2, max_operations=2)
    with pytest.raises(ValueError, match="set allow_negative"):
        make_arithmetic_problems(1, seed=0, difficulty=task)


def test_char_tokenizer_round_trip_and_reload(tmp_path):
    tok = build_char_tokenizer(str(tmp_path))
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS) < 128
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 0
    text = "Answer: 42"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    every_char = CHARACTERS + "<|im_start|>x<|im_end|><|endoftext|>"
    assert reloaded.encode(every_char, add_special_tokens=False) == tok.encode(
        every_char, add_special_tokens=False
    )
    assert len(tok.encode(every_char, add_special_tokens=False)) == len(CHARACTERS) + 4
    assert tok.decode(tok.encode("a  b\n\nc")) == "a  b\n\nc"  # whitespace survives
    assert tok.convert_ids_to_tokens(tok.encode("#", add_special_tokens=False)) == ["<|unk|>"]


def test_char_tokenizer_chat_template(tmp_path):
    tok = build_char_tokenizer(str(tmp_path), with_chat_template=True)
    record = make_arithmetic_problems(1, seed=0)[0]
    ids = render_prompt(record, AutoTokenizer.from_pretrained(tmp_path))
    assert tok.decode(ids) == f"<|im_start|>user\n{record.prompt_text}<|im_end|>\n<|im_start|>assistant\n"


def test_char_tokenizer_round_trips_through_auto_tokenizer_of_a_qwen2_directory(tmp_path):
    """transformers 5 reloads a qwen2 directory's tokenizer as Qwen2Tokenizer (byte-level encoding): spaces and
    newlines must keep their ids (they were dropped before, so a prompt "47 mod 6=" lost its spaces)."""
    from transformers import Qwen2Config

    tokenizer = build_char_tokenizer(str(tmp_path))
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["47 mod 6=", "\n47-6=41\nAnswer: 5", "37+45=", "a<|endoftext|>b", CHARACTERS]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert reloaded.encode(text, add_special_tokens=False) == ids
        assert len(ids) == len(text.replace("<|endoftext|>", "#"))
        assert reloaded.decode(ids) == tokenizer.decode(ids) == text
