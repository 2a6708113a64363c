"""The ``reasoning_gym`` data source: the procedural tasks of the reasoning-gym package.

``data.train: reasoning_gym:<dataset>`` (``reasoning_gym:chain_sum``) reads dataset ``<dataset>``
of ``reasoning_gym.create_dataset``; ``data.options`` configures it (the same options serve both
splits):

- ``size`` (1000): training rows, repeated epoch after epoch (shuffled per epoch by the job's seed
  when ``data.shuffle`` is set);
- ``seed`` (0): the dataset's seed. The rows depend on it and the options alone, never on the
  job's seed, so every job with the same options trains and is evaluated on the same questions;
- ``eval_size`` (100): held-out rows, drawn from the dataset at seed ``seed + 2**31`` and kept
  only when their question is no training question (nor an earlier held-out one), so the eval split
  is disjoint from the train split whatever the dataset. Too few such questions is a ``DataError``;
- ``extractor`` (``answer_tag``): how the ``reasoning_gym`` verifier takes the answer out of a
  response (``EXTRACTORS``); it travels with each row, since the row's instruction asks for it;
- ``instruction``: one of reasoning-gym's system prompts (``reasoning_gym.utils.SYSTEM_PROMPTS``)
  or ``none``, put before each question; ``default`` (reasoning-gym's own, asking for
  ``<answer>…</answer>``) with the ``answer_tag`` extractor, ``none`` with the others;
- every other key is the dataset's own configuration (``min_terms``, ``max_digits`` for
  ``chain_sum``); ``composite`` takes ``datasets: [{name, weight, config}]``.

A row's prompt is the instruction and the question, its answer the dataset's answer; its
``metadata`` (``ROW_KEYS``) carries what the dataset's ``score_answer`` needs, to the reward
service with each sample: the dataset, its configuration, the whole entry (``encode_entry``: JSON
that keeps tuples tuples, checked to decode back to the entry) and the extractor. ``gym_row``
reads them back. reasoning-gym is imported on first use: the reward service imports this module
for ``gym_row``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from services.data.prompts import DataError, PromptExample
from services.data.sources import SourceRequest

SOURCE = "reasoning_gym"
"""The source's name, and the ``<name>:`` of its locations."""
EXTRACTORS = ("answer_tag", "last_number", "whole")
"""How the verifier finds a response's answer: the last ``<answer>…</answer>`` (reasoning-gym's own
``extract_answer``), the last number, or the whole response stripped."""
NO_INSTRUCTION = "none"
"""``instruction``: the question alone."""
EVAL_SEED_OFFSET = 2**31
"""Added to ``seed`` for the held-out rows: apart from the training rows' seeds (``seed + index``)."""
MAX_SEED = 2**30
"""Largest ``seed``: held-out seeds plus indices stay below 2**32 (numpy's bound)."""
EVAL_SCAN_FACTOR = 10
"""Held-out candidates looked at per row wanted (plus ``EVAL_SCAN_EXTRA``) before giving up."""
EVAL_SCAN_EXTRA = 1000
TUPLE_TAG = "__tuple__"
"""How ``encode_entry`` writes a tuple: ``{"__tuple__": [...]}`` (scorers compare tuples to tuples)."""

DATASET_KEY = "reasoning_gym.dataset"
CONFIG_KEY = "reasoning_gym.config"
ENTRY_KEY = "reasoning_gym.entry"
EXTRACTOR_KEY = "reasoning_gym.extractor"
ROW_KEYS = (DATASET_KEY, CONFIG_KEY, ENTRY_KEY, EXTRACTOR_KEY)
"""The metadata a row carries to the verifier."""


@dataclass(frozen=True, slots=True)
class GymOptions:
    """``data.options`` of a reasoning-gym job, checked."""

    dataset: str
    config: dict[str, Any]
    """The dataset's own configuration keys."""
    size: int = 1000
    seed: int = 0
    eval_size: int = 100
    extractor: str = "answer_tag"
    instruction: str = "default"


_INTS = {"size": (1, 100_000), "seed": (0, MAX_SEED), "eval_size": (1, 100_000)}
"""The integer options and their bounds (verst holds a finite source's rows, each with its entry)."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GymOptions) if f.name in _INTS}
OWN_OPTIONS = frozenset({*_INTS, "extractor", "instruction"})
"""The options this source takes itself; the rest go to the dataset."""


@dataclass(frozen=True, slots=True)
class GymRow:
    """What a row's metadata gives the verifier."""

    dataset: str
    config: str
    """The dataset's configuration as JSON (sorted keys: one text per configuration)."""
    entry: dict[str, Any]
    extractor: str


