"""The ``parquet`` and ``csv`` data sources: a table whose rows are prompts (or chat messages)
and their answers, read like the JSONL rows (rows.py).

- ``parquet`` (``.parquet``, read with pyarrow): only the columns the job names are loaded, a
  batch at a time; a messages column is a list of structs (what pandas or ``datasets`` write for
  a column of message lists), and a struct's missing keys are its nulls.
- ``csv`` (``.csv``, the standard library's reader, UTF-8, a header row): every cell is text and
  an empty cell is a missing value; a messages cell is JSON text.

A row's ``prompt_id`` is ``"{file name}:{row}"`` (rows count from 1, the header aside); a bad row
is a ``DataError`` naming the file and the row, and a field that is no column names the file.
Neither table has splits: ``data.train_split`` / ``data.eval_split`` are refused for them.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.data.prompts import DataError, PromptExample
from services.data.rows import RowSettings, needed_columns, read_row, table_examples
from services.data.sources import SourceRequest, check_options, refuse_split

PARQUET_BATCH_ROWS = 4096
"""Rows pyarrow decodes at a time."""


def parquet_source(request: SourceRequest) -> list[PromptExample]:
    """Every row of the Parquet file at ``request.location`` (the same file for either split)."""
    check_options(request, "parquet")
    refuse_split(request, "Parquet")
    return read_parquet_rows(request.location, request.data)


def csv_source(request: SourceRequest) -> list[PromptExample]:
    """Every row of the CSV file at ``request.location`` (the same file for either split)."""
    check_options(request, "csv")
    refuse_split(request, "CSV")
    return read_csv_rows(request.location, request.data)


def read_parquet_rows(path: str | Path, data: RowSettings) -> list[PromptExample]:
    """Every row of a Parquet file as a PromptExample (the module docstring says how)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.ParquetFile(path)
    except OSError as err:  # pyarrow's own errors for a file that is no Parquet are OSErrors too
        if not path.is_file():
            raise DataError(f"cannot read prompts from {path}: {err.strerror or 'no such file'}") from None
        raise DataError(f"{path}: not a Parquet file ({err})") from None
    except pa.ArrowException as err:
        raise DataError(f"{path}: not a Parquet file ({err})") from None
    columns = needed_columns(table.schema_arrow.names, data, str(path))

    def rows() -> Iterator[dict[str, Any]]:
        try:
            for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                yield from batch.to_pylist()
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read its rows ({err})") from None

    return table_examples(rows(), str(path), path.name, data)


def read_csv_rows(path: str | Path, data: RowSettings) -> list[PromptExample]:
    """Every row of a CSV file with a header row as a PromptExample (the module docstring says how)."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as file:
            return _csv_examples(csv.DictReader(file), path, data)
    except OSError as err:
        raise DataError(f"cannot read prompts from {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _csv_examples(reader: csv.DictReader[str], path: Path, data: RowSettings) -> list[PromptExample]:
    try:
        header = reader.fieldnames or []
    except csv.Error as err:
        raise DataError(f"{path}: line 1: not CSV ({err})") from None
    needed_columns(header, data, str(path))
    examples = []
    number = 0
    while True:
        try:
            row = next(reader, None)
        except csv.Error as err:
            raise DataError(f"{path}: row {number + 1} (line {reader.line_num}): not CSV ({err})") from None
        if row is None:
            break
        number += 1
        where = f"{path}: row {number} (line {reader.line_num})"
        if None in row:  # DictReader keeps the cells beyond the header under the key None
            raise DataError(
                f"{where}: {len(header) + len(row[None])} cells, but the header names {len(header)}"
            )
        cells = {name: (value or None) for name, value in row.items()}  # an empty cell is a missing value
        examples.append(read_row(cells, where, f"{path.name}:{number}", data))
    if not examples:
        raise DataError(f"{path}: no prompts (no rows below the header)")
    return examples
