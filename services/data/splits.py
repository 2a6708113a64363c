"""A job's training and held-out prompts, read through the data source its spec names.

``train_prompts`` is endless whatever the source: an ``endless`` source's iterator as it comes, a
finite source's rows epoch after epoch (shuffled per epoch, seeded by the job's seed and the epoch,
when ``data.shuffle`` is set). ``eval_prompts`` is a list. A finite source is read, and its errors
raised, on the call, not on the first ``next``. Whatever a source does wrong (a row that is no
PromptExample, an exception of its own, an endless split that ends) is a ``DataError`` naming it,
so the controller fails the job with that message instead of crashing.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from services.data.prompts import DataError, PromptExample
from services.data.sources import DATA_SOURCES, DataSource, SourceRequest, pick_source

if TYPE_CHECKING:
    from services.common.config import DataConfig

FINITE_ROWS_LIMIT = 10_000_000
"""Most rows a finite source may give: more, and it is taken for an endless one not declared so."""


def source_of(data: DataConfig, location: str) -> tuple[DataSource, str]:
    """The source that reads ``location`` (``data.train`` or ``data.eval``), and the location it
    gets; a ``DataError`` saying why there is none (a user's function that cannot be imported)."""
    try:
        name, rest = pick_source(data.source, location)
        return DATA_SOURCES.resolve(name), rest
    except DataError:
        raise
    except ValueError as err:  # PluginError is one
        raise DataError(str(err)) from None


def train_prompts(data: DataConfig, seed: int) -> Iterator[PromptExample]:
    """Endless training prompts of a job's data section, the same sequence for the same seed."""
    source, location = source_of(data, data.train)
    request = SourceRequest(location, "train", data, seed)
    rows = _call(source, request)
    if source.endless:
        return _endless(source, request, rows)
    return _epochs(_finite(source, request, rows), seed, data.shuffle)


def eval_prompts(data: DataConfig, limit: int | None = None) -> list[PromptExample]:
    """The first ``limit`` (all when None) held-out prompts; empty when ``data.eval`` is null."""
    if data.eval is None:
        return []
    source, location = source_of(data, data.eval)
    request = SourceRequest(location, "eval", data, 0)
    return _finite(source, request, _call(source, request), limit)


def _failed(source: DataSource, request: SourceRequest, err: Exception) -> DataError:
    where = f"data source {source.name!r} ({request.split} split of {request.location!r:.200})"
    return DataError(f"{where} failed: {type(err).__name__}: {err}")


def _call(source: DataSource, request: SourceRequest) -> Iterator[object]:
    try:
        return iter(source.fn(request))
    except DataError:
        raise
    except Exception as err:  # a user's source: its bug fails the job with its name, not the controller
        raise _failed(source, request, err) from err


def _checked(source: DataSource, request: SourceRequest, row: object) -> PromptExample:
    if not isinstance(row, PromptExample):
        raise DataError(
            f"data source {source.name!r} gave a {type(row).__name__} in its {request.split} rows,"
            " not a PromptExample (services.data.PromptExample)"
        )
    return row


def _endless(source: DataSource, request: SourceRequest, rows: Iterator[object]) -> Iterator[PromptExample]:
    while True:
        try:
            row = next(rows)
        except StopIteration:
            raise DataError(
                f"data source {source.name!r} declares endless=True but its {request.split} rows ended"
            ) from None
        except DataError:
            raise
        except Exception as err:
            raise _failed(source, request, err) from err
        yield _checked(source, request, row)


def _finite(
    source: DataSource, request: SourceRequest, rows: Iterator[object], limit: int | None = None
) -> list[PromptExample]:
    bound = FINITE_ROWS_LIMIT if limit is None else limit
    try:
        examples = [_checked(source, request, row) for row in itertools.islice(rows, bound + 1)]
    except DataError:
        raise
    except Exception as err:
        raise _failed(source, request, err) from err
    if limit is None and len(examples) > FINITE_ROWS_LIMIT:
        raise DataError(
            f"data source {source.name!r} gave more than {FINITE_ROWS_LIMIT} {request.split} rows;"
            " a source that generates forever declares endless=True (its eval split must be finite)"
        )
    if not examples:
        raise DataError(
            f"data source {source.name!r} gave no {request.split} prompts from {request.location!r:.200}"
        )
    return examples[:bound]


def _epochs(examples: Iterable[PromptExample], seed: int, shuffle: bool) -> Iterator[PromptExample]:
    epoch = 0
    while True:
        order = list(examples)
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        yield from order
        epoch += 1
