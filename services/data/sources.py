"""Data sources: the plug-in point that turns a JobSpec's ``data`` section into prompts.

The contract, in this one place. A data source is a function

    def my_source(request: SourceRequest) -> Iterable[PromptExample]

that gets what the job names (``request.location``: the text of ``data.train`` or ``data.eval``
after the source's name), which split is wanted (``"train"`` or ``"eval"``), the job's data
section (``request.data``: the fields that name a row's parts, ``train_split`` / ``eval_split``,
and the free ``options`` mapping) and the job's seed (for ``"train"``; 0 for ``"eval"``, whose
rows must not depend on the job). It raises ``DataError`` for data it cannot read, naming the
file and row of a bad one. What it returns depends on its traits (``DataSource``):

- ``endless``: the train split is an iterator that never ends (a procedural generator, seeded
  by ``request.seed``); verst takes prompts from it as it needs them. Otherwise the rows are
  finite: verst reads them all at once and repeats them epoch after epoch, shuffled per epoch
  by the job's seed when ``data.shuffle`` is set. The eval split is always finite.
- ``reads_path``: the location is a local file or directory, so the api confines it to
  ``VERST_DATA_ROOTS`` and checks that it exists before the job is queued.
- ``suffixes``: file names ending so are read by this source when ``data.source`` is ``auto``.
- ``markers``: a directory holding one of these files is read by this source when
  ``data.source`` is ``auto`` (``dataset_dict.json``: a ``datasets`` directory).

A source that reads rows of a file or table reads each with ``rows.read_row``, so that the same
data gives the same prompts whatever holds it, and names a bad row by its file and row.

``data.source`` picks the source: ``auto`` (the default) reads each location's own form —
``<name>:<rest>`` is the registered source ``name`` given ``<rest>`` (``builtin:addition``), a
file ending in a registered suffix goes to its source, a directory holding a registered marker
file to its source, and any other path is JSONL, as verst has always read it; a registered name
reads both locations with that source; a user's ``module:function`` (declaring its traits with
``services.common.plugins.traits``) likewise. Built-ins: ``jsonl`` (jsonl.py), ``parquet`` and
``csv`` (tables.py), ``datasets`` (hf_datasets.py: a Hugging Face ``datasets`` directory written
by ``save_to_disk``, one split of it), ``reasoning_gym`` (reasoning_gym.py: the reasoning-gym
package's procedural tasks) and ``builtin`` (the toy tasks of ``services/tasks``, registered
by path: this package never imports the tasks). The job's splits are read through
``services.data.train_prompts`` / ``eval_prompts`` (splits.py).

This module imports no JobSpec: the JobSpec (services/common/config.py) imports it to check
``data.source`` against ``DATA_SOURCES``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from services.common.plugins import PLUGIN_PATH, REFUSED_PACKAGES, is_plugin_path
from services.common.registry import Entry, Registry
from services.data.prompts import DataError, PromptExample
from services.data.rows import RowSettings

Split = Literal["train", "eval"]
"""Which rows a source is asked for: the training prompts or the held-out ones."""
AUTO = "auto"
"""``data.source``'s default: each location says which source reads it."""
FILE_SOURCE = "jsonl"
"""What ``auto`` reads a path with when neither a ``<name>:`` prefix nor a suffix names a source."""
OPTIONS_JSON_CHARS = 65_536
"""Longest ``data.options``, as JSON text."""
SOURCE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
"""The form of a registered source's name, and of a location's ``<name>:`` prefix."""


