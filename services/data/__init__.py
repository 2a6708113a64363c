"""verst's data layer: prompts, where they come from, and the one prompt encoding.

The public API, importable without torch::

    from services.data import train_prompts, eval_prompts, encode_prompt, PromptExample

Modules: ``prompts`` (``PromptExample``, ``encode_prompt`` and ``prompt_messages``, ``DataError``,
``PromptTooLongError``), ``chat`` (chat templates: rows' messages, rendering, tool turns),
``sources`` (the data-source contract and the ``DATA_SOURCES`` registry ``data.source`` names),
``splits`` (a job's train and eval prompts through its source), ``rows`` (one row of a file or
table as a PromptExample), and the sources ``jsonl``, ``tables`` (Parquet, CSV) and
``hf_datasets`` (``datasets`` directories). The toy tasks' source, ``builtin``, lives with the tasks
(``services/tasks/catalog.py``); this package never imports them.
"""

from services.data.jsonl import read_jsonl_prompts
from services.data.prompts import (
    DataError,
    PromptExample,
    PromptSettings,
    PromptTokenizer,
    PromptTooLongError,
    encode_prompt,
    prompt_messages,
)
from services.data.sources import DATA_SOURCES, DataSource, SourceRequest, Split, check_options
from services.data.splits import eval_prompts, source_of, train_prompts

__all__ = [
    "DATA_SOURCES",
    "DataError",
    "DataSource",
    "PromptExample",
    "PromptSettings",
    "PromptTokenizer",
    "PromptTooLongError",
    "SourceRequest",
    "Split",
    "check_options",
    "encode_prompt",
    "eval_prompts",
    "prompt_messages",
    "read_jsonl_prompts",
    "source_of",
    "train_prompts",
]
