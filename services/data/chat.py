"""Chat prompts: rows' messages checked, rendered by the tokenizer's own chat template, and the
tool turns of a multi-turn episode appended in the template's format.

Rendering is ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
**data.chat_template_kwargs)``: the template decides every special token, and transformers
tokenizes its text without adding any (so a template that emits BOS has one BOS).

Tool turns stay token-in/token-out: the tokens of the turns so far are never rendered or
tokenized again. After a model turn that called tools, ``tool_turn_ids`` renders the
conversation twice, with and without the tool results (and the next assistant turn opened),
checks that the first is a prefix of the second (a template that rewrites earlier turns once
more follow cannot be extended token by token), and tokenizes only what the tool turn adds:
the end of the model's turn as the template writes it (``<|im_end|>\\n``), the tool turns,
and the next turn's opening. An end-of-turn token the model produced itself is not repeated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TEMPLATE_KWARGS_SET_BY_VERST = frozenset(
    {
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
"""Arguments of ``apply_chat_template`` that verst sets: ``data.chat_template_kwargs`` may not."""
MODEL_TURN_PROBE = "\x00verst-model-turn\x00"
"""Content of a stand-in model turn: where it ends in the rendering, the template's end of turn begins."""


class ChatTemplateError(ValueError):
    """The chat template cannot render the conversation (it refused it, or rewrites earlier turns)."""


def has_chat_template(tokenizer: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether prompts can be rendered as chat: the tokenizer has a template, or the job gives one."""
    return bool(kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None))


def render_text(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any], *, generation: bool
) -> str:
    """The template's text for ``messages``, the assistant's next turn opened when ``generation``."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation, tokenize=False, **kwargs
        )
    except Exception as err:  # jinja's TemplateError, raise_exception() of a template, a TypeError
        raise ChatTemplateError(f"the chat template cannot render it: {type(err).__name__}: {err}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered a {type(text).__name__}, not text")
    return text


def render_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], kwargs: Mapping[str, Any]) -> list[int]:
    """Token ids of ``messages`` rendered by the template, the assistant's turn opened."""
    try:
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **kwargs
        )
    except Exception as err:
        raise ChatTemplateError(f"the chat template cannot render it: {type(err).__name__}: {err}") from None
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return [int(token) for token in out]


def tool_turn_ids(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    turn_text: str,
    turn_ids: Sequence[int],
    tool_messages: Sequence[Mapping[str, Any]],
    kwargs: Mapping[str, Any],
) -> list[int]:
    """Token ids to append after a model turn that called tools (the module docstring says how).

    ``conversation``: the messages up to that turn; ``turn_text``/``turn_ids``: the turn as the
    model produced it; ``tool_messages``: the tool turns (``{"role": "tool", ...}``).
    """
    turn = {"role": "assistant", "content": turn_text}
    without = render_text(tokenizer, [*conversation, turn], kwargs, generation=False)
    extended = render_text(tokenizer, [*conversation, turn, *tool_messages], kwargs, generation=True)
    if not extended.startswith(without):
        raise ChatTemplateError(
            "the chat template renders the earlier turns differently once a tool turn follows,"
            " so tool results cannot be appended without rewriting tokens the model already saw"
        )
    probe = render_text(
        tokenizer,
        [*conversation, {"role": "assistant", "content": MODEL_TURN_PROBE}],
        kwargs,
        generation=False,
    )
    at = probe.rfind(MODEL_TURN_PROBE)
    if at < 0:
        raise ChatTemplateError("the chat template does not show an assistant turn's content as it is")
    turn_end = probe[at + len(MODEL_TURN_PROBE) :]
    ids = list(tokenizer(turn_end + extended[len(without) :], add_special_tokens=False)["input_ids"])
    return ids[_produced_end(tokenizer, turn_ids, ids, turn_end) :]


def _produced_end(tokenizer: Any, turn_ids: Sequence[int], ids: list[int], turn_end: str) -> int:
    """How many leading ``ids`` (special tokens of the template's end of turn) the model's turn
    already ends with: a turn stopped by its end-of-turn token has it among its own tokens."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    end_length = len(tokenizer(turn_end, add_special_tokens=False)["input_ids"])
    for k in range(min(end_length, len(turn_ids), len(ids)), 0, -1):
        if list(turn_ids[-k:]) == ids[:k] and all(token in special for token in ids[:k]):
            return k
    return 0


def check_tool_turns(tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
    """``ChatTemplateError`` when the template cannot append a tool turn to a model's turn (one that
    refuses the tool role, or rewrites earlier turns): checked before a multi-turn job starts."""
    conversation = [{"role": "user", "content": "1+1?"}]
    tool = [{"role": "tool", "name": "python", "content": "2"}]
    tool_turn_ids(tokenizer, conversation, '{"name": "python"}', [], tool, kwargs)


def check_messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """A row's messages as dicts, keys whose value is null dropped (a table's missing keys);
    ``ValueError`` saying what is wrong, prefixed with ``where``.

    A list of OpenAI chat messages: objects with a ``role`` and a ``content`` (a string, or a list
    of content parts), ending with a turn the model answers (not the assistant's own). JSON text
    holding such a list (a CSV cell) is read as the list.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"{where}: not a list of messages, nor JSON text of one ({err})") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of chat messages, got {type(value).__name__}")
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}: message {number} is a {type(message).__name__}, not an object")
        message = {key: item for key, item in message.items() if item is not None}
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: message {number} has no role")
        if not (isinstance(content, (str, list)) or (content is None and "tool_calls" in message)):
            raise ValueError(f"{where}: message {number} ({role}) has no content string or list of parts")
        messages.append(message)
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            f"{where}: the last message is the assistant's; a prompt ends with a turn it answers"
        )
    try:
        json.dumps(messages)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: messages must be plain JSON ({err})") from None
    return tuple(messages)


def last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the last user turn (its text parts joined): a chat prompt's text for readers."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            parts = content if isinstance(content, list) else []
            return "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
    return ""
