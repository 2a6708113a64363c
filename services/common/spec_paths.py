"""The local paths a JobSpec names, and making them absolute where the spec is submitted.

The api checks the paths (services/api/spec_checks.py) and the services read them on the api's
host, in their own working directories; a relative path written by a user means the user's
working directory. ``absolute_paths`` rewrites each relative path against the submitter's current
directory (as a shell or a command-line argument would read it, and as the shipped examples are
written: ``.verst/models/…`` from the directory ``verst up`` runs in), before the spec is sent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from services.common.config import JobSpec, parse_job_spec
from services.common.eval_sets import eval_set_sources
from services.data import DataError, source_of
from services.models.paths import is_hub_id

FieldPath = tuple[str, ...]


def not_a_local_path(value: str, base: Path | None = None) -> bool:
    """A ``builtin:`` model, or a hub id (no such local path, relative to ``base`` when given):
    nothing outside verst's and the Hugging Face cache is read for it."""
    local = value if base is None else base / value
    return value.startswith("builtin:") or (not os.path.lexists(local) and is_hub_id(value))


def local_paths(spec: JobSpec) -> list[tuple[FieldPath, str]]:
    """The local paths the job reads: its model and tokenizer, and the locations of the data
    sources that ``reads_path``; a user's source is imported here (``DataError`` if it cannot be)."""
    return model_paths(spec) + data_paths(spec)


def model_paths(spec: JobSpec, base: Path | None = None) -> list[tuple[FieldPath, str]]:
    """(field, path) of model.path, model.tokenizer and model.lora.init_from where they are local
    (relative ones looked for under ``base`` when given)."""
    model = spec.model
    paths = [(("model", "path"), model.path), (("model", "tokenizer"), model.tokenizer)]
    found = [
        (field, value) for field, value in paths if value is not None and not not_a_local_path(value, base)
    ]
    if model.lora is not None and model.lora.init_from is not None:
        found.append((("model", "lora", "init_from"), model.lora.init_from))
    return found


def data_paths(spec: JobSpec) -> list[tuple[FieldPath, str]]:
    """(field, path) of data.train, data.eval and the eval sets' locations where their source
    reads a local path."""
    locations = [(("data", "train"), spec.data, spec.data.train)]
    locations += [(held.field, held.data, held.data.eval) for held in eval_set_sources(spec)]
    found = []
    for field, data, location in locations:
        if location is not None:
            source, path = source_of(data, location)
            if source.reads_path:
                found.append((field, path))
    return found


def absolute_paths(spec: JobSpec, base: Path | None = None) -> JobSpec:
    """``spec`` with every relative local path it names made absolute against ``base`` (default:
    the current directory), ``~`` expanded. A ``<source>:`` prefix stays; ``trainer.checkpoint_dir``
    is rewritten only when the spec sets it (its default is the api's own ``runs``); the data of a
    source that cannot be imported here is left for the api to judge."""
    base = Path.cwd() if base is None else base
    found = model_paths(spec, base)
    with contextlib.suppress(DataError):
        found += data_paths(spec)
    if "checkpoint_dir" in spec.trainer.model_fields_set:
        found.append((("trainer", "checkpoint_dir"), spec.trainer.checkpoint_dir))
    data = spec.model_dump(mode="json")
    changed = False
    for field, path in found:
        absolute = str(base / Path(path).expanduser())
        if absolute != path:
            _replace_tail(data, field, path, absolute)
            changed = True
    return parse_job_spec(data) if changed else spec


def _replace_tail(data: dict[str, Any], field: FieldPath, path: str, absolute: str) -> None:
    """Set ``field`` of the spec's ``data`` to its value with the trailing ``path`` (a source's
    location, after any ``<source>:`` prefix) replaced by ``absolute``."""
    *parents, last = field
    node = data
    for part in parents:
        node = node[part]
    value = node[last]
    node[last] = value[: len(value) - len(path)] + absolute
