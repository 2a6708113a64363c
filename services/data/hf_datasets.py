"""The ``datasets`` data source: a Hugging Face ``datasets`` directory, as ``save_to_disk`` writes it.

A ``DatasetDict`` (``dataset_dict.json`` beside a directory per split) gives one split:
``data.train_split`` for ``data.train`` (``train`` when null) and ``data.eval_split`` for
``data.eval`` (``test`` when null); a split it does not have is a ``DataError`` listing those it
has. A single ``Dataset`` (``state.json``, or one split's own directory) has no splits, and a
split the job names for it is refused. ``data.source: auto`` recognises both by those files.

Rows are read like the JSONL rows (rows.py): only the columns the job names are loaded, a
messages column is a list of message structs (their missing keys are nulls), and a row's
``prompt_id`` is ``"{directory name}:{split}:{row}"`` (``"{directory name}:{row}"`` for a single
Dataset), rows counting from 1. Nothing is downloaded: the directory is read where it lies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.data.prompts import DataError, PromptExample
from services.data.rows import RowSettings, needed_columns, table_examples
from services.data.sources import SourceRequest, Split, check_options, split_field, wanted_split

DEFAULT_SPLITS: dict[Split, str] = {"train": "train", "eval": "test"}
"""The split of a DatasetDict each of the job's splits reads when its field is null."""


def datasets_source(request: SourceRequest) -> list[PromptExample]:
    """Every row of the wanted split of the ``datasets`` directory at ``request.location``."""
    check_options(request, "datasets")
    return read_dataset_rows(request.location, request.data, request.split, wanted_split(request))


def read_dataset_rows(
    path: str | Path, data: RowSettings, role: Split = "train", split: str | None = None
) -> list[PromptExample]:
    """Every row of one split of a ``datasets`` directory (the module docstring says which)."""
    path = Path(path)
    loaded = _load(path)
    from datasets import DatasetDict

    if isinstance(loaded, DatasetDict):
        name = split or DEFAULT_SPLITS[role]
        if name not in loaded:
            field = split_field(role)
            have = ", ".join(loaded) or "none"
            raise DataError(f"{field}: {path} has no split {name!r} (its splits: {have})")
        dataset, where, prefix = loaded[name], f"{path} (split {name})", f"{path.name}:{name}"
    else:
        if split is not None:
            raise DataError(
                f"{split_field(role)} is {split!r}, but {path} is a single Dataset, which has no splits"
            )
        dataset, where, prefix = loaded, str(path), path.name
    columns = needed_columns(dataset.column_names, data, where)
    return table_examples(iter(dataset.select_columns(columns)), where, prefix, data)


def _load(path: Path) -> Any:
    """The Dataset or DatasetDict saved at ``path``; ``DataError`` saying why there is none."""
    if not path.is_dir():
        raise DataError(f"cannot read prompts from {path}: not a directory (a datasets directory is one)")
    from datasets import load_from_disk

    try:
        return load_from_disk(str(path))
    except (OSError, ValueError, KeyError, TypeError) as err:  # no state.json, a corrupt arrow file
        raise DataError(
            f"{path}: not a datasets directory written by save_to_disk ({type(err).__name__}: {err})"
        ) from None
