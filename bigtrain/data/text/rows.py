"""Rows of local jsonl/json/parquet files (and hub datasets), read one at a time and checked on the
way: every row must hold a string under `data.text_key`. A bad row is a ConfigError naming the file
and the line (or row) and the key, unless `data.skip_bad_rows`, which skips and counts it."""

from __future__ import annotations

import codecs
import json
import reprlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bigtrain.errors import ConfigError

PARQUET_BATCH_ROWS = 1024
"""Rows per parquet read: memory stays a few batches of documents whatever the file's size."""


@dataclass
class RowCheck:
    """The rows of one file read so far, and what happens to a bad one."""

    origin: str
    """How messages name the file, such as `data.paths: 'a.jsonl'`."""
    key: str
    skip_bad_rows: bool
    num_rows: int = 0
    num_bad: int = 0
    """Rows without a string under the key (only counted with skip_bad_rows)."""
    first_bad: str = ""
    """Where the first bad row is and what is wrong with it, such as `line 3: 'text' is null`."""
    num_bytes: int = 0
    """Bytes of the file read so far (for progress)."""

    def bad(self, where: str, problem: str, count: int = 1) -> None:
        """`count` bad rows, the first at `where`: an error, or skipped and counted."""
        if not self.skip_bad_rows:
            raise ConfigError(
                f"{self.origin} {where}: {problem}; expected a string under "
                f"data.text_key='{self.key}' in every row (data.skip_bad_rows=true skips such rows)"
            )
        if not self.num_bad:
            self.first_bad = f"{where}: {problem}"
        self.num_bad += count

    def finish(self) -> None:
        """At the end of the file: one without a good row holds no documents."""
        if self.num_rows == 0:  # such as `[]`: blank files are refused before they are read
            raise ConfigError(f"{self.origin} holds no documents")
        if self.num_bad == self.num_rows:
            raise ConfigError(
                f"{self.origin} holds no documents: none of its {self.num_rows} rows has a "
                f"string under data.text_key='{self.key}' ({self.first_bad})"
            )


_MISSING = object()
_JSON_TYPES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "an array",
    dict: "an object",
}
_JSON_SPACE = b" \t\r\n"


def row_texts(rows: Iterable[tuple[str, dict, int]], check: RowCheck) -> Iterator[str]:
    """The string under the key of each (where, row, bytes) row; bad rows go to `check`."""
    for where, row, num_bytes in rows:
        check.num_rows += 1
        check.num_bytes += num_bytes
        value = row.get(check.key, _MISSING)
        if isinstance(value, str):
            yield value
        else:
            check.bad(where, _problem(row, check.key, value))
    check.finish()


def json_texts(path: Path, check: RowCheck) -> Iterator[str]:
    """The texts of a JSON lines file, or of a file that holds one JSON array."""
    return row_texts(_json_rows(path), check)


def _problem(row: dict, key: str, value: object) -> str:
    if value is _MISSING:
        return f"no key '{key}' (keys: {', '.join(sorted(row)[:10])})"
    if value is None:
        return f"'{key}' is null"
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    return f"'{key}' is {kind} ({reprlib.repr(value)})"


def _json_rows(path: Path) -> Iterator[tuple[str, dict, int]]:
    """(`line N` or `row N`, row, bytes read for it) for each row of a JSON lines file, or of a
    file that holds one JSON array (read whole: use JSON lines for large files): the two forms
    that the `json` loader of HF datasets reads."""
    with path.open("rb") as f:
        is_array = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
        f.seek(0)
        if is_array:
            data = f.read()
            rows = ((n, x, len(data) if n == 1 else 0) for n, x in enumerate(_parse(path, data), 1))
        else:
            rows = ((n, _parse(path, x, n), len(x)) for n, x in enumerate(f, 1) if _has_row(x))
        where = "row" if is_array else "line"
        for n, row, num_bytes in rows:
            if is_array and isinstance(row, str):  # datasets reads a list of strings as `text`
                row = {"text": row}
            if not isinstance(row, dict):
                raise ConfigError(f"data.paths: '{path}' {where} {n} is not a JSON object")
            yield f"{where} {n}", row, num_bytes


def _has_row(line: bytes) -> bool:
    return bool(line.strip(_JSON_SPACE))


def _parse(path: Path, text: bytes, line: int | None = None) -> object:
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


def parquet_texts(path: Path, check: RowCheck) -> Iterator[str]:
    """The texts of a parquet file's `key` column, a batch of rows at a time: a column of strings
    can only hold nulls; any other type, or no such column, makes every row bad."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    data = pq.ParquetFile(path)
    num_rows, schema, size = data.metadata.num_rows, data.schema_arrow, path.stat().st_size
    key = check.key
    problem = ""
    if key not in schema.names:
        problem = _problem(dict.fromkeys(schema.names), key, _MISSING)
    elif not (pa.types.is_string(t := schema.field(key).type) or pa.types.is_large_string(t)):
        problem = f"'{key}' holds {t} values, not strings"
    if problem:
        check.bad("row 1", problem, num_rows)
        check.num_rows, check.num_bytes = num_rows, size
        check.finish()
        return
    for batch in data.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[key]):
        column = batch.column(0)
        if column.null_count:
            first = pc.index(column.is_null(), True).as_py()
            check.bad(f"row {check.num_rows + first + 1}", f"'{key}' is null", column.null_count)
        check.num_rows += len(column)
        check.num_bytes = size * check.num_rows // max(num_rows, 1)
        yield from (text for text in column.to_pylist() if text is not None)
    check.finish()
