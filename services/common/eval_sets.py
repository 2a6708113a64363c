"""A job's held-out sets: `data.eval` (the default set) and the named ones of `eval.sets`, each read
through the data source its section names (services/data), as the controller evaluates them and the
api checks them.

The default set's metrics are unprefixed (`eval/accuracy`), a named set's carry its name
(`eval/<name>/accuracy`), so a job that names no set reads as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import DEFAULT_EVAL_SET, DataConfig, JobSpec
from services.data import PromptExample, eval_prompts


@dataclass(frozen=True, slots=True)
class EvalSetSource:
    """Where one held-out set of a job comes from."""

    name: str
    """`default` for `data.eval`, else its key in `eval.sets`."""
    field: tuple[str, ...]
    """The JobSpec field its location is in (errors name it)."""
    data: DataConfig
    """The job's data section as this set reads it (its location in `eval`, its split in
    `eval_split`)."""
    num_prompts: int
    """How many of its prompts an evaluation takes (at most)."""


def metric_prefix(name: str) -> str:
    """What the metric names of set ``name`` start with: nothing for the default set, else `<name>/`."""
    return "" if name == DEFAULT_EVAL_SET else f"{name}/"


def eval_set_sources(spec: JobSpec) -> list[EvalSetSource]:
    """The job's held-out sets, the default one (when `data.eval` is not null) first."""
    found = []
    if spec.data.eval is not None:
        found.append(EvalSetSource(DEFAULT_EVAL_SET, ("data", "eval"), spec.data, spec.eval.num_prompts))
    for name, entry in spec.eval.sets.items():
        count = entry.num_prompts or spec.eval.num_prompts
        data = entry.data_config(spec.data)
        found.append(EvalSetSource(name, ("eval", "sets", name, "location"), data, count))
    return found


def read_eval_set(source: EvalSetSource, limit: int | None = None) -> list[PromptExample]:
    """The set's first ``limit`` (default: ``num_prompts``) prompts, through its data source's
    eval split (``eval_prompts``); the source's ``DataError`` when they cannot be read."""
    return eval_prompts(source.data, source.num_prompts if limit is None else limit)
