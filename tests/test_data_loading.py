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

DATA = Path(__file__).resolve().parents[1] / "data"
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
