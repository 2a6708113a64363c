"""The prompt record every data source yields, its errors, and the one prompt encoding.

A data source (sources.py) yields ``PromptExample``s and raises ``DataError`` for data it
cannot read. Everyone encodes a prompt with ``encode_prompt`` so that the controller (its feed
and its evaluations), the api's checks and the engines agree on the token ids; the trainer gets
those ids in the trajectories and never tokenizes a prompt itself.

A prompt is encoded in one of two formats (``data.format``):

- ``text``: BOS (when the tokenizer has one and the text does not start with it), then the
  text's tokens without any other special tokens. Tokenizers disagree on whether they add BOS
  themselves; asking for none and prepending it here gives the same ids for the same text.
- ``chat``: the prompt's messages rendered by the tokenizer's own chat template with the
  assistant's turn opened (``apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True, **data.chat_template_kwargs)``, chat.py). The template alone decides the
  special tokens, so a template that emits BOS (Llama 3's) has exactly one. A row's
  ``messages`` are the messages; a prompt string is the user's turn, after
  ``data.system_prompt`` as the system turn when it is set.

``auto`` picks chat for a row with messages or a tokenizer with a chat template, else text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from services.data.chat import ChatTemplateError, has_chat_template, render_ids

PromptFormat = Literal["auto", "text", "chat"]
"""``data.format``: how a prompt becomes tokens."""
VERST_METADATA_KEYS = frozenset(
    {"source_prompt_id", "transcript", "tool_calls", "tool_errors", "resumes", "task_policy_version"}
)
"""Keys verst itself writes into a task's, a score request's or a trajectory's metadata: a row's
``data.metadata_fields`` may not use them."""


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
    """The prompt as text: the prompt string, or for a row of messages its last user turn (for
    verifiers and logs; a chat prompt is encoded from its messages)."""
    answer: str
    messages: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    """The row's chat messages (OpenAI format, system turns included); empty for a prompt string."""
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    """The row's ``data.metadata_fields``, passed to the reward with every sample of the prompt."""


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that ``encode_prompt`` uses."""

    bos_token_id: int | None

    def __call__(self, text: str, *, add_special_tokens: bool) -> Any: ...


class PromptSettings(Protocol):
    """The fields of the job's data section (``DataConfig``) that decide a prompt's encoding."""

    @property
    def format(self) -> PromptFormat: ...

    @property
    def system_prompt(self) -> str | None: ...

    @property
    def chat_template_kwargs(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class TextPrompts:
    """Settings of the text format: what ``encode_prompt`` uses when given none."""

    format: PromptFormat = "text"
    system_prompt: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


TEXT = TextPrompts()


def prompt_messages(
    tokenizer: Any, prompt: str | PromptExample, settings: PromptSettings | None = None
) -> list[dict[str, Any]] | None:
    """The chat messages ``prompt`` is rendered from, or None when it is encoded as text.

    ``DataError`` (naming the prompt and the field) when the settings and the prompt disagree:
    messages, or a system prompt, without a chat template to render them.
    """
    example = _example(prompt)
    settings = settings or TEXT
    name = example.prompt_id or repr(example.text[:80])
    templated = has_chat_template(tokenizer, settings.chat_template_kwargs)
    wants_chat = settings.format == "chat" or (
        settings.format == "auto" and (bool(example.messages) or templated)
    )
    if not wants_chat:
        if example.messages:
            raise DataError(f"prompt {name} has chat messages, which data.format text cannot encode")
        if settings.system_prompt is not None:
            raise DataError(
                "data.system_prompt needs the chat format, and the tokenizer has no chat template"
                " (data.format auto encodes these prompts as text)"
            )
        return None
    if not templated:
        raise DataError(
            f"prompt {name} is a chat prompt (data.format {settings.format}) but the tokenizer has no"
            " chat template: use a tokenizer with one, or give a template as"
            " data.chat_template_kwargs.chat_template"
        )
    messages = [dict(message) for message in example.messages] or [{"role": "user", "content": example.text}]
    if settings.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": settings.system_prompt})
    return messages


def encode_prompt(
    tokenizer: PromptTokenizer,
    prompt: str | PromptExample,
    *,
    settings: PromptSettings | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids of a prompt, in the format ``settings`` (the job's ``data`` section) decide; text
    when None (the module docstring says how each format encodes).

    Raises ``DataError`` for a prompt the settings cannot encode (a chat template that refuses the
    messages included), and ``PromptTooLongError`` when ``max_tokens`` is given and exceeded.
    """
    example = _example(prompt)
    messages = prompt_messages(tokenizer, example, settings)
    if messages is None:
        ids = encode_text(tokenizer, example.text)
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
    else:
        kwargs = (settings or TEXT).chat_template_kwargs
        try:
            ids = render_ids(tokenizer, messages, kwargs)
        except ChatTemplateError as err:
            raise DataError(f"prompt {example.prompt_id or repr(example.text[:80])}: {err}") from None
    if max_tokens is not None and len(ids) > max_tokens:
        raise PromptTooLongError(
            f"prompt is {len(ids)} tokens, above the limit of {max_tokens}: {example.text[:80]!r}"
        )
    return ids


def encode_text(tokenizer: PromptTokenizer, text: str) -> list[int]:
    """``text``'s token ids without special tokens, as ``tokenizer(text, add_special_tokens=False)``
    gives them.

    A fast tokenizer that encodes as transformers' does, whose backend neither truncates nor pads
    and splits special tokens as the tokenizer says, encodes through its Rust backend directly:
    ``__call__`` around that same ``encode`` costs five times the encoding (42 against 7.7 us for
    a short prompt): it was a fifth of the controller's CPU per issued prompt.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _encodes_plainly(tokenizer, backend):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(backend.encode(text, add_special_tokens=False).ids)


def _encodes_plainly(tokenizer: Any, backend: Any) -> bool:
    """Whether ``tokenizer(text, add_special_tokens=False)`` is its backend's ``encode`` as the
    backend is set now (``__call__`` turns truncation and padding off, and sets whether special
    tokens' text splits, before it encodes)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    kind = type(tokenizer)
    return (
        kind.__call__ is PreTrainedTokenizerBase.__call__
        and getattr(kind, "_encode_plus", None) is PreTrainedTokenizerFast._encode_plus
        and not getattr(tokenizer, "_in_target_context_manager", False)
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))
    )


def _example(prompt: str | PromptExample) -> PromptExample:
    return prompt if isinstance(prompt, PromptExample) else PromptExample("", prompt, "")