def reasoning_gym_source(request: SourceRequest) -> Iterator[PromptExample]:
    """The rows of the split ``request.split`` of dataset ``request.location``."""
    options = gym_options(request)
    make = _row_maker(options)
    train = create_dataset(options.dataset, {**options.config, "size": options.size, "seed": options.seed})
    if request.split == "train":
        return (make(f"train:{index}", entry) for index, entry in enumerate(_entries(train, options)))
    return _held_out(options, _entries(train, options), make)


def gym_options(request: SourceRequest) -> GymOptions:
    """``data.options`` checked: a ``DataError`` naming ``data.train`` (or ``data.eval``) for an
    unknown dataset and ``data.options`` for a key or value the dataset does not take."""
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    name = request.location
    if name not in DATASETS:
        near = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f"did you mean {', '.join(near)}?" if near else f"known: {', '.join(sorted(DATASETS))}"
        raise DataError(f"data.{request.split}: reasoning-gym has no dataset {name!r} ({hint})")
    options = dict(request.data.options)
    own = {key: options.pop(key) for key in OWN_OPTIONS & options.keys()}
    fields = {f.name for f in dataclasses.fields(DATASETS[name][1])} - {"size", "seed"}
    unknown = sorted(set(options) - fields)
    if unknown:
        accepted = ", ".join(sorted(OWN_OPTIONS | fields))
        raise DataError(
            f"data.options: reasoning-gym's {name} takes no {', '.join(unknown)} (it takes {accepted})"
        )
    for key, (low, high) in _INTS.items():
        value = own.get(key, _DEFAULTS[key])
        if type(value) is not int or not low <= value <= high:
            raise DataError(f"data.options.{key}: must be an integer from {low} to {high}, got {value!r}")
    extractor = own.get("extractor", "answer_tag")
    if not isinstance(extractor, str) or extractor not in EXTRACTORS:
        raise DataError(f"data.options.extractor: must be one of {', '.join(EXTRACTORS)}, got {extractor!r}")
    instruction = own.get("instruction", "default" if extractor == "answer_tag" else NO_INSTRUCTION)
    if not isinstance(instruction, str) or instruction not in {*SYSTEM_PROMPTS, NO_INSTRUCTION}:
        known = ", ".join([*SYSTEM_PROMPTS, NO_INSTRUCTION])
        raise DataError(f"data.options.instruction: must be one of {known}, got {instruction!r}")
    own.update(extractor=extractor, instruction=instruction)
    return GymOptions(name, options, **own)


def create_dataset(name: str, config: Mapping[str, Any]) -> Any:
    """``reasoning_gym.create_dataset(name, **config)``; what it refuses is a ``DataError`` naming
    ``data.options`` (configurations check themselves with ``assert``)."""
    from reasoning_gym import create_dataset as create
    from reasoning_gym.composite import DatasetSpec

    kwargs = dict(config)
    if name == "composite" and isinstance(kwargs.get("datasets"), list):  # JSON gives dicts
        try:
            kwargs["datasets"] = [DatasetSpec(**spec) for spec in kwargs["datasets"]]
        except TypeError as err:
            raise DataError(f"data.options.datasets: each is {{name, weight, config}}: {err}") from None
    try:
        return create(name, **kwargs)
    except (AssertionError, TypeError, ValueError, KeyError, AttributeError) as err:
        shown = {k: v for k, v in config.items() if k not in ("size", "seed")}
        raise DataError(
            f"data.options: reasoning-gym's {name} refuses {shown}: {err or type(err).__name__}"
        ) from None


def _entries(dataset: Any, options: GymOptions) -> Iterator[dict[str, Any]]:
    for index in range(len(dataset)):
        entry = dataset[index]
        if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
            raise DataError(f"reasoning-gym's {options.dataset} gave row {index} without a question")
        yield entry


