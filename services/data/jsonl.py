"""The ``jsonl`` data source: a file of JSON objects, one a line, each a prompt and its answer.

``data.prompt_field`` and ``data.answer_field`` name the two keys; other keys are ignored. A row's
``prompt_id`` is ``"{file name}:{line number}"``; a bad line is a ``DataError`` naming the file and
line, raised when the file is read (when the job starts, and when the api checks the spec).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.data.prompts import DataError, PromptExample
from services.data.sources import SourceRequest, check_options


def jsonl_source(request: SourceRequest) -> list[PromptExample]:
    """Every row of the JSONL file at ``request.location`` (the same file for either split)."""
    check_options(request, "jsonl")
    return read_jsonl_prompts(request.location, request.data.prompt_field, request.data.answer_field)


def _field_text(record: dict[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise DataError(f"{where}: missing field {field!r} (fields present: {', '.join(sorted(record))})")
    value = record[field]
    # Numbers are accepted for answers written as JSON numbers (e.g. "answer": 132); bool is not one.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def read_jsonl_prompts(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[PromptExample]:
    """Every record of a JSONL file as a PromptExample (blank lines are skipped).

    ``prompt_id`` is ``"{file name}:{line number}"``. A line that is not a JSON
    object with both fields raises ``DataError`` naming the file and line.
    """
    path = Path(path)
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
        prompt = _field_text(record, prompt_field, where)
        answer = _field_text(record, answer_field, where)
        examples.append(PromptExample(f"{path.name}:{number}", prompt, answer))
    if not examples:
        raise DataError(f"{path}: no prompts (the file is empty)")
    return examples
