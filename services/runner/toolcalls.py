"""Tool calls in the text of one model turn: the formats verst reads, and how.

- ``hermes``: ``<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>``,
  the format of Hermes and Qwen chat templates (whitespace around the JSON is fine). The
  arguments may also be a JSON string holding the object (OpenAI style), and ``parameters``
  is read as ``arguments`` (Llama 3's JSON calls).
- ``python_tag``: ``<python>print(1)</python>``, the short form of the ``python`` tool: the
  text between the tags is the code as it is, less leading and trailing blank lines and any
  common indentation.
- ``json``: a turn whose whole text, surrounding whitespace aside, is one bare JSON object
  ``{"name": ..., "arguments": {...}}`` or a JSON list of them. Any other JSON (an answer
  that happens to be JSON) is not a call.

``auto`` reads the two tagged forms, in the order they appear, and the bare form when the
turn has no tag. Only complete calls count: an opening tag without its closing tag is text
(a turn cut short by its budget or by an end-of-sequence token calls nothing). A complete
call whose body is not a well-formed call (not JSON, no name, arguments not an object) is
returned with ``error`` set, so the episode can show the model what was wrong instead of
silently ending.

The closing tags are the end-of-call markers: the episode sends them as stop strings, so a
turn ends right after its call.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
PYTHON_TAG = "python_tag"
JSON = "json"
FORMATS: tuple[str, ...] = (HERMES, PYTHON_TAG, JSON)
"""Every format, in the order ``auto`` tries them."""

_OPEN = {HERMES: "<tool_call>", PYTHON_TAG: "<python>"}
_CLOSE = {HERMES: "</tool_call>", PYTHON_TAG: "</python>"}
SHAPE = 'expected {"name": "<tool>", "arguments": {...}}'


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call found in a turn."""

    name: str
    """The tool's name; empty when the call is too malformed to name one."""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the call is malformed; empty for a well-formed call."""

    @property
    def arguments_json(self) -> str:
        """The arguments as ExecuteRequest.arguments_json wants them."""
        return json.dumps(self.arguments, ensure_ascii=False)


def formats_of(name: str) -> tuple[str, ...]:
    """The formats a ``tool_call_format`` setting reads: ``auto`` is all of them."""
    if name == "auto":
        return FORMATS
    if name not in FORMATS:
        raise ValueError(f"unknown tool call format {name!r}; known: auto, {', '.join(FORMATS)}")
    return (name,)


def end_markers(formats: Collection[str]) -> list[str]:
    """The strings that end a call in ``formats``: stop strings for a turn that may call a tool."""
    return [_CLOSE[fmt] for fmt in FORMATS if fmt in formats and fmt in _CLOSE]


def parse_tool_calls(text: str, formats: Collection[str] = FORMATS) -> list[ToolCall]:
    """The complete tool calls in ``text``, in order (see the module docstring)."""
    calls = _tagged_calls(text, [fmt for fmt in _OPEN if fmt in formats])
    if not calls and JSON in formats:
        calls = _bare_calls(text)
    return calls


def _tagged_calls(text: str, formats: list[str]) -> list[ToolCall]:
    if not formats:
        return []
    opening = re.compile("|".join(re.escape(_OPEN[fmt]) for fmt in formats))
    by_tag = {_OPEN[fmt]: fmt for fmt in formats}
    calls: list[ToolCall] = []
    position = 0
    while (match := opening.search(text, position)) is not None:
        fmt = by_tag[match.group()]
        found = _hermes(text, match.end()) if fmt == HERMES else _python_tag(text, match.end())
        if found is None:  # no closing tag: an incomplete call is text, and so is the rest
            break
        call, position = found
        calls.append(call)
    return calls


def _hermes(text: str, start: int) -> tuple[ToolCall, int] | None:
    """The call whose JSON starts at ``start`` and the index after its closing tag.

    The first closing tag after which the body parses ends the call, so code whose strings
    hold the closing tag itself still parses; when none does, the first one ends it."""
    close = _CLOSE[HERMES]
    first = text.find(close, start)
    if first < 0:
        return None
    end, first_error = first, ""
    while end >= 0:
        try:
            body = json.loads(text[start:end])
        except ValueError as err:
            first_error = first_error or str(err)
            end = text.find(close, end + len(close))
            continue
        return from_json(body), end + len(close)
    error = f"the tool call is not valid JSON ({first_error}); {SHAPE}"
    return ToolCall("", error=error), first + len(close)


def _python_tag(text: str, start: int) -> tuple[ToolCall, int] | None:
    close = _CLOSE[PYTHON_TAG]
    end = text.find(close, start)
    if end < 0:
        return None
    code = textwrap.dedent(text[start:end].strip("\r\n"))
    return ToolCall("python", {"code": code}), end + len(close)


def _bare_calls(text: str) -> list[ToolCall]:
    """The call(s) of a turn that is one bare JSON object (or a list of them), else none."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return []
    try:
        value = json.loads(stripped)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, dict) and "name" in item for item in items):
        return []
    return [from_json(item) for item in items]


def from_json(value: Any) -> ToolCall:
    """The call a parsed JSON value describes, or a malformed call saying what is wrong."""
    if not isinstance(value, dict):
        return ToolCall("", error=f"a tool call must be a JSON object; {SHAPE}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error=f'the tool call has no "name" string; {SHAPE}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: the arguments object serialized as a string
        try:
            arguments = json.loads(arguments)
        except ValueError as err:
            return ToolCall(name, error=f"the arguments string is not valid JSON ({err})")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"arguments" must be a JSON object; {SHAPE}')
    return ToolCall(name, arguments)
