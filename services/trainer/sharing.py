"""Which samples of a step share a prompt in their row (``batching.collate(shared=True)``):
the units of a row, their laid-out length, and whether a step shares at all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TrainSample(Protocol):
    """What sharing reads of a ``batching.TrainSample``."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def response_token_ids(self) -> Sequence[int]: ...
    @property
    def length(self) -> int: ...


SHARED_UNIT_TOKENS = 1024
"""At most this many tokens share one prompt (longer groups are cut into pieces): wider rows
make attention dearer than the prompt tokens a piece saves (at batching.ATTENTION_WIDTH, the
same 1,024, attention costs a token as much as the rest of its forward and backward)."""
SHARED_SAMPLE_TOKENS = SHARED_UNIT_TOKENS // 2
"""Prompts are shared only in steps whose samples are all this short: longer ones leave a piece
one sample (nothing shared), and their rows would need masks of width x width."""


def sharing_pays(samples: Sequence[TrainSample], shared: bool) -> bool:
    """Whether a step's ``samples`` are laid out with shared prompts (``shared`` asked for it)."""
    return shared and bool(samples) and max(s.length for s in samples) <= SHARED_SAMPLE_TOKENS


def row_units(samples: Sequence[TrainSample], row: Sequence[int]) -> list[list[int]]:
    """The samples of ``row`` as units: runs of consecutive samples with the same prompt (of
    at least two tokens: a shorter one has nothing to share)."""
    units: list[list[int]] = []
    for index in row:
        prompt = samples[index].prompt_token_ids
        previous = samples[units[-1][0]].prompt_token_ids if units else None
        if previous is not None and len(prompt) > 1 and list(prompt) == list(previous):
            units[-1].append(index)
        else:
            units.append([index])
    return units


def unit_length(samples: Sequence[TrainSample], unit: Sequence[int]) -> int:
    """Tokens of a unit laid out: its prompt but the last token once, then per sample that last
    token and the response (a unit of one sample: just the sample)."""
    prompt = len(samples[unit[0]].prompt_token_ids)
    return (
        prompt - 1 + sum(1 + len(samples[i].response_token_ids) for i in unit)
        if prompt
        else sum(samples[i].length for i in unit)
    )