def _held_out(
    options: GymOptions, train: Iterator[dict[str, Any]], make: Callable[[str, dict[str, Any]], PromptExample]
) -> Iterator[PromptExample]:
    """The first ``eval_size`` rows at the held-out seed whose questions are new."""
    seen = {entry["question"] for entry in train}
    scan = options.eval_size * EVAL_SCAN_FACTOR + EVAL_SCAN_EXTRA
    config = {**options.config, "size": scan, "seed": options.seed + EVAL_SEED_OFFSET}
    kept = 0
    for index, entry in enumerate(_entries(create_dataset(options.dataset, config), options)):
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        yield make(f"eval:{index}", entry)
        kept += 1
        if kept == options.eval_size:
            return
    raise DataError(
        f"data.options: only {kept} of {scan} held-out questions of reasoning-gym's {options.dataset}"
        f" are new to its {options.size} training ones, below eval_size {options.eval_size};"
        " lower size or eval_size, or widen the dataset's configuration"
    )


def _row_maker(options: GymOptions) -> Callable[[str, dict[str, Any]], PromptExample]:
    """The function making a row of ``options``' dataset from an entry and its id."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    instruction = "" if options.instruction == NO_INSTRUCTION else SYSTEM_PROMPTS[options.instruction]
    config = json.dumps(options.config, sort_keys=True)

    def make(row_id: str, entry: dict[str, Any]) -> PromptExample:
        question = entry["question"]
        text = f"{instruction.rstrip()}\n\n{question}" if instruction else question
        answer = entry.get("answer")
        metadata = {
            DATASET_KEY: options.dataset,
            CONFIG_KEY: config,
            ENTRY_KEY: _checked_encoding(entry, options.dataset, row_id),
            EXTRACTOR_KEY: options.extractor,
        }
        answer_text = "" if answer is None else str(answer)
        return PromptExample(f"{options.dataset}:{row_id}", text, answer_text, metadata=metadata)

    return make


def _checked_encoding(entry: dict[str, Any], dataset: str, row_id: str) -> str:
    try:
        text = encode_entry(entry)
        same = decode_entry(text) == entry
    except (TypeError, ValueError) as err:
        raise DataError(f"reasoning-gym's {dataset} row {row_id} cannot travel as JSON: {err}") from None
    if not same:  # a key that is no string, say: the scorer would see another entry
        raise DataError(f"reasoning-gym's {dataset} row {row_id} does not survive JSON unchanged")
    return text


def encode_entry(entry: Mapping[str, Any]) -> str:
    """An entry as JSON text; a tuple is ``{"__tuple__": [...]}``, so ``decode_entry`` restores it."""
    return json.dumps(_tag_tuples(entry), separators=(",", ":"), allow_nan=False)


def _tag_tuples(value: Any) -> Any:
    if isinstance(value, tuple):
        return {TUPLE_TAG: [_tag_tuples(item) for item in value]}
    if isinstance(value, list):
        return [_tag_tuples(item) for item in value]
    if isinstance(value, dict):
        return {key: _tag_tuples(item) for key, item in value.items()}
    return value


def decode_entry(text: str) -> dict[str, Any]:
    """The entry ``encode_entry`` wrote."""
    entry = json.loads(text, object_hook=lambda d: tuple(d[TUPLE_TAG]) if d.keys() == {TUPLE_TAG} else d)
    if not isinstance(entry, dict):
        raise ValueError(f"a reasoning-gym entry is a JSON object, got {type(entry).__name__}")
    return entry


def gym_row(metadata: Mapping[str, str]) -> GymRow:
    """The row a sample's metadata carries; a ValueError naming what is missing or malformed."""
    missing = [key for key in ROW_KEYS if not metadata.get(key)]
    if missing:
        raise ValueError(
            f"metadata lacks {', '.join(missing)}: the reasoning_gym verifier scores rows of"
            f" data.train: {SOURCE}:<dataset>, which carry them"
        )
    if metadata[EXTRACTOR_KEY] not in EXTRACTORS:
        raise ValueError(f"metadata {EXTRACTOR_KEY} must be one of {', '.join(EXTRACTORS)}")
    try:
        entry = decode_entry(metadata[ENTRY_KEY])
    except ValueError as err:  # json.JSONDecodeError is one
        raise ValueError(f"metadata {ENTRY_KEY} is no entry: {err}") from None
    return GymRow(metadata[DATASET_KEY], metadata[CONFIG_KEY], entry, metadata[EXTRACTOR_KEY])
