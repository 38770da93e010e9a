"""Row checks of local jsonl/json/parquet files, before HF datasets reads them: every row must hold
a string under `data.text_key`. datasets cannot say which file or line a row came from, and it
silently turns a number into a string where another block or file holds strings; so each file is
checked in a pass of its own, and a bad row is named by file and line (or row)."""

from __future__ import annotations

import codecs
import json
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bigtrain.errors import ConfigError


@dataclass
class RowCheck:
    num_rows: int = 0
    num_bad: int = 0
    """Rows without a string under the key."""
    first_bad: str = ""
    """Where the first bad row is and what is wrong with it, such as `line 3: 'text' is null`."""


_MISSING = object()
_JSON_TYPES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "an array",
    dict: "an object",
}
_JSON_SPACE = b" \t\r\n"


def check_rows(path: Path, kind: str, key: str) -> RowCheck:
    """Count the rows of one file whose `key` is missing, null or not a string."""
    if kind == "parquet":
        return _check_parquet(path, key)
    check = RowCheck()
    for where, row in _json_rows(path):
        check.num_rows += 1
        value = row.get(key, _MISSING)
        if not isinstance(value, str):
            check.num_bad += 1
            if check.num_bad == 1:
                check.first_bad = f"{where}: {_problem(row, key, value)}"
    return check


def copy_good_rows(path: Path, key: str, dest: Path) -> Path:
    """Write the rows of a JSON file that hold a string under `key` to `dest`, as JSON lines."""
    with dest.open("w", encoding="utf-8") as out:
        for _, row in _json_rows(path):
            if isinstance(row.get(key), str):
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return dest


def _problem(row: dict, key: str, value: object) -> str:
    if value is _MISSING:
        return f"no key '{key}' (keys: {', '.join(sorted(row)[:10])})"
    if value is None:
        return f"'{key}' is null"
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    return f"'{key}' is {kind} ({reprlib.repr(value)})"


def _json_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(`line N` or `row N`, row) for each row of a JSON lines file, or of a file that holds one
    JSON array: the two forms that the `json` loader of datasets reads."""
    with path.open("rb") as f:
        is_array = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
        f.seek(0)
        if is_array:
            rows = enumerate(_parse_json(path, f.read()), 1)
        else:
            lines = enumerate(f, 1)
            rows = ((n, _parse_json(path, x, n)) for n, x in lines if x.strip(_JSON_SPACE))
        where = "row" if is_array else "line"
        for n, row in rows:
            if is_array and isinstance(row, str):  # datasets reads a list of strings as `text`
                row = {"text": row}
            if not isinstance(row, dict):
                raise ConfigError(f"data.paths: '{path}' {where} {n} is not a JSON object")
            yield f"{where} {n}", row


def _parse_json(path: Path, text: bytes, line: int | None = None) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = line if line is not None else e.lineno
        raise ConfigError(
            f"data.paths: '{path}' line {at} is not valid JSON: {e.msg} (column {e.colno})"
        ) from None
    except UnicodeDecodeError as e:
        at = f" line {line}" if line is not None else ""
        raise ConfigError(f"data.paths: '{path}'{at} is not UTF-8 text: {e}") from None


def _check_parquet(path: Path, key: str) -> RowCheck:
    """check_rows for parquet, a column at a time: a column of strings can only hold nulls; any
    other type, or no such column, makes every row bad."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    data = pq.ParquetFile(path)
    num_rows, schema = data.metadata.num_rows, data.schema_arrow
    if key not in schema.names:
        problem = _problem(dict.fromkeys(schema.names), key, _MISSING)
        return RowCheck(num_rows, num_rows, f"row 1: {problem}")
    column_type = schema.field(key).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        problem = f"'{key}' holds {column_type} values, not strings"
        return RowCheck(num_rows, num_rows, f"row 1: {problem}")
    check, offset = RowCheck(num_rows), 0
    for batch in data.iter_batches(columns=[key]):
        column = batch.column(0)
        if column.null_count and not check.num_bad:
            first = pc.index(column.is_null(), True).as_py()
            check.first_bad = f"row {offset + first + 1}: '{key}' is null"
        check.num_bad += column.null_count
        offset += len(column)
    return check
