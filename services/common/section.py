"""The base of every JobSpec section (``Section``) and the bounds their fields share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

PATH_CHARS = 4096
"""Longest path a JobSpec may name."""
DEEPSPEED_JSON_CHARS = 65_536
"""Longest `trainer.deepspeed`, as JSON text."""
Text = Annotated[str, Field(max_length=1024)]
"""A short free string of a list (a stop string, a tool name)."""


def _surrogate_free(value: Any, depth: int = 0) -> Any:
    """``value`` when no string in it has a lone surrogate (text that cannot be UTF-8)."""
    if isinstance(value, str):
        value.encode("utf-8")  # UnicodeEncodeError is a ValueError: pydantic names the field
    elif isinstance(value, dict | list | tuple) and depth < 64:
        for item in value.items() if isinstance(value, dict) else value:
            _surrogate_free(item, depth + 1)
    return value


class Section(BaseModel):
    """Base of every JobSpec section: unknown keys are errors, docstrings document fields."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if isinstance(value, str | list | dict):
            try:
                _surrogate_free(value)
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        return value
