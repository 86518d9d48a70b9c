"""Load prompt datasets (parquet, jsonl, json) into validated `PromptRecord`s.

Two row schemas are accepted, detected per row:

* DAPO / verl schema (DAPO-Math-17k, the AIME parquet): `prompt` is a list of chat messages,
  `reward_model.ground_truth` the answer, `data_source` the dataset name; the prompt is used as is.
* simple rows: the problem in `problem` | `question` | `prompt` (a string) and the answer in
  `ground_truth` | `label` | `answer` | `solution` (first key present wins; `label` precedes
  `answer` because GSM8K-style rows keep the worked solution in `answer`). The DAPO template is
  applied to the problem unless `apply_template=False`.

A row with a missing or empty answer or prompt, or a value of the wrong type, raises
`DataFormatError` naming the file, the 0-based row and the field.

A JSON integer longer than Python's int-string limit (`sys.get_int_max_str_digits()`, 4300 digits) is kept
as its decimal text (`_json_int`), so a 5,001-digit answer loads as the string it is and any length works.
"""

from __future__ import annotations

import codecs
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_dapo.data.records import DataFormatError, PromptRecord
from megatron_dapo.data.template import apply_dapo_template

PROBLEM_KEYS = ("problem", "question", "prompt")
ANSWER_KEYS = ("ground_truth", "label", "answer", "solution")
SUFFIXES = (".parquet", ".jsonl", ".json")


