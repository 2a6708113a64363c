"""One row of a file or table as a PromptExample: what the JSONL, CSV, Parquet and ``datasets``
sources share, so that the same data reads the same whatever holds it.

A row is a mapping of field (key, column) to value. The job's data section names the fields:

- ``data.messages_field``: the row's chat messages (OpenAI format, chat.check_messages), read
  unless ``data.format`` is ``text``; a row whose messages are absent or null is a prompt row;
- ``data.prompt_field``: the prompt string of a prompt row;
- ``data.answer_field``: the reference answer, a non-empty string or a number;
- ``data.metadata_fields``: copied into the example's metadata (strings as they are, other values
  as JSON), which reaches the reward with every sample.

A null value is an absent one (a table's column that a row leaves empty). A bad row is a
``DataError`` whose message starts with ``where`` (the file and the row).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from services.data.chat import check_messages, last_user_text
from services.data.prompts import DataError, PromptExample


class RowSettings(Protocol):
    """The fields of the job's data section (``DataConfig``) that say how a row is read."""

    @property
    def prompt_field(self) -> str: ...

    @property
    def answer_field(self) -> str: ...

    @property
    def messages_field(self) -> str: ...

    @property
    def metadata_fields(self) -> Collection[str]: ...

    @property
    def format(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RowFields:
    """Row settings outside a job: a file of prompt strings and answers, no messages or metadata."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    messages_field: str = "messages"
    metadata_fields: tuple[str, ...] = ()
    format: str = "text"


def read_row(record: Mapping[str, Any], where: str, prompt_id: str, data: RowSettings) -> PromptExample:
    """The PromptExample of one row; ``DataError`` naming ``where`` and the field when it is bad."""
    messages: tuple[dict[str, Any], ...] = ()
    if data.format != "text" and record.get(data.messages_field) is not None:
        try:
            messages = check_messages(record[data.messages_field], f"{where}: field {data.messages_field!r}")
        except ValueError as err:
            raise DataError(str(err)) from None
        text = last_user_text(messages)
    else:
        text = field_text(
            record, data.prompt_field, where, data.messages_field if data.format != "text" else None
        )
    answer = field_text(record, data.answer_field, where)
    metadata = {name: _metadata(record, name, where) for name in data.metadata_fields}
    return PromptExample(prompt_id, text, answer, messages, metadata)


def field_text(record: Mapping[str, Any], field: str, where: str, instead: str | None = None) -> str:
    """A field's text: a non-empty string, or a number (an answer written as 132)."""
    value = record.get(field)
    if value is None:
        alternative = f" (or {instead!r})" if instead else ""
        present = ", ".join(sorted(k for k, v in record.items() if v is not None)) or "none"
        raise DataError(f"{where}: missing field {field!r}{alternative} (fields present: {present})")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field {field!r} must be a non-empty string, got {value!r:.200}")
    return value


def _metadata(record: Mapping[str, Any], field: str, where: str) -> str:
    if field not in record:
        raise DataError(f"{where}: missing metadata field {field!r} (data.metadata_fields)")
    value = record[field]
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        raise DataError(f"{where}: metadata field {field!r} is not plain JSON: {value!r:.200}") from None


def needed_columns(columns: Collection[str], data: RowSettings, where: str) -> list[str]:
    """The columns of a table that its rows are read from (only those are loaded); ``DataError``
    naming the file when a field the job names is no column at all."""
    messages = data.format != "text" and data.messages_field in columns
    required = [data.answer_field, *data.metadata_fields] + ([] if messages else [data.prompt_field])
    missing = [name for name in required if name not in columns]
    if missing:
        alternative = (
            f" (or {data.messages_field!r})" if data.prompt_field in missing and data.format != "text" else ""
        )
        raise DataError(
            f"{where}: no column {', '.join(map(repr, missing))}{alternative}"
            f" (columns: {', '.join(columns) or 'none'})"
        )
    wanted = [
        data.prompt_field,
        data.messages_field if messages else "",
        data.answer_field,
        *data.metadata_fields,
    ]
    return [name for name in dict.fromkeys(wanted) if name in columns]


def table_examples(
    rows: Iterable[Mapping[str, Any]], where: str, id_prefix: str, data: RowSettings
) -> list[PromptExample]:
    """Every row of a table as a PromptExample: ``prompt_id`` ``"{id_prefix}:{row}"``, a bad row
    named ``"{where}: row {row}"`` (rows count from 1)."""
    examples = [
        read_row(row, f"{where}: row {number}", f"{id_prefix}:{number}", data)
        for number, row in enumerate(rows, start=1)
    ]
    if not examples:
        raise DataError(f"{where}: no prompts (no rows)")
    return examples
