"""Loading the shipped datasets, AIME repeats, and errors for malformed rows."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import DataFormatError, PromptRecord, apply_dapo_template, load_prompts
from megatron_dapo.errors import UserError
from tests.torchrun import REPO

DATA = REPO / "data"
SHIPPED = [
    pytest.param("dapo-math-17k-sample512.parquet", id="dapo-parquet"),
    pytest.param("dapo-math-17k-sample512.jsonl", id="dapo-jsonl"),
    pytest.param("aime-2024-dapo-format.parquet", id="aime-parquet"),
    pytest.param("aime-2024.jsonl", id="aime-jsonl"),
]


def _file_rows(path: Path) -> int:
    """Row count read independently of the loader: parquet metadata or non-blank lines."""
    if path.suffix == ".parquet":
        return pq.read_metadata(path).num_rows
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def test_shipped_files_match_checksums():
    listed = [line.split() for line in (DATA / "SHA256SUMS").read_text().splitlines() if line.strip()]
    assert {name for _, name in listed} == {
        p.name for p in DATA.iterdir() if p.suffix in (".parquet", ".jsonl")
    }
    for digest, name in listed:
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_row_counts_and_fields(name):
    records = load_prompts(DATA / name)
    assert len(records) == _file_rows(DATA / name)
    assert [r.index for r in records] == list(range(len(records)))
    for r in records:
        assert isinstance(r, PromptRecord) and r.ground_truth.strip()
        assert r.messages[-1]["role"] == "user"
        assert "Answer: $Answer" in r.prompt_text  # the DAPO template is present in both schemas


@pytest.mark.parametrize("stem", ["dapo-math-17k-sample512", "aime-2024"])
def test_jsonl_with_template_equals_dapo_parquet(stem):
    parquet_name = (
        "dapo-math-17k-sample512.parquet" if stem.startswith("dapo") else "aime-2024-dapo-format.parquet"
    )
    from_jsonl = load_prompts(DATA / f"{stem}.jsonl")
    from_parquet = load_prompts(DATA / parquet_name)
    assert [r.messages for r in from_jsonl] == [r.messages for r in from_parquet]
    assert [r.ground_truth for r in from_jsonl] == [r.ground_truth for r in from_parquet]
    assert {r.data_source for r in from_parquet} == {"math_dapo"}
    assert {r.data_source for r in from_jsonl} == {stem}  # simple rows default to the file stem


def test_parquet_extra_keeps_other_columns():
    first = load_prompts(DATA / "aime-2024-dapo-format.parquet", limit=1)[0]
    assert first.extra["ability"] == "MATH"
    assert apply_dapo_template(first.extra["extra_info"]["raw_problem"]) == first.prompt_text


@pytest.mark.parametrize("k", [1, 4, 32])
def test_aime_repeat_for_avg_at_k(k):
    base = load_prompts(DATA / "aime-2024-dapo-format.parquet")
    repeated = load_prompts(DATA / "aime-2024-dapo-format.parquet", repeat=k)
    assert len(repeated) == k * len(base) == k * 30
    assert Counter(r.index for r in repeated) == {i: k for i in range(30)}
    assert repeated[: len(base)] == base and repeated[-len(base) :] == base


def test_limit_keeps_first_rows_before_repeat():
    records = load_prompts(DATA / "dapo-math-17k-sample512.jsonl", limit=5, repeat=2)
    assert [r.index for r in records] == [0, 1, 2, 3, 4] * 2


def test_simple_rows_key_precedence_and_int_answers(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "Q1", "answer": "worked solution #### 18", "label": "18"},
        {"problem": "Q2", "answer": 7},
        {"prompt": "Q3", "ground_truth": "x", "label": "y", "data_source": "mine"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    records = load_prompts(path, apply_template=False)
    assert [r.ground_truth for r in records] == ["18", "7", "x"]
    assert [r.prompt_text for r in records] == ["Q1", "Q2", "Q3"]
    assert [r.data_source for r in records] == ["gsm", "gsm", "mine"]
    assert records[0].extra == {"answer": "worked solution #### 18"}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_5001_digit_json_integer_answer_loads(tmp_path, suffix):
    """Issue 38.7: json.loads refused a JSON number beyond Python's 4300-digit int-string limit; the answer is now
    its decimal text, as str() of a (smaller) JSON integer is, and small integers elsewhere stay ints."""
    digits = "8" + "1234567890" * 500  # 5,001 digits
    body = f'{{"problem": "Q", "answer": {digits}, "level": 3, "big_extra": -{digits}}}'
    path = tmp_path / f"big{suffix}"
    path.write_text(body + "\n" if suffix == ".jsonl" else f"[{body}]")
    (record,) = load_prompts(path)
    assert record.ground_truth == digits
    assert record.extra == {"level": 3, "big_extra": "-" + digits}


def test_json_list_file(tmp_path):
    path = tmp_path / "aime.json"
    path.write_text(json.dumps([{"problem": "P", "answer": "025"}]))
    assert load_prompts(path)[0].ground_truth == "025"


GOOD = {"prompt": "What is 1+1?", "label": "2"}


@pytest.mark.parametrize(
    "bad_row, field",
    [
        pytest.param({"prompt": "What is 1+1?"}, "ground_truth/label/answer/solution", id="missing-answer"),
        pytest.param({"label": "2"}, "problem/question/prompt", id="missing-prompt"),
        pytest.param({"prompt": "  ", "label": "2"}, "prompt", id="empty-prompt"),
        pytest.param({"prompt": "Q", "label": ""}, "label", id="empty-answer"),
        pytest.param({"prompt": "Q", "label": ["2"]}, "label", id="answer-list"),
        pytest.param({"prompt": "Q", "answer": 27.0}, "answer", id="answer-float"),
        pytest.param({"prompt": 5, "label": "2"}, "prompt", id="prompt-int"),
        pytest.param({"prompt": [{"role": "user", "content": "Q"}]}, "reward_model", id="dapo-no-reward"),
        pytest.param(
            {"prompt": [{"role": "user", "content": "Q"}], "reward_model": {"ground_truth": None}},
            "reward_model.ground_truth",
            id="dapo-null-truth",
        ),
        pytest.param(
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}},
            "prompt[0].content",
            id="dapo-no-content",
        ),
        pytest.param({"prompt": [], "label": "2"}, "prompt", id="empty-chat-list"),
        pytest.param({"prompt": "Q", "label": "2", "data_source": 3}, "data_source", id="source-int"),
    ],
)
def test_bad_jsonl_rows_name_file_row_and_field(tmp_path, bad_row, field):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, GOOD, bad_row)))
    with pytest.raises(DataFormatError) as info:
        load_prompts(path)
    message = str(info.value)
    assert str(path) in message and "row 2" in message and repr(field) in message, message
    assert (info.value.row, info.value.field_name) == (2, field)


def test_invalid_json_line_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(DataFormatError, match=r"broken.jsonl: row 1: line 2 is not valid JSON"):
        load_prompts(path)


def test_bad_parquet_row_names_file_row_and_field(tmp_path):
    prompt = [{"role": "user", "content": "Q"}]
    table = pa.table(
        {
            "prompt": [prompt, prompt],
            "reward_model": [{"ground_truth": "1"}, {"ground_truth": None}],
            "data_source": ["math_dapo", "math_dapo"],
        }
    )
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataFormatError, match=r"bad.parquet: row 1: field 'reward_model.ground_truth'"):
        load_prompts(path)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        pytest.param({"repeat": 0}, ValueError, "repeat must be an int >= 1", id="repeat-0"),
        pytest.param({"limit": 0}, ValueError, "limit must be an int >= 1", id="limit-0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        load_prompts(DATA / "aime-2024.jsonl", **kwargs)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="suffix '.csv'"):
        load_prompts(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="no such dataset file"):
        load_prompts(tmp_path / "missing.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="contains no rows"):
        load_prompts(tmp_path / "empty.jsonl")


# ---- encodings, unreadable files -------------------------------------------------------------------
def test_non_utf8_jsonl_names_file_row_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    latin1_row = '{"prompt": "café", "label": "2"}\n'.encode("latin-1")
    data = (json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n").encode() + latin1_row
    path.write_bytes(data)
    with pytest.raises(DataFormatError) as info:
        load_prompts(path)
    offset = data.index(b"\xe9")  # the first byte that is not UTF-8, counted independently
    assert str(info.value) == (f"{path}: row 2: line 4, byte offset {offset}: not valid UTF-8 (invalid continuation "
                               f"byte: e9); re-encode the file as UTF-8")
    assert info.value.row == 2


def test_non_utf8_json_names_line_and_byte_offset(tmp_path):
    path = tmp_path / "bad.json"
    data = b'[{"prompt": "Q", "label": "1"},\n {"prompt": "\x80", "label": "2"}]'
    path.write_bytes(data)
    offset = data.index(b"\x80")
    with pytest.raises(DataFormatError, match=rf"bad.json: line 2, byte offset {offset}: not valid UTF-8"):
        load_prompts(path)


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\n").encode())
    assert [r.ground_truth for r in load_prompts(path)] == ["2"]


def test_file_that_is_not_parquet_names_the_file(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("prompt,label\nQ,1\n")
    with pytest.raises(DataFormatError, match=rf"{path}: cannot be read as parquet"):
        load_prompts(path)


# ---- prompt length: characters before tokens -----------------------------------------------------
class SpyTokenizer:
    """The shipped character tokenizer, recording the length of every text it is asked to encode.

    A text over MAX_TEXT fails the test at once instead of being tokenized: the 50 MB prompt would take
    the character tokenizer past the machine's memory (the issue measured 19 GB with the Qwen2 one).
    """

    MAX_TEXT = 100_000

    def __init__(self):
        from megatron_dapo.data.synthetic import build_char_tokenizer

        self.inner = build_char_tokenizer()
        self.seen: list[int] = []
        self.chat_template = None

    def encode(self, text, **kwargs):
        self.seen.append(len(text))
        assert len(text) <= self.MAX_TEXT, f"the tokenizer was given {len(text)} characters"
        return self.inner.encode(text, **kwargs)


def test_a_50mb_prompt_is_skipped_without_being_tokenized(tmp_path, capsys):
    from megatron_dapo.data.prompt_set import load_prompt_set

    huge = "1" * (50 * 2**20)
    path = tmp_path / "huge.jsonl"
    rows = [{"prompt": [{"role": "user", "content": c}], "reward_model": {"ground_truth": "2"}}
            for c in ("1+1=", huge, "2+2=")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spy = SpyTokenizer()
    prompts = load_prompt_set(str(path), spy, prompt_format="chat", max_prompt_length=2048)  # the trainer defaults
    assert [p.index for p in prompts] == [0, 2]
    assert prompts[0].prompt_ids == spy.inner.encode("1+1=", add_special_tokens=False)
    assert spy.seen == [4, 4]  # the 50 MB row never reached the tokenizer
    assert "skipped 0 prompts longer than 2048 tokens and 1 longer than 65536 characters" in capsys.readouterr().out


def test_a_long_prompt_with_on_long_prompt_error_names_file_row_and_flag(tmp_path):
    from megatron_dapo.data.prompt_set import load_prompt_set

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": [{"role": "user", "content": c}], "reward_model": {"ground_truth": "2"}}
            for c in ("1+1=", "1" * 200_000)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spy = SpyTokenizer()
    with pytest.raises(UserError, match=rf"^--prompt-data {path}: row 1: field 'prompt': 200000 characters > "
                                        r"--max-prompt-chars=65536 \(--on-long-prompt=error"):
        load_prompt_set(str(path), spy, prompt_format="chat", max_prompt_length=2048, on_long_prompt="error",
                        flag="--prompt-data")
    assert spy.seen == [4]


@pytest.mark.parametrize("on_long", ["skip", "error"])
def test_length_limits_chars_then_tokens(on_long):
    from megatron_dapo.data import PromptLengthLimit, encode_within_limits

    records = [PromptRecord(messages=[{"role": "user", "content": c}], ground_truth="1", data_source="t", index=i)
               for i, c in enumerate(["ab", "abcdefghij", "abcdef", "abc"])]
    limit = PromptLengthLimit(max_tokens=4, max_chars=8, on_long=on_long)
    encoded = []

    def encode(record):
        encoded.append(record.index)
        return list(range(len(record.messages[0]["content"])))  # one token per character

    if on_long == "error":
        with pytest.raises(DataFormatError, match=r"data.jsonl: row 1: field 'prompt': 10 characters > "
                                                  r"--max-prompt-chars=8"):
            encode_within_limits(records, encode, limit, source="data.jsonl")
        return
    kept, report = encode_within_limits(records, encode, limit, source="data.jsonl")
    assert [r.index for r, _ in kept] == [0, 3] and encoded == [0, 2, 3]  # row 1 is never encoded
    assert (report.over_chars, report.over_tokens) == (1, 1)


def test_length_limit_flags_are_validated():
    from megatron_dapo.data import PromptLengthLimit, default_max_prompt_chars

    assert default_max_prompt_chars(2048) == 65536
    with pytest.raises(ValueError, match="--max-prompt-chars must be an integer >= 1"):
        PromptLengthLimit(max_tokens=16, max_chars=0)
    with pytest.raises(ValueError, match="--on-long-prompt must be one of"):
        PromptLengthLimit(max_tokens=16, max_chars=64, on_long="truncate")
