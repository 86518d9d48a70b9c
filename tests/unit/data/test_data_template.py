"""DAPO template wording and prompt rendering with the real Qwen2.5 tokenizer and the char tokenizer."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megatron_dapo.data import DAPO_PROMPT_TEMPLATE, PromptRecord, apply_dapo_template, render_prompt
from megatron_dapo.data.synthetic import build_char_tokenizer
from tests.torchrun import REPO

QWEN_DIR = REPO / "assets" / "tokenizers" / "qwen2.5"


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(QWEN_DIR)


def test_template_matches_every_shipped_aime_prompt():
    rows = pq.read_table(REPO / "data" / "aime-2024-dapo-format.parquet").to_pylist()
    for row in rows:
        assert apply_dapo_template(row["extra_info"]["raw_problem"]) == row["prompt"][0]["content"]


def test_template_wording_and_latex_braces():
    text = apply_dapo_template("Find $\\frac{m}{n}$ where {x}.")
    assert text.startswith("Solve the following math problem step by step. The last line of your response")
    assert "\n\nFind $\\frac{m}{n}$ where {x}.\n\n" in text
    assert text.endswith('Remember to put your answer on its own line after "Answer:".')
    assert DAPO_PROMPT_TEMPLATE.count("{problem}") == 1
    with pytest.raises(ValueError, match="non-empty"):
        apply_dapo_template("  ")


def test_qwen_tokenizer_asset_loads_offline(qwen):
    assert qwen("Hello, world!", add_special_tokens=False)["input_ids"] == [9707, 11, 1879, 0]


def test_render_prompt_uses_chat_template(qwen):
    record = PromptRecord(
        messages=[{"role": "user", "content": "What is 2+2?"}], ground_truth="4", data_source="t", index=0
    )
    ids = render_prompt(record, qwen)
    reference = qwen.apply_chat_template(
        record.messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(reference)
    im_start, im_end = qwen.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2  # system, user, open assistant turn
    assert qwen.decode(ids).endswith("<|im_start|>assistant\n")


def test_render_prompt_plain_text_without_chat_template():
    tok = build_char_tokenizer()
    record = PromptRecord(
        messages=[{"role": "user", "content": "What is 3*4?"}], ground_truth="12", data_source="t", index=0
    )
    ids = render_prompt(record, tok)
    assert len(ids) == len("What is 3*4?") and tok.decode(ids) == "What is 3*4?"
