"""The ``jsonl`` data source: a file of JSON objects, one a line, each a prompt (or chat messages)
and its answer.

The job's data section names the keys (rows.py: ``prompt_field``, ``messages_field``,
``answer_field``, ``metadata_fields``); other keys are ignored. A row's ``prompt_id`` is
``"{file name}:{line number}"``; a bad line is a ``DataError`` naming the file and line, raised
when the file is read (when the job starts, and when the api checks the spec).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.data.prompts import DataError, PromptExample
from services.data.rows import RowFields, RowSettings, read_row
from services.data.sources import SourceRequest, check_options, refuse_split


def jsonl_source(request: SourceRequest) -> list[PromptExample]:
    """Every row of the JSONL file at ``request.location`` (the same file for either split)."""
    check_options(request, "jsonl")
    refuse_split(request, "JSONL")
    return read_jsonl_rows(request.location, request.data)


def read_jsonl_prompts(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptExample]:
    """Every record of a JSONL file of prompt strings as a PromptExample (``read_jsonl_rows``)."""
    return read_jsonl_rows(path, RowFields(prompt_field, answer_field))


def read_jsonl_rows(path: str | Path, data: RowSettings) -> list[PromptExample]:
    """Every record of a JSONL file as a PromptExample (blank lines are skipped).

    ``prompt_id`` is ``"{file name}:{line number}"``. A line that is not a JSON object with the
    fields ``data`` names raises ``DataError`` naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(
            f"{path} is a directory: verst reads a directory as a datasets directory (save_to_disk's"
            " dataset_dict.json or state.json), which it is not"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(f"cannot read prompts from {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: invalid JSON: {err.msg} (column {err.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        examples.append(read_row(record, where, f"{path.name}:{number}", data))
    if not examples:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return examples