class SourceSettings(RowSettings, Protocol):
    """The fields of the job's data section (``DataConfig``) that a source may read: how a row is
    read (rows.py), the splits, and the source's options."""

    @property
    def train_split(self) -> str | None: ...

    @property
    def eval_split(self) -> str | None: ...

    @property
    def options(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class SourceRequest:
    """What a data source is asked for."""

    location: str
    """What the job names after the source: a path (``reads_path``), a task, a dataset's id."""
    split: Split
    """``"train"`` or ``"eval"``."""
    data: SourceSettings
    """The job's data section: the row's fields, the splits wanted, ``options``."""
    seed: int
    """The job's seed for the train split; 0 for eval."""


class DataSourceFn(Protocol):
    """A data source: the rows of one split (an endless iterator for an ``endless`` train split)."""

    def __call__(self, request: SourceRequest) -> Iterable[PromptExample]: ...


@dataclass(frozen=True, slots=True)
class DataSource(Entry[DataSourceFn]):
    """A data source and how verst treats its rows."""

    endless: bool = False
    """Its train split generates forever; else its rows are repeated, shuffled per epoch."""
    reads_path: bool = False
    """Its location is a local file or directory: confined to VERST_DATA_ROOTS, checked to exist."""
    suffixes: tuple[str, ...] = ()
    """File endings ``data.source: auto`` reads with it (``.jsonl``)."""
    markers: tuple[str, ...] = ()
    """Files that mark a directory ``data.source: auto`` reads with it (``dataset_dict.json``)."""


DATA_SOURCES: Registry[DataSource] = Registry(
    DataSource, kind="data source", field="data.source", owner="controller"
)
"""Every data source by the name ``data.source`` (or a ``<name>:`` prefix) uses."""
DATA_SOURCES.register_lazy("jsonl", "services.data.jsonl:jsonl_source", reads_path=True, suffixes=(".jsonl",))
DATA_SOURCES.register_lazy(
    "parquet", "services.data.tables:parquet_source", reads_path=True, suffixes=(".parquet",)
)
DATA_SOURCES.register_lazy("csv", "services.data.tables:csv_source", reads_path=True, suffixes=(".csv",))
DATA_SOURCES.register_lazy(
    "datasets",
    "services.data.hf_datasets:datasets_source",
    reads_path=True,
    markers=("dataset_dict.json", "state.json"),
)
DATA_SOURCES.register_lazy("builtin", "services.tasks.catalog:builtin_source", endless=True)
DATA_SOURCES.register_lazy("reasoning_gym", "services.data.reasoning_gym:reasoning_gym_source")


def source_problem(source: str) -> str | None:
    """Why ``data.source`` cannot name a source (without importing a user's module), or None."""
    if source == AUTO or source in DATA_SOURCES:
        return None
    prefix = source.partition(":")[0]
    if prefix in DATA_SOURCES:
        return f"{source!r} is a location: set data.train to it and leave data.source auto"
    if is_plugin_path(source) and PLUGIN_PATH.fullmatch(source):
        if prefix.split(".")[0] in REFUSED_PACKAGES:
            return f"{source!r} may not come from the standard library or verst itself"
        return None
    return f"must be {AUTO}, one of {', '.join(DATA_SOURCES.names())}, or a user's module:function"


def pick_source(source: str, location: str) -> tuple[str, str]:
    """(the source that reads ``location``: a registered name or ``module:function``, what it gets).

    For ``auto`` a ValueError says why no source fits; a ``<name>:`` prefix that names no source is
    one, since a file whose name starts so can be written ``./name:…``.
    """
    if source != AUTO:
        return source, location.removeprefix(f"{source}:")  # `jsonl` + `jsonl:a.jsonl` is `a.jsonl`
    prefix, colon, rest = location.partition(":")
    if colon and SOURCE_NAME.fullmatch(prefix):
        if prefix not in DATA_SOURCES:
            known = ", ".join(DATA_SOURCES.names())
            raise ValueError(
                f"{location!r:.200} names no data source {prefix!r} (known: {known});"
                f" a file whose name starts so is ./{location:.200}"
            )
        return prefix, rest
    for name in DATA_SOURCES.names():
        if location.endswith(tuple(DATA_SOURCES.declared(name).get("suffixes", ()))):
            return name, location
    if os.path.isdir(location):  # a directory says what it is by the files it holds
        for name in DATA_SOURCES.names():
            markers = DATA_SOURCES.declared(name).get("markers", ())
            if any(os.path.isfile(os.path.join(location, marker)) for marker in markers):
                return name, location
    return FILE_SOURCE, location


def options_size_problem(options: Mapping[str, Any]) -> str | None:
    """Why ``data.options`` is too big or not plain JSON, or None."""
    try:
        size = len(json.dumps(options))
    except (TypeError, ValueError, RecursionError):
        return "must be plain JSON (objects, arrays, strings, numbers)"
    return (
        f"is {size} characters of JSON; at most {OPTIONS_JSON_CHARS}" if size > OPTIONS_JSON_CHARS else None
    )


def check_options(request: SourceRequest, source: str, takes: Collection[str] = ()) -> None:
    """``DataError`` naming ``data.options`` when it has a key the source does not take."""
    unknown = sorted(set(request.data.options) - set(takes))
    if unknown:
        accepted = ", ".join(sorted(takes)) or "none"
        raise DataError(
            f"data.options: the {source} source takes no {', '.join(unknown)} (its options: {accepted})"
        )


def wanted_split(request: SourceRequest) -> str | None:
    """The split of a dataset with splits that the request is for: ``data.train_split`` for the
    train rows, ``data.eval_split`` for the eval rows (None when the job leaves it to the source)."""
    return request.data.train_split if request.split == "train" else request.data.eval_split


def split_field(split: Split) -> str:
    """The field that picks the split of a dataset for the ``split`` rows."""
    return "data.train_split" if split == "train" else "data.eval_split"


def refuse_split(request: SourceRequest, kind: str) -> None:
    """``DataError`` naming the field when the job picks a split of a file that has none."""
    split = wanted_split(request)
    if split is not None:
        raise DataError(
            f"{split_field(request.split)} is {split!r}, but {request.location:.200} is a {kind} file,"
            " which has no splits (a split is picked from a datasets directory)"
        )