def _read_parquet(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa  # local: only parquet users pay for the import
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        if limit is not None:
            table = table.slice(0, limit)
        rows = table.to_pylist()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        raise DataFormatError(str(path), None, None, f"cannot be read as parquet ({err})") from err
    yield from enumerate(rows)


def _not_utf8(err: UnicodeDecodeError, line_no: int, byte_offset: int) -> str:
    """Where undecodable bytes sit: the 1-based line and the offset of the first bad byte in the file."""
    bad = err.object[err.start:err.end].hex(" ")
    return (f"line {line_no}, byte offset {byte_offset}: not valid UTF-8 ({err.reason}: {bad}); "
            f"re-encode the file as UTF-8")


def _json_int(text: str) -> int | str:
    """A JSON integer literal as an int, or as `text` itself when it has more digits than Python converts.

    JSON forbids leading zeros, so for such a long literal `text` is exactly what `str(int(text))` would be;
    keeping it as text costs len(text), where `int` would refuse it (or take time quadratic in its length).
    """
    limit = sys.get_int_max_str_digits()
    if limit and len(text) - text.startswith("-") > limit:
        return text
    return int(text)


def _loads(text: str) -> Any:
    """`json.loads` with integers of any length (`_json_int`)."""
    return json.loads(text, parse_int=_json_int)


def _read_jsonl(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    """One JSON object per line, decoded line by line from bytes so an encoding error has a byte offset."""
    row = offset = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line_start, offset = offset, offset + len(raw)
            if limit is not None and row >= limit:
                return
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, line_start = raw[len(codecs.BOM_UTF8):], line_start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFormatError(str(path), row, None, _not_utf8(err, line_no, line_start + err.start)) from None
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield row, _loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(
                    str(path), row, None, f"line {line_no} is not valid JSON ({err})"
                ) from err
            row += 1


def _read_json(path: Path, limit: int | None) -> Iterator[tuple[int, Any]]:
    data = path.read_bytes()
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = start + err.start
        raise DataFormatError(str(path), None, None, _not_utf8(err, data.count(b"\n", 0, offset) + 1, offset)) from None
    try:
        rows = _loads(text)
    except json.JSONDecodeError as err:
        raise DataFormatError(str(path), None, None, f"not valid JSON ({err})") from err
    if not isinstance(rows, list):
        raise DataFormatError(
            str(path), None, None, f"expected a JSON list of rows, got {type(rows).__name__}"
        )
    yield from enumerate(rows[:limit] if limit is not None else rows)


def _nonempty_str(value: Any, path: str, row: int, name: str) -> str:
    if not isinstance(value, str):
        raise DataFormatError(path, row, name, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataFormatError(path, row, name, "is empty")
    return value


def _answer(value: Any, path: str, row: int, name: str) -> str:
    # JSON integers are unambiguous answers; floats are not ("27.0" never matches "27").
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        raise DataFormatError(
            path, row, name, f'is the float {value!r}; store answers as strings (e.g. "27") in the dataset'
        )
    return _nonempty_str(value, path, row, name)


def _messages(value: Any, path: str, row: int) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataFormatError(path, row, "prompt", "expected a non-empty list of chat messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataFormatError(path, row, f"prompt[{i}]", f"expected a dict, got {type(message).__name__}")
        role = _nonempty_str(message.get("role"), path, row, f"prompt[{i}].role")
        content = _nonempty_str(message.get("content"), path, row, f"prompt[{i}].content")
        messages.append({"role": role, "content": content})
    return messages


def _data_source(row_dict: dict[str, Any], default: str, path: str, row: int) -> str:
    value = row_dict.get("data_source", default)
    if not isinstance(value, str):
        raise DataFormatError(path, row, "data_source", f"expected a string, got {type(value).__name__}")
    return value


def _dapo_row(raw: dict[str, Any], path: str, row: int, default_source: str) -> PromptRecord:
    messages = _messages(raw["prompt"], path, row)
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict):
        raise DataFormatError(path, row, "reward_model", "expected a struct with a 'ground_truth' string")
    ground_truth = _answer(reward_model.get("ground_truth"), path, row, "reward_model.ground_truth")
    extra = {k: v for k, v in raw.items() if k not in ("prompt", "reward_model", "data_source")}
    return PromptRecord(
        messages=messages,
        ground_truth=ground_truth,
        data_source=_data_source(raw, default_source, path, row),
        index=row,
        extra=extra,
    )


def _simple_row(
    raw: dict[str, Any], path: str, row: int, default_source: str, apply_template: bool
) -> PromptRecord:
    problem_key = next((k for k in PROBLEM_KEYS if k in raw), None)
    if problem_key is None:
        raise DataFormatError(path, row, "/".join(PROBLEM_KEYS), "no problem text: add one of these keys")
    answer_key = next((k for k in ANSWER_KEYS if k in raw), None)
    if answer_key is None:
        raise DataFormatError(path, row, "/".join(ANSWER_KEYS), "no ground truth: add one of these keys")
    problem = _nonempty_str(raw[problem_key], path, row, problem_key)
    ground_truth = _answer(raw[answer_key], path, row, answer_key)
    content = apply_dapo_template(problem) if apply_template else problem
    extra = {k: v for k, v in raw.items() if k not in (problem_key, answer_key, "data_source")}
    return PromptRecord(
        messages=[{"role": "user", "content": content}],
        ground_truth=ground_truth,
        data_source=_data_source(raw, default_source, path, row),
        index=row,
        extra=extra,
    )


def _check_positive(name: str, value: Any, allow_none: bool) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"load_prompts: {name} must be an int >= 1, got {value!r}")


def load_prompts(
    path: str | os.PathLike[str],
    *,
    repeat: int = 1,
    limit: int | None = None,
    apply_template: bool = True,
) -> list[PromptRecord]:
    """Read a prompt dataset; the result has `repeat * min(limit, rows)` records.

    `limit` keeps the first rows of the file; `repeat` concatenates the whole list `repeat`
    times (AIME x32 for avg@32), so repeats of a prompt share `index`. `apply_template` only
    concerns simple rows (DAPO-schema prompts are already templated).
    """
    _check_positive("repeat", repeat, allow_none=False)
    _check_positive("limit", limit, allow_none=True)
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataFormatError(str(file), None, None, f"has suffix {suffix!r}; expected one of {', '.join(SUFFIXES)}")
    if not file.is_file():
        raise FileNotFoundError(f"load_prompts: no such dataset file: {file}")
    reader = {".parquet": _read_parquet, ".jsonl": _read_jsonl, ".json": _read_json}[suffix]
    default_source = file.stem
    records = []
    for row, raw in reader(file, limit):
        if not isinstance(raw, dict):
            raise DataFormatError(str(file), row, None, f"expected an object, got {type(raw).__name__}")
        if isinstance(raw.get("prompt"), list):
            records.append(_dapo_row(raw, str(file), row, default_source))
        else:
            records.append(_simple_row(raw, str(file), row, default_source, apply_template))
    if not records:
        raise DataFormatError(str(file), None, None, "contains no rows")
    return records * repeat
