"""The prompt record every data source yields, its errors, and the one prompt encoding.

A data source (sources.py) yields ``PromptExample``s and raises ``DataError`` for data it
cannot read. Everyone encodes a prompt with ``encode_prompt`` so that the controller, the
engines and the trainer agree on the token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class DataError(ValueError):
    """A data source cannot give its prompts: an unknown task, a missing file, a bad row (named by its
    file and row), a source that failed; the message says which."""


class PromptTooLongError(ValueError):
    """A prompt encodes to more tokens than allowed (``DataConfig.max_prompt_tokens``)."""


@dataclass(frozen=True, slots=True)
class PromptExample:
    """One prompt and its reference answer. ``prompt_id`` is unique within its source and split."""

    prompt_id: str
    text: str
    answer: str


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that ``encode_prompt`` uses."""

    bos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...


def encode_prompt(tokenizer: PromptTokenizer, text: str, *, max_tokens: int | None = None) -> list[int]:
    """Token ids of a prompt: BOS, then the text's tokens without any other special tokens.

    Tokenizers disagree on whether they add BOS themselves; asking for none and
    prepending it here gives every component the same ids for the same text.
    Raises ``PromptTooLongError`` when ``max_tokens`` is given and exceeded.
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.bos_token_id is not None:
        ids.insert(0, int(tokenizer.bos_token_id))
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptTooLongError(
            f"prompt is {len(ids)} tokens, above the limit of {max_tokens}: {text[:80]!r}"
        )
    return ids
