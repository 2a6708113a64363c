"""Reward shaping: the runner's stage between the reward service's scores and the published group.

A job lists shapings in ``reward.shaping``, each ``{type: <name or module:function>, ...options}``;
the runner applies them in order to each group once it is scored, each to the rewards the one
before it returned. The contract, ``RewardShaping``: a pure function of a ``ShapingGroup`` and
its options (keyword arguments) returning the group's new rewards, one per sample, in sample
order. It must not mutate the group, block or import torch: it runs in the runner's event loop.

The verifier's reward stays visible: each Trajectory keeps it in ``verifier_reward`` (its
``reward`` is the shaped one, what the trainer's advantages read), and a sample whose scoring
failed keeps reward 0 whatever a shaping returns. Held-out evaluation scores its samples
itself and is never shaped.

A shaping's traits: ``options``, a pydantic model its options are validated with (built-ins: when
the JobSpec is validated; a user's: in the runner, before its first group), and ``needs_texts``,
whether the runner decodes the responses for it. A user's shaping declares them with
``@services.common.plugins.traits``; examples/plugins/reward_shaping.py is one.

Built-in: ``overlong_penalty``, DAPO's soft over-long punishment (Yu et al. 2025, eq. 13). This
module is torch-free and imports no service: the JobSpec imports it to check names and options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.registry import Entry, Registry

FIELD = "reward.shaping.type"


@dataclass(frozen=True, slots=True)
class ShapingGroup:
    """One scored group, as a shaping sees it: per sample, in sample order."""

    rewards: tuple[float, ...]
    """The rewards so far: the verifier's, or what the shaping before this one returned."""
    verifier_rewards: tuple[float, ...]
    """The reward service's rewards, before any shaping."""
    response_lengths: tuple[int, ...]
    """Response tokens (model turns and tool output together, as max_new_tokens counts them)."""
    finish_reasons: tuple[int, ...]
    """How each response ended (``common_pb2.FinishReason``: STOP, LENGTH, ABORT, TOOL_CALL...)."""
    max_new_tokens: int
    """The job's response budget (rollout.max_new_tokens), the longest a response may be."""
    prompt_text: str = ""
    answer: str = ""
    """The task's reference answer."""
    texts: tuple[str, ...] = ()
    """The decoded responses, when the shaping declares ``needs_texts``; empty otherwise."""


class RewardShaping(Protocol):
    """``shape(group, **options) -> rewards``: the group's new rewards, one finite float per sample."""

    def __call__(self, group: ShapingGroup, /, **options: Any) -> Sequence[float]: ...


@dataclass(frozen=True, slots=True)
class RewardShapingEntry(Entry[Callable[..., Sequence[float]]]):
    """A reward shaping and what the runner does for it."""

    options: type[BaseModel] | None = None
    """Validates the options of a ``reward.shaping`` entry (the keys besides ``type``), which reach
    the function as keyword arguments; None: the options are passed as they are."""
    needs_texts: bool = False
    """The runner decodes the group's responses into ``ShapingGroup.texts`` for it."""


REWARD_SHAPINGS: Registry[RewardShapingEntry] = Registry(
    RewardShapingEntry, kind="reward shaping", field=FIELD, owner="runner"
)
"""Every built-in shaping by the name a ``reward.shaping`` entry's ``type`` uses (or a user's
``module:function``, ``REWARD_SHAPINGS.resolve``)."""


class OverlongPenaltyOptions(BaseModel):
    """Options of ``overlong_penalty``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1, le=1_048_576)
    """L_max, the longest response before the full penalty; null: rollout.max_new_tokens."""
    buffer_tokens: int = Field(ge=1, le=1_048_576)
    """L_cache, the punishment buffer: the penalty grows linearly over the last this many tokens."""
    factor: float = Field(1.0, ge=0.0, le=1000.0)
    """Weight of the penalty added to the reward (1: DAPO's, down to -1)."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongPenaltyOptions:
        if self.max_tokens is not None and self.buffer_tokens > self.max_tokens:
            raise ValueError(f"buffer_tokens {self.buffer_tokens} exceeds max_tokens {self.max_tokens}")
        return self


def overlong_length_penalty(length: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's R_length(y): 0 up to L_max - L_cache tokens, then down linearly to -1 at L_max, and
    -1 beyond it."""
    free = max_tokens - buffer_tokens
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / buffer_tokens
    return -1.0


@REWARD_SHAPINGS.register("overlong_penalty", options=OverlongPenaltyOptions)
def overlong_penalty(
    group: ShapingGroup, /, *, buffer_tokens: int, max_tokens: int | None = None, factor: float = 1.0
) -> list[float]:
    """Each reward plus ``factor`` x R_length of its response (DAPO's soft over-long punishment)."""
    limit = max_tokens if max_tokens is not None else group.max_new_tokens
    if buffer_tokens > limit:
        raise ValueError(f"buffer_tokens {buffer_tokens} exceeds max_tokens {limit}")
    return [
        reward + factor * overlong_length_penalty(length, limit, buffer_tokens)
        for reward, length in zip(group.rewards, group.response_lengths, strict=True)
    ]


def check_shaping_options(entry: RewardShapingEntry, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` validated by the entry's model (its defaults left out, so the function's own
    apply); a ValueError naming each bad option otherwise."""
    if entry.options is None:
        return options
    try:
        checked = entry.options.model_validate(options)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in err.errors())
        raise ValueError(f"{entry.name} options: {problems}") from None
    return checked.model_dump(exclude_unset=True)
